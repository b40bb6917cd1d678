"""Summaries that keep identifiers, numbers, names, dates and decisions (SPEC §5).

Pure domain code, no database: the hierarchy builder hands a :class:`Summarizer` the children of
one new node (messages for a level-1 summary, level-k summaries for a level-k+1 one) and stores
the :class:`Summary` it gets back, together with the children, the message span and the token
count, which it knows already.

Contract of every :class:`Summarizer`:

* ``await summarize(items, level=k, target_tokens=n)`` -- ``items`` are the children in order
  (at least one), ``level`` the level of the summary being made (≥ 1), ``target_tokens`` the
  narrative's budget (≥ 1). It returns a :class:`Summary`: a narrative, key facts under exactly
  the keys of :data:`~memory.build.facts.FACT_KEYS` (each a deduplicated list of strings, capped),
  the method that made it (``"llm"`` or ``"extractive"``) and the model (``None`` for extractive).
* Backend failures (HTTP errors, non-2xx answers, timeouts, malformed replies) raise
  :class:`~memory.errors.ProviderError`; bad arguments raise ``ValueError``.
* Nothing is logged that contains conversation text.

Three implementations:

* :class:`ExtractiveSummarizer` -- no LLM. Keeps the sentences that carry the most
  identifiers, numbers, dates, names and decision words, in their original order, within
  ``target_tokens``; facts come from regular expressions (:mod:`memory.build.facts`) over *all* the
  input text (not only the kept sentences) and, at level ≥ 2, from the children's facts too.
  Pure CPU, about 0.1 ms per message: it runs on the event loop, where a thread hop would cost
  more than it saves.
* :class:`LLMSummarizer` -- asks an OpenAI-compatible ``/chat/completions`` for a JSON object
  (narrative + facts), at temperature 0 unless the model refuses one (reasoning models), its
  reply bounded by ``max_tokens`` (``max_completion_tokens``, with room to reason, for models
  that refuse the former), parses it leniently, and adds the identifiers, numbers and dates
  the regular expressions find in the input that the model left out: models drop exact strings
  silently, and these expressions are precise enough to trust.
* :class:`FallbackSummarizer` -- ``auto`` mode: the LLM, and the extractive summarizer whenever
  the LLM fails; each Summary's ``method`` says which one made it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Protocol

from memory.build.facts import FACT_KEYS, FactSet, Sentence, analyze, extract_facts, string_list
from memory.errors import ProviderError
from memory.provider import Provider, refused_parameter
from memory.tokens import count_text, encoding_name_for_model, get_encoding

__all__ = [
    "ExtractiveSummarizer",
    "FallbackSummarizer",
    "LLMSummarizer",
    "Summarizer",
    "Summary",
    "SummaryInput",
    "make_summarizer",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SummaryInput:
    """One child of the summary being made: a message (level 0) or a summary (level ≥ 1)."""

    node_id: int
    level: int
    role: str | None
    text: str
    facts: Mapping[str, list[str]] | None
    created_at: datetime | None
    seq_start: int
    seq_end: int


@dataclass(frozen=True)
class Summary:
    """A narrative plus key facts, and who made it."""

    text: str
    facts: dict[str, list[str]]
    method: Literal["llm", "extractive"]
    model: str | None


class Summarizer(Protocol):
    """Summarizes the children of one new node; see the module docstring for the contract."""

    async def summarize(
        self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
    ) -> Summary: ...


def _check_arguments(items: Sequence[SummaryInput], level: int, target_tokens: int) -> None:
    if not items:
        raise ValueError("nothing to summarize")
    if level < 1:
        raise ValueError("a summary's level is at least 1")
    if target_tokens < 1:
        raise ValueError("target_tokens must be at least 1")


# --- extractive ---------------------------------------------------------------------------------

_MIN_PIECE_TOKENS = 4  # below this much budget left, no sentence fits
_NEAR_DUPLICATE = 0.8  # Jaccard similarity of two sentences' words that makes one redundant
_PLAIN_WORD_RE = re.compile(r"[a-z]{2,}")


class ExtractiveSummarizer:
    """Picks the most fact-dense sentences; no LLM. See the module docstring."""

    def __init__(self, model_for_tokens: str = "gpt-4o") -> None:
        self.model_for_tokens = model_for_tokens

    def _count(self, text: str) -> int:
        return count_text(text, model=self.model_for_tokens)

    async def summarize(
        self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
    ) -> Summary:
        _check_arguments(items, level, target_tokens)
        analysis = analyze(items)
        text = self._narrative(items, analysis.sentences, level=level, budget=target_tokens)
        return Summary(text=text, facts=analysis.facts.values, method="extractive", model=None)

    def _prefix(self, item: SummaryInput, level: int) -> str:
        return f"{item.role}: " if level == 1 and item.role else ""

    def _render(self, items: Sequence[SummaryInput], kept: list[Sentence], level: int) -> str:
        # Level 1: one "role: ..." line per message. Higher levels keep the line structure of
        # the child summaries, whose lines are those "role: ..." lines.
        lines: list[str] = []
        current = -1
        for sentence in sorted(kept, key=lambda s: s.position):
            if sentence.item != current:
                current = sentence.item
                lines.append(self._prefix(items[current], level) + sentence.text)
            elif level > 1 and sentence.line_start:
                lines.append(sentence.text)
            else:
                lines[-1] += " " + sentence.text
        return "\n".join(lines)

    def _narrative(
        self,
        items: Sequence[SummaryInput],
        sentences: list[Sentence],
        *,
        level: int,
        budget: int,
    ) -> str:
        if not sentences:
            return ""
        # Density with a square root: a long sentence must carry more facts than a short one to
        # win, but not proportionally more, or only fragments would survive.
        ranked = sorted(
            (s for s in sentences if s.score > 0.0),
            key=lambda s: (-s.score / math.sqrt(len(s.text) / 4.0 + 1.0), s.position),
        )
        if not ranked:
            # No sentence carries anything: the opening states the topic best.
            ranked = sentences[:3]
        kept: list[Sentence] = []
        kept_words: list[frozenset[str]] = []
        used = 0
        prefixed: set[int] = set()
        for sentence in ranked:
            if budget - used < _MIN_PIECE_TOKENS:
                break
            # Repeated status lines ("raising the limit to 35", "... to 42") say one thing; their
            # numbers are in the facts either way.
            words = frozenset(_PLAIN_WORD_RE.findall(sentence.text.lower()))
            if words and any(
                len(words & other) >= _NEAR_DUPLICATE * len(words | other) for other in kept_words
            ):
                continue
            cost = self._count(sentence.text) + 1  # + the joining space or newline
            if sentence.item not in prefixed:
                cost += self._count(self._prefix(items[sentence.item], level))
            if used + cost > budget:
                continue
            kept.append(sentence)
            kept_words.append(words)
            prefixed.add(sentence.item)
            used += cost
        if not kept:
            return self._truncate(
                self._prefix(items[ranked[0].item], level) + ranked[0].text, budget
            )
        text = self._render(items, kept, level)
        # Token counts of pieces do not add up exactly once joined; drop the weakest until the
        # whole fits (rarely more than one round, if any).
        while len(kept) > 1 and self._count(text) > budget:
            kept.pop()
            text = self._render(items, kept, level)
        return text if self._count(text) <= budget else self._truncate(text, budget)

    def _truncate(self, text: str, budget: int) -> str:
        encoding = get_encoding(encoding_name_for_model(self.model_for_tokens))
        tokens = encoding.encode_ordinary(text)
        if len(tokens) <= budget:
            return text
        # With an ellipsis when there is room for one; decoding a cut and encoding it again can
        # come out a token longer, hence the shrinking.
        for keep, suffix in ((budget - 1, "…"), (budget, "")):
            while keep > 0:
                cut = encoding.decode(tokens[:keep]).rstrip() + suffix
                if cut.strip() and self._count(cut) <= budget:
                    return cut
                keep -= 1
        return ""


# --- LLM ----------------------------------------------------------------------------------------

_SYSTEM_PROMPT = """\
You write the long-term memory of a conversation: summaries that later stand in for the text \
they cover, so nothing that matters may be lost.

Reply with one JSON object and nothing else, with exactly these keys:
- "narrative": a concise account in the order things happened: who asked for what, what was \
done, what came out of it, what is still pending. At most about {target_tokens} tokens.
- "identifiers": ids, ticket and order numbers, file paths, URLs, emails, hashes, code symbols.
- "numbers": quantities, amounts, prices, versions, limits and measurements, each with its unit \
or what it counts.
- "names": people, organisations, products, projects and places.
- "dates": dates, times and deadlines, with what they refer to.
- "decisions": decisions, agreements, commitments and plans, one short sentence each.
- "open_questions": questions and tasks still unresolved at the end.
Every list holds strings; use [] when there is nothing. Copy identifiers, numbers, names and \
dates exactly as written in the input. Never invent facts that are not stated."""

_FENCE_RE = re.compile(r"```(?:json|JSON)?[ \t]*\n?(.*?)```", re.DOTALL)
# A reply's bound, in multiples of the narrative's budget plus the JSON's keys: the facts' lists
# may run as long as the narrative, and a model overshoots its budget. Without one, a model
# caught in JSON mode's whitespace runaway wrote (and billed) up to its context's end.
_REPLY_TOKENS_PER_TARGET = 4
_REPLY_TOKENS_EXTRA = 1024
# `max_completion_tokens` also counts a reasoning model's hidden reasoning: room for it, or its
# summary is cut before it starts (a failure, not a shorter summary).
_REASONING_TOKENS = 8192
_MAX_JSON_ATTEMPTS = 32
# Finish reasons of a reply the upstream cut before the model ended it.
_CUT_SHORT = frozenset({"length", "content_filter"})


def _first_json_object(content: str, *, inner: bool = True) -> dict[str, Any] | None:
    """The first JSON object in ``content``: bare, fenced in ```json```, or inside prose; with
    ``inner`` False, only one that opens at the first brace (no object nested in it)."""
    stripped = content.strip()
    candidates: list[str] = [stripped]
    fence = _FENCE_RE.search(stripped)
    if fence:
        candidates.append(fence.group(1).strip())
    for candidate in candidates:
        if candidate.startswith("{"):
            try:
                value = json.loads(candidate)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    decoder = json.JSONDecoder()
    position = stripped.find("{")
    # Bounded: each failed attempt may scan the rest of the text.
    for _ in range(_MAX_JSON_ATTEMPTS if inner else 1):
        if position < 0:
            break
        try:
            value, _end = decoder.raw_decode(stripped, position)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        position = stripped.find("{", position + 1)
    return None


def _render_time(created_at: datetime | None) -> str:
    return f" ({created_at.isoformat(timespec='minutes')})" if created_at is not None else ""


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    # Keep both ends: requests tend to open a message, conclusions to close it.
    head = limit * 2 // 3
    return text[:head].rstrip() + " […] " + text[-(limit - head) :].lstrip()


class LLMSummarizer:
    """Structured summaries from an OpenAI-compatible ``POST {base_url}/chat/completions``,
    through `memory.provider` (shared and owned by the caller: its retries apply).
    ``timeout`` bounds each request. Items longer than ``max_item_chars`` are sent with their
    middle cut out.
    """

    def __init__(
        self,
        provider: Provider,
        *,
        model: str,
        timeout: float = 60,
        max_item_chars: int = 8000,
        augment_facts: bool = True,
    ) -> None:
        self._provider = provider
        self.model = model
        self._timeout = timeout
        self._max_item_chars = max_item_chars
        self._augment_facts = augment_facts
        # None once the model refused it: reasoning models (o-series, gpt-5) take only their
        # default temperature, and answered every summary 400.
        self._temperature: float | None = 0
        # The reply's bound; `max_completion_tokens` once the model refused `max_tokens` (the
        # same reasoning models, and newer OpenAI ones, take only that).
        self._limit = "max_tokens"

    def _prompt(self, items: Sequence[SummaryInput], level: int) -> str:
        if level == 1:
            header = f"Summarize these {len(items)} messages (oldest first)."
        else:
            header = (
                f"Merge these {len(items)} summaries of consecutive parts of one conversation "
                "(oldest first) into one summary that keeps every key fact still relevant."
            )
        lines = [header, ""]
        for item in items:
            text = _clip(item.text, self._max_item_chars)
            when = _render_time(item.created_at)
            if item.level == 0:
                lines.append(f"[#{item.node_id}]{when} {item.role or 'unknown'}: {text}")
                continue
            lines.append(
                f"[#{item.node_id}] summary of messages {item.seq_start}-{item.seq_end}{when}: "
                f"{text}"
            )
            for key in FACT_KEYS:
                values = string_list(item.facts.get(key)) if item.facts else []
                if values:
                    lines.append(f"  {key}: " + "; ".join(values))
        return "\n".join(lines)

    async def summarize(
        self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
    ) -> Summary:
        _check_arguments(items, level, target_tokens)
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": _SYSTEM_PROMPT.format(target_tokens=target_tokens)},
                {"role": "user", "content": self._prompt(items, level)},
            ],
            "stream": False,
            "response_format": {"type": "json_object"},
        }
        reply_tokens = _REPLY_TOKENS_PER_TARGET * target_tokens + _REPLY_TOKENS_EXTRA
        content, finish_reason = await self._complete(payload, reply_tokens)
        try:
            return self._parse(content, finish_reason, items)
        except RecursionError as exc:
            # JSON nested deeper than Python reads it (a model caught in a loop of brackets): a
            # malformed reply like any other, so that `auto` falls back instead of failing.
            raise ProviderError("summary upstream's JSON is nested too deeply") from exc

    async def _complete(self, payload: dict[str, Any], reply_tokens: int) -> tuple[str, str | None]:
        while True:
            try:
                body = await self._post(payload, reply_tokens)
                break
            except ProviderError as exc:
                # Each refusal changes what is sent, once: a model that refuses both parameters
                # is asked three times, then never again with either.
                refused = refused_parameter(exc)
                if refused == "temperature" and self._temperature is not None:
                    self._temperature = None
                elif refused == "max_tokens" and self._limit == "max_tokens":
                    self._limit = "max_completion_tokens"
                else:
                    raise
        try:
            choice = body["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ProviderError("summary upstream sent no choices[0].message") from exc
        if not isinstance(content, str) or not content.strip():
            raise ProviderError("summary upstream sent an empty message")
        finish_reason = choice.get("finish_reason")
        return content, finish_reason if isinstance(finish_reason, str) else None

    async def _post(self, payload: dict[str, Any], reply_tokens: int) -> Any:
        if self._limit == "max_completion_tokens":
            reply_tokens += _REASONING_TOKENS
        payload = {**payload, self._limit: reply_tokens}
        if self._temperature is not None:
            payload["temperature"] = self._temperature
        return await self._provider.post("chat", payload, what="summary", seconds=self._timeout)

    def _parse(
        self, content: str, finish_reason: str | None, items: Sequence[SummaryInput]
    ) -> Summary:
        # A reply cut short (its length limit, a content filter) is kept only if its own object
        # came whole before the cut (whitespace after it, JSON mode's known runaway): one of
        # its facts' objects, whole before the cut, is no summary.
        cut = finish_reason in _CUT_SHORT
        obj = _first_json_object(content, inner=not cut)
        facts = FactSet()
        if obj is None:
            if finish_reason == "length":
                raise ProviderError("summary upstream stopped at its length limit")
            if cut:
                raise ProviderError(f"summary upstream stopped early ({finish_reason})")
            # A model that ignored the format still wrote a summary; its facts come from the
            # input, which holds them verbatim.
            fence = _FENCE_RE.fullmatch(content.strip())
            narrative = (fence.group(1) if fence else content).strip()
            if narrative.startswith("{"):
                # It kept the format but wrote JSON that does not parse: malformed, not prose.
                raise ProviderError("summary upstream's JSON does not parse")
            facts.merge_children([extract_facts(items)])
        else:
            narrative = next(
                (
                    text
                    for key in ("narrative", "summary", "text")
                    if (text := " ".join(string_list(obj.get(key))).strip())
                ),
                "",
            )
            if not narrative:
                raise ProviderError("summary upstream's JSON has no narrative")
            facts.merge_children([obj])
            if self._augment_facts:
                extracted = extract_facts(items)
                for key in ("identifiers", "numbers", "dates"):
                    for value in extracted[key]:
                        facts.add(key, value)
        return Summary(text=narrative, facts=facts.values, method="llm", model=self.model)


# --- auto ---------------------------------------------------------------------------------------


class FallbackSummarizer:
    """The primary summarizer, and the fallback whenever the primary raises ProviderError.

    After a failure the primary is skipped for ``cooldown`` seconds: an unreachable upstream
    would otherwise cost every summary a full timeout and stall the background pipeline.
    """

    def __init__(
        self, primary: Summarizer, fallback: Summarizer, *, cooldown: float = 30.0
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.cooldown = cooldown
        self._skip_until = 0.0

    async def summarize(
        self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
    ) -> Summary:
        if time.monotonic() >= self._skip_until:
            try:
                return await self.primary.summarize(items, level=level, target_tokens=target_tokens)
            except ProviderError as exc:
                now = time.monotonic()
                # Summaries are made in concurrent batches: once one failure has been reported,
                # those already in flight need not repeat it at warning level.
                severity = logging.WARNING if now >= self._skip_until else logging.DEBUG
                # ProviderError messages carry status and error kind, never conversation text.
                log.log(
                    severity,
                    "summarizer %s failed (%s); using %s%s",
                    type(self.primary).__name__,
                    exc,
                    type(self.fallback).__name__,
                    f" for the next {self.cooldown:g}s" if self.cooldown > 0 else "",
                )
                self._skip_until = now + self.cooldown
        return await self.fallback.summarize(items, level=level, target_tokens=target_tokens)


def make_summarizer(
    mode: Literal["llm", "extractive", "auto"],
    *,
    provider: Provider | None,
    model: str | None,
    model_for_tokens: str = "gpt-4o",
    timeout: float = 60,
) -> Summarizer:
    """The summarizer for ``MEMSTRATA_SUMMARY_MODE``; ``ValueError`` if its settings are missing.

    ``model`` is the summary model (``MEMSTRATA_SUMMARY_MODEL``); ``model_for_tokens`` the
    encoding the extractive summarizer measures its budget in.
    """
    extractive = ExtractiveSummarizer(model_for_tokens)
    if mode == "extractive":
        return extractive
    if mode not in ("llm", "auto"):
        raise ValueError(f"unknown summary mode {mode!r}")
    if provider is None or not model:
        raise ValueError(f"summary mode {mode!r} needs an upstream provider and a model")
    llm = LLMSummarizer(provider, model=model, timeout=timeout)
    return llm if mode == "llm" else FallbackSummarizer(llm, extractive)
