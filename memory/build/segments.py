"""Where level-1 segments close (SPEC §5): pure, deterministic, no database.

A conversation's messages are cut into runs of consecutive messages (segments); each closed
segment becomes one level-1 summary. The builder feeds messages in sequence order to
:func:`split`, keeps the open remainder it returns, and passes that remainder back in front of
the next batch: because every decision depends only on the messages of the open segment, one
pass over all messages and several passes over consecutive batches cut at the same places.

A segment closes **before** a message (:func:`close_reason`) when:

* ``"marker_before"`` -- the message opens with an explicit boundary: a phrase such as "new
  topic", "let's move on", "next task", "switching to" (user or assistant), or a markdown
  heading / horizontal rule (user or system only: assistants open ordinary answers with
  headings, so those say nothing about the topic);
* ``"tool_family"`` -- the message calls tools of another family than the open segment's latest
  tool call (family: the name's first part before ``_``, ``.``, ``-``, ``/`` or ``:``, so
  ``github_create_issue`` is ``github``; an ``mcp__`` / ``functions.`` namespace is skipped, and
  names that start with a generic verb such as ``read_file`` or ``get_weather`` name no family
  and are ignored, since agents alternate such tools within one task all the time);
* ``"shift"`` -- the cosine distance of the message's embedding to the centroid of the open
  segment's embeddings is greater than ``shift_threshold`` (a distance equal to it, up to float
  rounding, does not close), once the open segment holds ``min_tokens`` tokens and at least
  ``min_messages`` of its messages carry an embedding: a centroid of one vector is as noisy as
  that vector, and a user question and its answer differ enough to split a lone question from
  its reply;
* ``"max_messages"`` -- the open segment already holds ``max_messages`` messages;
* ``"token_cap"`` -- the message's tokens would take the segment over ``token_cap``.

The first three are soft signals and never close before a ``tool`` message, which belongs with
the assistant call that produced it; the two caps always apply. When several reasons hold, the
first in the order above is reported. Messages without an embedding (or with a zero vector) do
not move the centroid and are never a shift.

A segment closes **right after** a message (:func:`closes_after`, reason ``"completion"``) when
a user or assistant message signals that the work is finished ("done.", "that's all", "task
complete", "problem solved", "thanks, that works", "✅", ...). To keep false positives down, only
the first and the last sentence are looked at, a phrase preceded by a negation or a condition
("not", "isn't", "once", "when", "if", "will", "almost", ...) does not count, a question does not
count, a message that ends with a question does not close (the conversation goes on), and an
assistant message that calls tools does not close (their results are still to come).

:func:`split` returns ``list[Segment]`` (each with its ``messages`` and the ``reason`` it closed
for; ``"final"`` for the segment closed by ``final=True``) and the open remainder. It is O(n):
the centroid is a running sum of unit vectors, and the squared norm of that sum is updated from
the dot product the shift test computes anyway.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from memory.text import COMPLETION_NEGATORS, GENERIC_TOOL_VERBS, split_sentences

__all__ = [
    "CloseReason",
    "Segment",
    "SegmentMessage",
    "SegmentPolicy",
    "close_reason",
    "closes_after",
    "split",
    "tool_family",
]

CloseReason = Literal[
    "marker_before",
    "tool_family",
    "shift",
    "max_messages",
    "token_cap",
    "completion",
    "final",
]

# Cosines are computed in float64 but still carry rounding of ~1e-16 per term; a threshold hit
# "exactly" by construction must not close because of the last bit.
_SHIFT_EPSILON = 1e-9


@dataclass(frozen=True)
class SegmentMessage:
    """One level-0 node as segmentation sees it."""

    seq: int
    role: str
    text: str
    token_count: int
    #: Any width; pass a numpy array as is (about twice as fast as a list of floats).
    embedding: Sequence[float] | npt.NDArray[np.floating[Any]] | None
    #: Function names of the message's ``tool_calls`` (for a ``tool`` message: the called
    #: function's name if known, else empty).
    tool_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class SegmentPolicy:
    """When to close a segment; see the module docstring."""

    shift_threshold: float = 0.30
    token_cap: int = 2048
    min_messages: int = 2
    # A shift closes only a segment that holds this many tokens: small-model embeddings of
    # short chat turns sit further apart than the threshold far too often, and a segment of
    # two short messages makes a summary longer than what it summarizes.
    min_tokens: int = 256
    max_messages: int = 64

    def __post_init__(self) -> None:
        if not 0.0 <= self.shift_threshold <= 2.0:
            raise ValueError("shift_threshold must be a cosine distance in [0, 2]")
        if self.token_cap < 1:
            raise ValueError("token_cap must be at least 1")
        if self.min_messages < 1:
            raise ValueError("min_messages must be at least 1")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must not be negative")
        if self.max_messages < 1:
            raise ValueError("max_messages must be at least 1")


@dataclass(frozen=True)
class Segment:
    """A closed segment: its messages in order and why it closed."""

    messages: tuple[SegmentMessage, ...]
    reason: CloseReason

    @property
    def seq_start(self) -> int:
        return self.messages[0].seq

    @property
    def seq_end(self) -> int:
        return self.messages[-1].seq

    @property
    def token_count(self) -> int:
        return sum(m.token_count for m in self.messages)


# Curly apostrophes (phones, word processors) are folded so one spelling of "let's" suffices.
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u02bc": "'"})


# --- explicit markers ---------------------------------------------------------------------------

_MARKER_PHRASE_RE = re.compile(
    r"""
    [\s"'*_>#(\[-]*                                  # quoting / emphasis / bullets
    (?:(?:ok(?:ay)?|alright|all\ right|right|so|now|good|great|thanks|thank\ you)[\s,.!:;-]+)?
    (?:
        new\ (?:topic|task|question|subject|thread|issue)
      | next\ (?:task|topic|question|item|issue|step|up|thing)
      | let'?s\ (?:move\ on|switch|change\ (?:topics?|subjects?|gears)|talk\ about\ something)
      | let\ us\ move\ on
      | moving\ on
      | switching\ (?:to|gears|topics?|over)
      | chang(?:e|ing)\ (?:of\ )?(?:the\ )?(?:topics?|subjects?|gears)
      | different\ (?:topic|question|subject|task)
      | another\ (?:topic|question|task)
      | separate\ (?:topic|question|issue)
      | unrelated\b
      | on\ (?:a\ different|another|an\ unrelated)\ (?:note|topic)
    )\b
    """,
    re.IGNORECASE | re.VERBOSE,
)
# A heading or a horizontal rule on the message's first line.
_MARKER_STRUCTURE_RE = re.compile(
    r"\s*(?:#{1,6}[ \t]+\S|(?:-{3,}|\*{3,}|_{3,}|={3,})[ \t]*(?:\n|$))"
)
_STRUCTURE_MARKER_ROLES = frozenset({"user", "system", "developer"})
_PHRASE_MARKER_ROLES = frozenset({"user", "assistant", "system", "developer"})


def _has_marker(message: SegmentMessage) -> bool:
    if message.role in _STRUCTURE_MARKER_ROLES and _MARKER_STRUCTURE_RE.match(message.text):
        return True
    if message.role not in _PHRASE_MARKER_ROLES:
        return False
    # Markers are at the very start: translate only the head, not a whole long message.
    return bool(_MARKER_PHRASE_RE.match(message.text[:160].translate(_APOSTROPHES)))


# --- completion ---------------------------------------------------------------------------------

# Matched against the lower-cased sentence, without IGNORECASE and with one leading \b: the
# engine then tries the alternatives only at word starts and skips each on its first literal,
# several times faster than per-alternative \b with case folding.
_COMPLETION_RE = re.compile(
    r"""
    \b(?:
        that'?s\ (?:all|it\ for\ (?:now|today))\b
      | that\ is\ all\b
      | (?:task|job|work|migration|deployment|deploy|fix|ticket|issue|problem|bug|request)
        \ (?:is\ |has\ been\ |was\ )?(?:now\ )?
        (?:complete|completed|done|finished|resolved|fixed|solved|closed)\b
      | problem\ solved\b
      | mission\ accomplished\b
      | all\ (?:done|set|good)\b
      | (?:that|it|this)\ (?:works|worked|did\ it|did\ the\ trick)\b
      | works\ (?:now|perfectly|great)\b
      | (?:we|i)'?(?:re|\ am|m|\ are)\ (?:all\ )?done\b
      | (?:done|finished|completed|complete|resolved|solved|fixed)(?=\s*(?:[.!;:,)]|$))
      | (?:finished|completed|resolved|fixed|solved|closed)\ (?:the|it|this|that|all)\b
    )
    """,
    re.VERBOSE,
)
_CHECK_MARKS = ("\u2705", "\u2714", "\u2611")  # ✅ ✔ ☑
# Every completion contains one of these. Unanchored literals cost a fraction of _COMPLETION_RE
# (whose \b is tested at every position), and most messages contain none of them.
_COMPLETION_HINT_RE = re.compile(
    "done|finish|complet|resolv|solved|fixed|closed|all|work|did|accomplished|"
    + "|".join(_CHECK_MARKS)
)
_NEGATION_WINDOW = 4  # words before a completion phrase searched for a negator
_WORD_RE = re.compile(r"[\w']+")
_COMPLETION_ROLES = frozenset({"user", "assistant"})
_SENTENCE_SPAN = 400


def _is_negated(prefix: str) -> bool:
    # ``prefix`` is lower-cased already.
    words = _WORD_RE.findall(prefix[-80:])[-_NEGATION_WINDOW:]
    return any(w in COMPLETION_NEGATORS or w.endswith("n't") for w in words)


def _sentence_completes(sentence: str) -> bool:
    sentence = sentence.strip()
    if not sentence or sentence.endswith("?"):
        return False
    if any(mark in sentence for mark in _CHECK_MARKS):
        return True
    lowered = sentence.lower()
    for match in _COMPLETION_RE.finditer(lowered):
        if not _is_negated(lowered[: match.start()]):
            return True
    return False


def _fold(text: str) -> str:
    return text.translate(_APOSTROPHES) if "\u2019" in text or "\u02bc" in text else text


def closes_after(message: SegmentMessage) -> Literal["completion"] | None:
    """``"completion"`` if the segment should close right after ``message``, else ``None``."""
    if message.role not in _COMPLETION_ROLES or message.tool_names:
        return None
    text = message.text.strip()
    if not text or text.endswith("?"):
        return None
    # Only the first and the last sentence count, so only a bounded head and tail are read:
    # the cost does not grow with the message.
    if len(text) > 2 * _SENTENCE_SPAN:
        hint = _COMPLETION_HINT_RE.search(text[:_SENTENCE_SPAN].lower()) or (
            _COMPLETION_HINT_RE.search(text[-_SENTENCE_SPAN:].lower())
        )
    else:
        hint = _COMPLETION_HINT_RE.search(text.lower())
    if hint is None:
        return None
    head = split_sentences(text[:_SENTENCE_SPAN])
    first = head[0]
    if _sentence_completes(_fold(first)):
        return "completion"
    if len(head) == 1 and len(text) <= _SENTENCE_SPAN:
        return None  # a single sentence, already looked at
    last = split_sentences(text[-_SENTENCE_SPAN:])[-1]
    if last == first:
        return None
    return "completion" if _sentence_completes(_fold(last)) else None


# --- tool families ------------------------------------------------------------------------------

_TOOL_SPLIT_RE = re.compile(r"[_.\-/:]+")
_TOOL_NAMESPACES = frozenset({"mcp", "functions", "function", "tools", "tool", "default_api"})


def tool_family(name: str) -> str | None:
    """The family of a tool name (``github_create_issue`` → ``github``), or ``None``.

    ``None`` for names whose first part is a generic verb (``read_file``) or that are empty.
    """
    parts = [p for p in _TOOL_SPLIT_RE.split(name.strip().lower()) if p]
    while len(parts) > 1 and parts[0] in _TOOL_NAMESPACES:
        parts = parts[1:]
    if not parts or parts[0] in GENERIC_TOOL_VERBS:
        return None
    return parts[0]


def _families(message: SegmentMessage) -> list[str]:
    families = []
    for name in message.tool_names:
        family = tool_family(name)
        if family is not None:
            families.append(family)
    return families


# --- the open segment ---------------------------------------------------------------------------


def _unit(
    embedding: Sequence[float] | npt.NDArray[np.floating[Any]] | None,
) -> npt.NDArray[np.float64] | None:
    if embedding is None or len(embedding) == 0:
        return None
    first = embedding[0]
    if isinstance(first, np.floating) and not isinstance(embedding, np.ndarray):
        # list(ndarray) gives numpy scalars, which numpy converts several times faster to their
        # own dtype (exactly) than to float64 one by one.
        vector = np.asarray(embedding, dtype=first.dtype).astype(np.float64)
    else:
        vector = np.asarray(embedding, dtype=np.float64)
    norm = math.sqrt(float(vector.dot(vector)))
    if norm == 0.0 or not math.isfinite(norm):
        return None
    unit: npt.NDArray[np.float64] = vector / norm
    return unit


class _OpenSegment:
    """Running state of the open segment; both public entry points go through it."""

    __slots__ = ("_policy", "embedded", "last_family", "messages", "sq_norm", "sum", "tokens")

    def __init__(self, policy: SegmentPolicy) -> None:
        self._policy = policy
        self.messages: list[SegmentMessage] = []
        self.tokens = 0
        self.embedded = 0
        self.sum: npt.NDArray[np.float64] | None = None
        self.sq_norm = 0.0  # |sum|², kept incrementally
        self.last_family: str | None = None

    def reason_before(
        self, message: SegmentMessage, unit: npt.NDArray[np.float64] | None
    ) -> tuple[CloseReason | None, float]:
        """Why the segment closes before ``message``, and ``sum · unit`` (0.0 if not computed)."""
        dot = 0.0
        if unit is not None and self.sum is not None:
            if unit.shape != self.sum.shape:
                raise ValueError(
                    f"message {message.seq} has a {unit.shape[0]}-dimensional embedding, "
                    f"the open segment's are {self.sum.shape[0]}-dimensional"
                )
            dot = float(self.sum.dot(unit))
        if not self.messages:
            return None, dot
        policy = self._policy
        if message.role != "tool":
            if _has_marker(message):
                return "marker_before", dot
            if self.last_family is not None:
                families = _families(message)
                if families and self.last_family not in families:
                    return "tool_family", dot
            if (
                unit is not None
                and self.embedded >= policy.min_messages
                and self.tokens >= policy.min_tokens
                and self.sq_norm > 0.0
            ):
                distance = 1.0 - dot / math.sqrt(self.sq_norm)
                if distance > policy.shift_threshold + _SHIFT_EPSILON:
                    return "shift", dot
        if len(self.messages) >= policy.max_messages:
            return "max_messages", dot
        if self.tokens + message.token_count > policy.token_cap:
            return "token_cap", dot
        return None, dot

    def add(
        self, message: SegmentMessage, unit: npt.NDArray[np.float64] | None, dot: float
    ) -> None:
        self.messages.append(message)
        self.tokens += message.token_count
        if unit is not None:
            if self.sum is None:
                self.sum = unit.copy()
                self.sq_norm = 1.0
            else:
                self.sum += unit
                # |s + u|² = |s|² + 2 s·u + |u|², with |u| = 1.
                self.sq_norm = max(self.sq_norm + 2.0 * dot + 1.0, 0.0)
            self.embedded += 1
        families = _families(message)
        if families:
            self.last_family = families[-1]

    def reset(self) -> None:
        self.messages = []
        self.tokens = 0
        self.embedded = 0
        self.sum = None
        self.sq_norm = 0.0
        self.last_family = None


def _feed(state: _OpenSegment, messages: Sequence[SegmentMessage]) -> None:
    for message in messages:
        unit = _unit(message.embedding)
        dot = 0.0
        if unit is not None and state.sum is not None:
            dot = float(state.sum.dot(unit))
        state.add(message, unit, dot)


def close_reason(
    open_segment: Sequence[SegmentMessage],
    message: SegmentMessage,
    policy: SegmentPolicy,
) -> CloseReason | None:
    """Why the open segment should close before ``message`` joins it, or ``None``.

    Never closes an empty segment. O(len(open_segment)); :func:`split` keeps the state instead.
    """
    state = _OpenSegment(policy)
    _feed(state, open_segment)
    reason, _ = state.reason_before(message, _unit(message.embedding))
    return reason


def split(
    messages: Sequence[SegmentMessage],
    policy: SegmentPolicy,
    *,
    final: bool = False,
) -> tuple[list[Segment], list[SegmentMessage]]:
    """Cut ``messages`` (in sequence order) into closed segments and the open remainder.

    The first messages continue the currently open segment: pass the remainder of the previous
    call in front of the new messages. With ``final=True`` a non-empty remainder is closed too
    (reason ``"final"``) and the returned remainder is empty.
    """
    closed: list[Segment] = []
    state = _OpenSegment(policy)
    for message in messages:
        unit = _unit(message.embedding)
        reason, dot = state.reason_before(message, unit)
        if reason is not None:
            closed.append(Segment(tuple(state.messages), reason))
            state.reset()
            dot = 0.0
        state.add(message, unit, dot)
        after = closes_after(message)
        if after is not None:
            closed.append(Segment(tuple(state.messages), after))
            state.reset()
    if final and state.messages:
        closed.append(Segment(tuple(state.messages), "final"))
        state.reset()
    return closed, state.messages
