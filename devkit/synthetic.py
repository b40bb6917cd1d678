"""Deterministic, realistic multi-topic conversations for tests and benchmarks.

``generate(n, seed=..., with_tools=...)`` returns a :class:`Conversation` of exactly ``n``
OpenAI-format messages: a user and an assistant taking turns, moving between topics with
distinct vocabularies (``devkit.topics``: travel booking, database migration, birthday planning,
bug triage, budget planning, hiring, home renovation), a new topic every 6 to 30 messages (sometimes
announced: "New topic: ...", sometimes not), occasional tool calls (``tool_calls`` on an
assistant message, then one ``tool`` message per call, then the assistant's answer), and
explicit facts planted in some messages: ticket ids (``INV-2041``), booking references, flight
numbers, amounts (``$18,400``), percentages, ISO dates, people's names. Every planted fact is
listed in :attr:`Conversation.facts` with the index of the message that holds it verbatim.

Everything comes from one ``random.Random(seed)``: the same arguments give the same
conversation, on any machine and Python version (no ``hash()``, no set iteration).
Timestamps (:attr:`Conversation.created_at`) are spaced like a real chat: seconds to minutes
within a topic, hours or days between some topics.

``repetitive(n, seed=...)`` is the opposite case: messages whose few words repeat, as logs,
support threads and agent transcripts do ("message 412 about topic 10 with number 2884"), so
that a question's words ("new question 7 about topic 3") are held by most of them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from devkit.topics import TOPICS, Topic

__all__ = ["Conversation", "Fact", "TopicRun", "generate", "messages", "repetitive"]


@dataclass(frozen=True)
class Fact:
    """A fact planted verbatim in message ``index``."""

    index: int
    kind: str  # "ticket", "reference", "flight", "amount", "percent", "date", "name", "count"
    value: str


@dataclass(frozen=True)
class TopicRun:
    """Messages ``start``..``end`` (inclusive) are about ``topic``."""

    topic: str
    start: int
    end: int


@dataclass
class Conversation:
    """A generated conversation: the messages and what was planted in them."""

    messages: list[dict[str, Any]]
    created_at: list[datetime]
    facts: list[Fact]
    topics: list[TopicRun]

    def with_created_at(self) -> list[dict[str, Any]]:
        """The messages with an ISO 8601 ``created_at`` each (the import format)."""
        return [
            {**message, "created_at": stamp.isoformat()}
            for message, stamp in zip(self.messages, self.created_at, strict=True)
        ]

    def write_jsonl(self, path: Path) -> None:
        """One message a line, with ``created_at``: a file ``memstrata import`` reads."""
        with path.open("w", encoding="utf-8") as out:
            for message in self.with_created_at():
                out.write(json.dumps(message) + "\n")

    def facts_of(self, index: int) -> list[Fact]:
        return [fact for fact in self.facts if fact.index == index]


@dataclass
class _Slots:
    """Values drawn for one topic run, reused across its messages (people repeat themselves)."""

    rng: random.Random
    values: dict[str, str] = field(default_factory=dict)
    planted: list[tuple[str, str]] = field(default_factory=list)
    decks: dict[str, list[str]] = field(default_factory=dict)

    def draw(self, key: str, templates: Sequence[str]) -> str:
        """One of ``templates``, none twice before all were used (few verbatim repeats)."""
        deck = self.decks.setdefault(key, [])
        if not deck:
            deck.extend(templates)
            self.rng.shuffle(deck)
        return deck.pop()

    def get(self, name: str, make: Callable[[random.Random], str], kind: str | None) -> str:
        if name not in self.values:
            self.values[name] = make(self.rng)
        value = self.values[name]
        if kind is not None:
            self.planted.append((kind, value))
        return value


_MARKERS = ("New topic: {opener}.", "Switching to {opener}.", "Different question: {opener}.")
_COMPLETIONS = ("Thanks, that works.", "Great, that's all for now.", "Perfect, done.")
_USER_FILLER = (
    "I need this sorted by the end of the week.",
    "Keep it short, I'm reading this on my phone.",
    "My manager asked about it this morning.",
    "Let me know if you need anything else from me.",
)
_ASSISTANT_FILLER = (
    "Let me know if you want me to go ahead with that.",
    "I can prepare a short summary for the others if that helps.",
    "If anything changes, tell me and I will update the plan.",
    "I noted this so we do not have to look it up again later.",
    "There is one caveat: the details may change once we hear back from the others.",
    "I would double-check this before committing to it.",
)
_ACKS = (
    "Sounds good.",
    "Okay, go ahead.",
    "Makes sense, thanks.",
    "Right.",
    "Good point.",
)


def _fill(template: str, topic: Topic, slots: _Slots) -> str:
    """Fill ``template``'s ``{field}`` / ``{field!}`` placeholders."""
    out: list[str] = []
    rest = template
    while "{" in rest:
        before, _, tail = rest.partition("{")
        name, _, rest = tail.partition("}")
        out.append(before)
        plant = name.endswith("!")
        name = name.rstrip("!")
        if name in topic.slots:
            kind, make = topic.slots[name]
            out.append(slots.get(name, make, kind if plant else None))
        elif name in topic.words:
            words = topic.words[name]

            def pick(rng: random.Random, words: Sequence[str] = words) -> str:
                return rng.choice(words)

            out.append(slots.get(name, pick, None))
        else:
            raise KeyError(f"topic {topic.name!r} has no field {name!r}")
    out.append(rest)
    return "".join(out)


class _Builder:
    def __init__(self, n: int, seed: int, with_tools: bool, start: datetime) -> None:
        self.n = n
        self.rng = random.Random(seed)
        self.with_tools = with_tools
        self.now = start
        self.messages: list[dict[str, Any]] = []
        self.created_at: list[datetime] = []
        self.facts: list[Fact] = []
        self.topics: list[TopicRun] = []
        self.call_number = 0

    def left(self) -> int:
        return self.n - len(self.messages)

    def add(self, message: dict[str, Any], slots: _Slots | None, gap: float) -> None:
        self.now += timedelta(seconds=gap)
        index = len(self.messages)
        self.messages.append(message)
        self.created_at.append(self.now)
        if slots is not None:
            for kind, value in slots.planted:
                self.facts.append(Fact(index, kind, value))
            slots.planted.clear()

    def text(self, role: str, topic: Topic, slots: _Slots, extra: int) -> str:
        templates = topic.user if role == "user" else topic.assistant
        sentences = [_fill(slots.draw(role, templates), topic, slots)]
        filler = (*topic.filler, *(_USER_FILLER if role == "user" else _ASSISTANT_FILLER))
        for _ in range(extra):
            sentence = _fill(slots.draw(role + " filler", filler), topic, slots)
            if sentence not in sentences:
                sentences.append(sentence)
        return " ".join(sentences)

    def run(self) -> Conversation:
        previous: Topic | None = None
        while self.left() > 0:
            choices = [t for t in TOPICS if t is not previous]
            topic = self.rng.choice(choices)
            length = min(self.rng.randint(6, 30), self.left())
            if previous is not None and self.rng.random() < 0.25:
                # A break between topics: hours, sometimes days.
                self.now += timedelta(hours=self.rng.uniform(1, 60))
            self.topic_run(topic, length, announce=previous is not None)
            previous = topic
        return Conversation(self.messages, self.created_at, self.facts, self.topics)

    def topic_run(self, topic: Topic, length: int, *, announce: bool) -> None:
        rng = self.rng
        slots = _Slots(rng)
        start = len(self.messages)
        end = start + length
        first = True
        user_turn = True
        while len(self.messages) < end:
            room = end - len(self.messages)
            if user_turn:
                if first and announce and rng.random() < 0.35:
                    marker = rng.choice(_MARKERS).format(opener=_fill(topic.opener, topic, slots))
                    text = marker + " " + self.text("user", topic, slots, 0)
                elif not first and room <= 2 and rng.random() < 0.5:
                    text = rng.choice(_COMPLETIONS)
                elif not first and rng.random() < 0.15:
                    text = rng.choice(_ACKS) + " " + self.text("user", topic, slots, 0)
                else:
                    text = self.text("user", topic, slots, rng.choice((0, 0, 1)))
                self.add({"role": "user", "content": text}, slots, rng.uniform(8, 240))
                first = False
            elif self.with_tools and topic.tools and room >= 3 and rng.random() < 0.2:
                self.tool_exchange(topic, slots)
            else:
                text = self.text("assistant", topic, slots, rng.choice((0, 1, 2, 2, 3)))
                self.add({"role": "assistant", "content": text}, slots, rng.uniform(2, 20))
            user_turn = not user_turn
        self.topics.append(TopicRun(topic.name, start, len(self.messages) - 1))

    def tool_exchange(self, topic: Topic, slots: _Slots) -> None:
        """An assistant call, its result, and the assistant's answer (three messages)."""
        rng = self.rng
        name, arguments, result = rng.choice(topic.tools)
        self.call_number += 1
        call_id = f"call_{self.call_number:05d}{rng.randrange(16**6):06x}"
        filled = {key: _fill(value, topic, slots) for key, value in arguments.items()}
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(filled)},
        }
        self.add({"role": "assistant", "content": None, "tool_calls": [call]}, None, 1.5)
        self.add(
            {"role": "tool", "tool_call_id": call_id, "content": _fill(result, topic, slots)},
            None,
            rng.uniform(0.2, 3),
        )
        text = self.text("assistant", topic, slots, rng.choice((0, 1)))
        self.add({"role": "assistant", "content": text}, slots, rng.uniform(2, 12))


def generate(
    n: int,
    *,
    seed: int = 0,
    with_tools: bool = True,
    start: datetime = datetime(2025, 1, 6, 9, 0, tzinfo=UTC),
) -> Conversation:
    """A conversation of exactly ``n`` messages (see the module docstring)."""
    if n < 0:
        raise ValueError("n must not be negative")
    return _Builder(n, seed, with_tools, start).run()


def messages(n: int, *, seed: int = 0, with_tools: bool = True) -> list[dict[str, Any]]:
    """Just the OpenAI-format messages of :func:`generate`."""
    return generate(n, seed=seed, with_tools=with_tools).messages


def repetitive(
    n: int, *, seed: int = 0, start: datetime = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
) -> Conversation:
    """``n`` messages of a repeating vocabulary (see the module docstring): message ``i`` is
    about one of 21 topics and carries a four-digit number, a minute after the one before."""
    rng = random.Random(seed)
    texts = [
        f"message {i} about topic {rng.randint(0, 20)} with number {rng.randint(1000, 9999)}"
        for i in range(n)
    ]
    return Conversation(
        messages=[
            {"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(texts)
        ],
        created_at=[start + timedelta(minutes=i) for i in range(n)],
        facts=[],
        topics=[],
    )
