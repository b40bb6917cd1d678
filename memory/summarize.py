"""Summaries that keep identifiers, numbers, names, dates and decisions (SPEC §5).

Pure domain code, no database: the hierarchy builder hands a :class:`Summarizer` the children of
one new node (messages for a level-1 summary, level-k summaries for a level-k+1 one) and stores
the :class:`Summary` it gets back, together with the children, the message span and the token
count, which it knows already.

Contract of every :class:`Summarizer`:

* ``await summarize(items, level=k, target_tokens=n)`` -- ``items`` are the children in order
  (at least one), ``level`` the level of the summary being made (≥ 1), ``target_tokens`` the
  narrative's budget (≥ 1). It returns a :class:`Summary`: a narrative, key facts under exactly
  the keys of :data:`FACT_KEYS` (each a deduplicated list of strings, capped), the method that
  made it (``"llm"`` or ``"extractive"``) and the model (``None`` for extractive).
* Backend failures (HTTP errors, non-2xx answers, timeouts, malformed replies) raise
  :class:`~memory.errors.ProviderError`; bad arguments raise ``ValueError``.
* Nothing is logged that contains conversation text.

Three implementations:

* :class:`ExtractiveSummarizer` -- no LLM. Keeps the sentences that carry the most
  identifiers, numbers, dates, names and decision words, in their original order, within
  ``target_tokens``; facts come from regular expressions over *all* the input text (not only the
  kept sentences) and, at level ≥ 2, from the children's facts too. Pure CPU, about 0.1 ms per
  message: it runs on the event loop, where a thread hop would cost more than it saves.
* :class:`LLMSummarizer` -- asks an OpenAI-compatible ``/chat/completions`` for a JSON object
  (narrative + facts), parses it leniently, and adds the identifiers, numbers and dates the
  regular expressions find in the input that the model left out: models drop exact strings
  silently, and these expressions are precise enough to trust.
* :class:`FallbackSummarizer` -- ``auto`` mode: the LLM, and the extractive summarizer whenever
  the LLM fails; each Summary's ``method`` says which one made it.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal, Protocol

import httpx

from memory.errors import ProviderError
from memory.tokens import count_text, encoding_name_for_model, get_encoding

__all__ = [
    "FACT_KEYS",
    "ExtractiveSummarizer",
    "FallbackSummarizer",
    "LLMSummarizer",
    "Summarizer",
    "Summary",
    "SummaryInput",
    "extract_facts",
    "make_summarizer",
]

log = logging.getLogger(__name__)

FACT_KEYS: Final = ("identifiers", "numbers", "names", "dates", "decisions", "open_questions")
"""The keys of :attr:`Summary.facts`, always all present, in this order."""

#: Most strings kept per fact key. Facts travel into prompts and into every ancestor's input, so
#: they must stay bounded however many children a summary merges.
FACT_CAPS: Final[Mapping[str, int]] = {
    "identifiers": 60,
    "numbers": 40,
    "names": 40,
    "dates": 30,
    "decisions": 20,
    "open_questions": 12,
}
_MAX_FACT_CHARS = 240
_MAX_SENTENCE_CHARS = 400
_MIN_PIECE_TOKENS = 4  # below this much budget left, no sentence fits
_NEAR_DUPLICATE = 0.8  # Jaccard similarity of two sentences' words that makes one redundant


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


# --- fact patterns ------------------------------------------------------------------------------
# Applied in stages over one copy of the text in which each stage's matches are then blanked out
# (same length, so offsets stay valid): a URL's path is not also a file path, the 2041 of
# INV-2041 is not also a number, and a date's digits are not numbers.
#
# Speed matters (the background pipeline budgets ~2 ms per message for everything). Python's
# regex engine only skips ahead quickly when a pattern starts with a literal or a character
# class; a leading \b or look-behind makes it try every alternative at every position. So most
# patterns start with a class of the characters they can start with and check the word boundary
# right after, with a look-behind over that first character: ``X(?<!\w.)`` = "X, not preceded by
# a word character".

_MASK = "\x1f"  # neither a word character nor a space: nothing matches across a blanked span
_START = r"(?<!\w.)"  # placed after a pattern's first character: a word starts there


def _wordlist(text: str) -> list[str]:
    return text.split()


def _words(entries: Iterable[str], *, any_case: bool = True) -> str:
    """An alternation of whole words or phrases, each branch led by a literal character.

    ``entries`` are regex fragments starting with a plain letter; with ``any_case`` the first
    letter may also be upper case ("Decided", "Today"). Branches that start with a literal let
    the engine jump straight to the letters that can start a match.
    """
    branches: list[str] = []
    for entry in entries:
        first, rest = entry[0], entry[1:]
        for letter in dict.fromkeys((first.lower(), first.upper()) if any_case else (first,)):
            branches.append(f"{letter}{_START}{rest}")
    return "(?:" + "|".join(branches) + r")\b"


_CODE_RE = re.compile(r"`([^`\n]{1,120})`")
_URL_RE = re.compile(r"\b(?:https?|wss?|ftp|s3|gs|file)://[^\s<>\"'`\x1f]+")
_EMAIL_RE = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\b")
# /etc/app.conf, ~/notes/x.md, ../src/a.py (relative paths with a directory are identifiers).
_PATH_RE = re.compile(
    r"[/~.](?<![\w/.~].)(?:(?<=/)|(?<=~)/|(?<=\.)\.?/)[\w.@%+-]+(?:/[\w.@%+-]+)+/?"
)
_WINDOWS_PATH_RE = re.compile(r"\b[A-Za-z]:\\(?:[\w .-]+\\)*[\w.-]+")
_MONTH_FORMS = _wordlist(
    "January February March April May June July August September October November December "
    "Jan Feb Mar Apr Jun Jul Aug Sept Sep Oct Nov Dec"
)
_DAY_OF_MONTH = r"\.?\s+\d{1,2}(?:st|nd|rd|th)?\b(?:,?\s+\d{4}\b)?|\s+\d{4}\b"
# Capitalised or upper-case words: months, EOD, Q3, FY24, and TBD / TODO / FIXME.
_OPEN_CAPS = frozenset({"TBD", "TODO", "FIXME"})
_CAPS_WORDS_RE = re.compile(
    _words(
        [
            # A bare month name counts when spelled out ("in March"), except "May" (the verb);
            # abbreviations and May only with a day or a year.
            *(
                f"{m}(?:{_DAY_OF_MONTH})?" if i < 12 and m != "May" else f"{m}(?:{_DAY_OF_MONTH})"
                for i, m in enumerate(_MONTH_FORMS)
            ),
            r"EO[DWMY]",
            r"Q[1-4](?:\s+(?:FY)?\d{2,4})?",
            r"FY\s?\d{2,4}",
            *_OPEN_CAPS,
        ],
        any_case=False,
    )
)
# Word lists matched on the lower-cased text in one pass (a leading \b costs the same per
# character however many words follow it); each hit is then classified by the lists below.
_STRONG_DECISIONS = [
    *_wordlist(
        "decided decide decision agreed agreement chose chosen approve approved confirmed opted "
        "finalized finalised deadline must"
    ),
    r"settled\s+on",
    r"going\s+with",
    r"go\s+with",
    r"signed\s+off",
    r"committed\s+to",
    r"the\s+plan\s+is",
    r"we(?:'|\u2019)ll",
    r"we\s+will",
]
_WEAK_DECISIONS = [
    *_wordlist("will shall plan plans planned planning should due schedule scheduled schedules"),
    r"won(?:'|\u2019)t",
    r"let(?:'|\u2019)s",
    r"needs?\s+to",
    r"ha(?:ve|s)\s+to",
]
_OPEN_WORDS = [
    r"open\s+questions?",
    "unresolved",
    "unclear",
    r"not\s+sure",
    "undecided",
    r"to\s+be\s+(?:decided|determined|confirmed)",
    "pending",
    r"follow[- ]?up",
]
_WEEKDAYS = "monday|tuesday|wednesday|thursday|friday|saturday|sunday"
_DATE_WORDS = [
    rf"(?:next|last|this)\s+(?:{_WEEKDAYS}|week|month|quarter|year|sprint)",
    _WEEKDAYS,
    "yesterday|today|tomorrow|tonight",
    r"end\s+of\s+(?:the\s+)?(?:day|week|month|quarter|year|sprint)",
]
_LOWER_WORDS_RE = re.compile(
    r"\b(?:" + "|".join([*_STRONG_DECISIONS, *_WEAK_DECISIONS, *_OPEN_WORDS, *_DATE_WORDS]) + r")\b"
)
_STRONG_DECISION_RE = re.compile("|".join(_STRONG_DECISIONS))
_WEAK_DECISION_RE = re.compile("|".join(_WEAK_DECISIONS))
_OPEN_WORD_RE = re.compile("|".join(_OPEN_WORDS))
_DATE_NUMERIC_RE = re.compile(
    r"\d(?<![\w.].)(?:"
    r"\d{3}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?"
    r"|\d?/\d{1,2}/(?:\d{4}|\d{2})"
    r"|\d?\.\d{1,2}\.\d{4}"
    r"|\d?(?:st|nd|rd|th)?\s+(?:of\s+)?(?:" + "|".join(_MONTH_FORMS) + r")\b(?:,?\s+\d{4})?"
    r"|\d?(?::\d{2})?\s?(?:am|pm|AM|PM)"
    r"|\d?:\d{2}(?::\d{2})?(?:\s?(?:UTC|GMT|Z))?"
    r")\b"
)
# Identifiers are words that hold something a lower-case prose word does not: a capital, a
# digit, "_", "(", "/" or an inner dot. The possessive look-ahead rules a plain word out in one
# scan, before any of the alternatives is tried on it.
_ID_RE = re.compile(
    r"#(?<![\w#&].)\d+\b"  # #123
    r"|\b(?=[a-z-]*+(?:[A-Z0-9_(/]|\.[A-Za-z_]))(?:"
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"  # uuid
    r"|[\w.-]+(?:/[\w.@%+-]+)+\.[A-Za-z0-9]{1,8}\b"  # src/app/main.py
    r"|[A-Z][A-Z0-9]{1,9}(?:-[A-Z0-9]+)*-\d+[A-Za-z]?\b"  # INV-2041, ABC-12
    r"|0x[0-9a-fA-F]+\b"
    r"|(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,64}\b"  # git / sha hashes
    r"|v\d+(?:\.\d+)+(?:[-+][\w.]+)?\b"  # v1.2.3
    r"|[A-Za-z_][\w-]+(?:\.[\w-]+)*\.[A-Za-z_]\w*(?:\(\))?"  # a.b.c, file.ext, example.com
    r"|[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b"  # SCREAMING_SNAKE
    r"|_*[a-z][a-z0-9]*(?:_[a-z0-9]+)+_*\b"  # snake_case
    r"|[a-z][a-z0-9]*(?:[A-Z][a-z0-9]*)+\b"  # camelCase
    r"|[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+\b"  # PascalCase
    r"|[A-Za-z_]\w*\(\)"  # call()
    r"|[a-z][a-z0-9]*(?:-[a-z0-9]+)*-\d[a-z0-9]*\b"  # gpt-4o, covid-19
    r"|[A-Za-z]{1,10}\d+[A-Za-z0-9]*\b"  # s3, h100, utf8
    r")"
)
_NUMBER_RE = re.compile(
    r"[\d$€£¥](?<![\w.#@/-].)(?:(?<=[$€£¥])\s?\d|(?<=\d))\d*(?:[.,]\d+)*"
    r"(?:(?P<unit>\s?(?:%|percent\b|(?i:k|m|bn|ms|s|secs?|seconds?|mins?|minutes?|h|hrs?|hours?"
    r"|days?|weeks?|months?|years?|gb|mb|kb|tb|gib|mib|kib|usd|eur|gbp|px|rps|qps|tokens?"
    r"|users?|requests?|rows?|items?|files?|lines?|messages?|times|nodes?|replicas?|cores?)\b))"
    r"|(?![\w-]))"
)
_UPPER = "A-ZÀ-ÖØ-Þ"
_ENTITY_RE = re.compile(rf"[{_UPPER}](?<!\w.)[\w'&-]*(?:[ \t]+[{_UPPER}][\w'&-]*)*")
# Titles and Latin abbreviations end in a dot without ending the sentence ("Dr. Jane Smith").
_ABBREVIATIONS = _wordlist("Dr Mr Mrs Ms Prof Sr Jr St vs etc approx Inc Ltd Co Corp No Fig")
_NEXT_SENTENCE = r"(?=[\"')\]]*\s+[^a-z\s])"
_BOUNDARY_RE = re.compile(
    r"[.!?…\n](?:(?<=\n)|(?<=[!?…])"
    + _NEXT_SENTENCE
    + r"|(?<=\.)"
    + "".join(rf"(?<!\b{abbr}\.)" for abbr in _ABBREVIATIONS)
    + r"(?<!\b[a-zA-Z]\.[a-zA-Z]\.)"
    + _NEXT_SENTENCE
    + ")"
)
_LEAD_RE = re.compile(r"\W*")
_PLAIN_WORD_RE = re.compile(r"[a-z]{2,}")
_JSON_KEY_RE = re.compile(r'"[\w.$@-]{1,64}"(?=\s*:)')
_SPACES_RE = re.compile(r"\s+")

_NAME_STOPWORDS_TEXT = (
    "I I'm I've I'll I'd A An The This That These Those It It's Its We We're We'll You "
    "You're Your He She They Them Their My Our Me Us Let Let's If When While So But And Or "
    "Also Then Here There What Why How Who Where Which Yes No Not OK Ok Okay Hi Hello Hey "
    "Thanks Thank Please Sure Great Good Done Note Sorry Maybe Just Now Well Oh Yeah Yep "
    "API APIs JSON HTTP HTTPS URL URLs SQL CPU GPU RAM TODO FYI ETA PR ID IDs UI UX CLI SDK "
    "CSV PDF HTML CSS XML YAML TBD ASAP EOD EOW IMO IIRC BTW LLM AI DB OS VM DNS TLS SSL SSH "
    "UTC GMT NB PS FIXME Dr Mr Mrs Ms Prof Sr Jr St"
)
_NAME_STOPWORDS = frozenset(_wordlist(_NAME_STOPWORDS_TEXT))

# Sentence weights: exact, reusable facts count most; names and soft decision words least.
_W_ID = 3.0
_W_DATE = 2.0
_W_NUMBER = 2.0
_W_SMALL_NUMBER = 0.5
_W_NAME = 1.0
_W_STRONG_DECISION = 2.5
_W_WEAK_DECISION = 1.0
_W_OPEN = 1.5
_W_QUESTION = 0.5
_W_TOPIC = 2.0  # the first sentence of the first user message states what the segment is about
_ROLE_FACTOR = {"tool": 0.5, "system": 0.5, "developer": 0.5}


class _FactSet:
    """Ordered, deduplicated, capped facts per key."""

    __slots__ = ("_seen", "values")

    def __init__(self) -> None:
        self.values: dict[str, list[str]] = {key: [] for key in FACT_KEYS}
        self._seen: dict[str, set[str]] = {key: set() for key in FACT_KEYS}

    def add(self, key: str, value: str) -> None:
        values = self.values[key]
        if len(values) >= FACT_CAPS[key]:
            return
        value = _SPACES_RE.sub(" ", value).strip()
        if not value:
            return
        if len(value) > _MAX_FACT_CHARS:
            value = value[: _MAX_FACT_CHARS - 1].rstrip() + "…"
        # Identifiers and numbers are exact strings; prose facts differ only by case and spacing.
        norm = value if key in ("identifiers", "numbers") else value.casefold()
        seen = self._seen[key]
        if norm not in seen:
            seen.add(norm)
            values.append(value)

    def merge_children(self, children: Iterable[Mapping[str, Any] | None]) -> None:
        # Round-robin over the children, so that under the cap every child keeps its first
        # facts instead of the earliest children crowding out the rest.
        present = [c for c in children if isinstance(c, Mapping)]
        for key in FACT_KEYS:
            lists = [_string_list(c.get(key)) for c in present]
            for row in range(max((len(values) for values in lists), default=0)):
                for values in lists:
                    if row < len(values):
                        self.add(key, values[row])


def _string_list(value: Any) -> list[str]:
    """A fact value as a list of strings, whatever shape a model or a stored row gave it."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [str(value)]
    if isinstance(value, Mapping):
        return [" — ".join(str(v) for v in value.values() if v not in (None, ""))]
    if isinstance(value, list | tuple):
        result: list[str] = []
        for item in value:
            result.extend(_string_list(item))
        return result
    return []


@dataclass(slots=True)
class _Sentence:
    item: int
    position: int
    text: str
    score: float
    line_start: bool  # first of its item, or after a line break in the source


@dataclass(slots=True)
class _Analysis:
    sentences: list[_Sentence] = field(default_factory=list)
    facts: _FactSet = field(default_factory=_FactSet)


def _mask(text: str, spans: list[tuple[int, int]]) -> str:
    if not spans:
        return text
    pieces: list[str] = []
    last = 0
    for start, end in sorted(spans):
        start = max(start, last)  # overlapping spans must not blank a character twice
        if end <= start:
            continue
        pieces.append(text[last:start])
        pieces.append(_MASK * (end - start))
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


def _clean_url(url: str) -> str:
    # Prose punctuation that follows a URL is not part of it.
    return url.rstrip(".,;:!?)]}'\"")


def _name_of(match: re.Match[str], sentence_lead: int) -> str | None:
    words = match.group().split()
    # A capital at the start of a sentence says nothing: drop that word unless more follow.
    if match.start() == sentence_lead:
        if len(words) == 1:
            return None
        words = words[1:]
    while words and words[0] in _NAME_STOPWORDS:
        words = words[1:]
    while words and words[-1] in _NAME_STOPWORDS:
        words = words[:-1]
    if not words:
        return None
    name = " ".join(words)
    for suffix in ("'s", "\u2019s"):
        name = name.removesuffix(suffix)
    return name if len(name) > 1 else None


def _analyze_item(analysis: _Analysis, index: int, item: SummaryInput, *, topic: bool) -> None:
    text = item.text
    if not text or text.isspace():
        return
    facts = analysis.facts
    starts = [0]
    line_starts = [True]
    for boundary in _BOUNDARY_RE.finditer(text):
        starts.append(boundary.end())
        line_starts.append(boundary.group() == "\n")
    ends = [*starts[1:], len(text)]
    scores = [0.0] * len(starts)

    def sentence_of(position: int) -> int:
        return bisect.bisect_right(starts, position) - 1

    masked = text
    spans: list[tuple[int, int]] = []

    def identifier(value: str, start: int, end: int) -> None:
        facts.add("identifiers", value)
        scores[sentence_of(start)] += _W_ID
        spans.append((start, end))

    # Cheap substring guards skip the patterns that cannot match (most messages have no URL).
    if "`" in text:
        for m in _CODE_RE.finditer(masked):
            identifier(m.group(1).strip(), m.start(), m.end())
        masked, spans = _mask(masked, spans), []
    if "://" in text:
        for m in _URL_RE.finditer(masked):
            url = _clean_url(m.group())
            identifier(url, m.start(), m.start() + len(url))
        masked, spans = _mask(masked, spans), []
    if "@" in text:
        for m in _EMAIL_RE.finditer(masked):
            identifier(m.group(), m.start(), m.end())
        masked, spans = _mask(masked, spans), []
    for m in _PATH_RE.finditer(masked):
        identifier(m.group().rstrip("."), m.start(), m.end())
    if "\\" in text:
        for m in _WINDOWS_PATH_RE.finditer(masked):
            identifier(m.group(), m.start(), m.end())
    if '":' in text or '" :' in text:
        # JSON keys of tool results ("elapsed_ms": ...) are schema, not facts of the conversation.
        spans.extend(m.span() for m in _JSON_KEY_RE.finditer(masked))
    masked, spans = _mask(masked, spans), []

    def date(start: int, end: int) -> None:
        facts.add("dates", text[start:end])
        scores[sentence_of(start)] += _W_DATE
        spans.append((start, end))

    strong: set[int] = set()
    opened: set[int] = set()
    for m in _DATE_NUMERIC_RE.finditer(masked):
        date(m.start(), m.end())
    masked, spans = _mask(masked, spans), []
    for m in _CAPS_WORDS_RE.finditer(masked):
        if m.group() in _OPEN_CAPS:
            number = sentence_of(m.start())
            scores[number] += _W_OPEN
            opened.add(number)
        else:
            date(m.start(), m.end())
    masked, spans = _mask(masked, spans), []
    lowered = masked.lower()
    if len(lowered) != len(masked):  # a few characters lower-case to two; offsets would drift
        lowered = "".join(ch if len(ch.lower()) != 1 else ch.lower() for ch in masked)
    for m in _LOWER_WORDS_RE.finditer(lowered):
        word = m.group()
        number = sentence_of(m.start())
        if _STRONG_DECISION_RE.fullmatch(word):
            scores[number] += _W_STRONG_DECISION
            strong.add(number)
        elif _WEAK_DECISION_RE.fullmatch(word):
            scores[number] += _W_WEAK_DECISION
        elif _OPEN_WORD_RE.fullmatch(word):
            scores[number] += _W_OPEN
            opened.add(number)
        else:
            date(m.start(), m.end())
    masked, spans = _mask(masked, spans), []
    for m in _ID_RE.finditer(masked):
        identifier(m.group(), m.start(), m.end())
    masked, spans = _mask(masked, spans), []
    for m in _NUMBER_RE.finditer(masked):
        value = m.group()
        # "3" or "1" is mostly list numbering and counting words; "64", "5 s", "$3" are facts.
        if len(value) > 1:
            facts.add("numbers", value)
            scores[sentence_of(m.start())] += _W_NUMBER
            spans.append(m.span())  # "GB" in "3.5 GB" is a unit, not a name
        else:
            scores[sentence_of(m.start())] += _W_SMALL_NUMBER
    masked, spans = _mask(masked, spans), []
    leads: dict[int, int] = {}
    for m in _ENTITY_RE.finditer(masked):
        number = sentence_of(m.start())
        lead = leads.get(number)
        if lead is None:
            lead_match = _LEAD_RE.match(text, starts[number])
            lead = leads[number] = lead_match.end() if lead_match else starts[number]
        name = _name_of(m, lead)
        if name is not None:
            facts.add("names", name)
            scores[number] += _W_NAME

    factor = _ROLE_FACTOR.get(item.role or "", 1.0)
    for number, (start, end) in enumerate(zip(starts, ends, strict=True)):
        sentence = text[start:end].strip()
        if not sentence or not any(ch.isalnum() for ch in sentence):
            continue
        score = scores[number]
        if sentence.endswith("?"):
            score += _W_QUESTION
        if topic and sentence.count(" ") >= 3:
            # The first real sentence of the first user message: "Hi!" states no topic.
            score += _W_TOPIC
            topic = False
        if number in strong:
            facts.add("decisions", sentence)
        if number in opened:
            facts.add("open_questions", sentence)
        if len(sentence) > _MAX_SENTENCE_CHARS:
            sentence = sentence[: _MAX_SENTENCE_CHARS - 1].rstrip() + "…"
        analysis.sentences.append(
            _Sentence(index, len(analysis.sentences), sentence, score * factor, line_starts[number])
        )


def _analyze(items: Sequence[SummaryInput]) -> _Analysis:
    analysis = _Analysis()
    # Children's facts first: they were distilled from text this summary no longer sees whole.
    if any(item.facts for item in items):
        analysis.facts.merge_children(item.facts for item in items)
    topic_item = next((i for i, item in enumerate(items) if item.role == "user"), None)
    for index, item in enumerate(items):
        _analyze_item(analysis, index, item, topic=index == topic_item)
    # A question in the last message has, by construction, not been answered inside this span.
    last = len(items) - 1
    if items[last].role in ("user", "assistant"):
        for sentence in analysis.sentences:
            if sentence.item == last and sentence.text.endswith("?"):
                analysis.facts.add("open_questions", sentence.text)
    return analysis


def extract_facts(items: Sequence[SummaryInput]) -> dict[str, list[str]]:
    """Key facts of ``items`` by regular expressions, merged after the children's own facts."""
    return _analyze(items).facts.values


# --- extractive ---------------------------------------------------------------------------------


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
        analysis = _analyze(items)
        text = self._narrative(items, analysis.sentences, level=level, budget=target_tokens)
        return Summary(text=text, facts=analysis.facts.values, method="extractive", model=None)

    def _prefix(self, item: SummaryInput, level: int) -> str:
        return f"{item.role}: " if level == 1 and item.role else ""

    def _render(self, items: Sequence[SummaryInput], kept: list[_Sentence], level: int) -> str:
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
        sentences: list[_Sentence],
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
        kept: list[_Sentence] = []
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
_MAX_JSON_ATTEMPTS = 32


def _first_json_object(content: str) -> dict[str, Any] | None:
    """The first JSON object in ``content``: bare, fenced in ```json```, or inside prose."""
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
    for _ in range(_MAX_JSON_ATTEMPTS):
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
    """Structured summaries from an OpenAI-compatible ``POST {base_url}/chat/completions``.

    The client is shared and owned by the caller; ``timeout`` bounds each request. Items longer
    than ``max_item_chars`` are sent with their middle cut out.
    """

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        base_url: str,
        api_key: str | None,
        model: str,
        timeout: float = 60,
        max_item_chars: int = 8000,
        augment_facts: bool = True,
    ) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/chat/completions"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self._timeout = timeout
        self._max_item_chars = max_item_chars
        self._augment_facts = augment_facts

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
                values = _string_list(item.facts.get(key)) if item.facts else []
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
            "temperature": 0,
            "stream": False,
            "response_format": {"type": "json_object"},
        }
        content, finish_reason = await self._complete(payload)
        return self._parse(content, finish_reason, items)

    async def _complete(self, payload: dict[str, Any]) -> tuple[str, str | None]:
        try:
            response = await self._client.post(
                self._url, json=payload, headers=self._headers, timeout=self._timeout
            )
            response.raise_for_status()
            body = response.json()
        except httpx.HTTPStatusError as exc:
            # The error's type/code only: an upstream may quote the request back in its message.
            raise ProviderError(
                f"summary upstream answered HTTP {exc.response.status_code}"
                f"{_error_kind(exc.response)}"
            ) from exc
        except httpx.TimeoutException as exc:
            raise ProviderError(f"summary upstream timed out ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise ProviderError(f"summary upstream unreachable ({type(exc).__name__})") from exc
        except ValueError as exc:
            raise ProviderError("summary upstream sent a body that is not JSON") from exc
        try:
            choice = body["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ProviderError("summary upstream sent no choices[0].message") from exc
        if not isinstance(content, str) or not content.strip():
            raise ProviderError("summary upstream sent an empty message")
        finish_reason = choice.get("finish_reason")
        return content, finish_reason if isinstance(finish_reason, str) else None

    def _parse(
        self, content: str, finish_reason: str | None, items: Sequence[SummaryInput]
    ) -> Summary:
        obj = _first_json_object(content)
        facts = _FactSet()
        if obj is None:
            if finish_reason == "length":
                raise ProviderError("summary upstream stopped at its length limit")
            # A model that ignored the format still wrote a summary; its facts come from the
            # input, which holds them verbatim.
            fence = _FENCE_RE.fullmatch(content.strip())
            narrative = (fence.group(1) if fence else content).strip()
            facts.merge_children([extract_facts(items)])
        else:
            narrative = next(
                (
                    text
                    for key in ("narrative", "summary", "text")
                    if (text := " ".join(_string_list(obj.get(key))).strip())
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


def _error_kind(response: httpx.Response) -> str:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(error, dict):
        return ""
    kind = [str(error[k]) for k in ("type", "code") if isinstance(error.get(k), str | int)]
    return f" ({', '.join(kind)})" if kind else ""


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
    client: httpx.AsyncClient | None,
    base_url: str | None,
    api_key: str | None,
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
    if client is None or not base_url or not model:
        raise ValueError(f"summary mode {mode!r} needs an HTTP client, a base URL and a model")
    llm = LLMSummarizer(client, base_url=base_url, api_key=api_key, model=model, timeout=timeout)
    return llm if mode == "llm" else FallbackSummarizer(llm, extractive)
