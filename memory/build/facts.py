"""Key facts and scored sentences read out of conversation text (SPEC §5).

Pure CPU, no I/O, deterministic, and nothing is logged: the summarizers of
:mod:`memory.build.summarize` take their facts and their candidate sentences from here. The input is
a sequence of :class:`FactSource` in conversation order: each a role, a text and, for a summary,
the facts it already holds.

Contract:

* :func:`extract_facts` returns the key facts under exactly the keys of :data:`FACT_KEYS`, all
  present, in that order. Each is a list of strings: whitespace collapsed, long ones cut with
  an ellipsis, deduplicated (identifiers and numbers as exact strings, the rest ignoring case)
  and at most :data:`FACT_CAPS` per key. The sources' own facts come first, taken round-robin
  so that each keeps its first ones under the cap; then come the facts that regular
  expressions find in the texts: identifiers (code spans, URLs, emails, paths, ticket ids,
  hashes, versions, code symbols), numbers of more than one character with their units, dates
  and times, names, decisions (the sentences holding a firm decision word: "decided",
  "agreed", "we'll", ...) and open questions (the sentences marked unresolved: "TBD", "not
  sure", "pending", ...; and the questions of the last text if a user or an assistant wrote
  it).
* :func:`analyze` returns those facts together with every text's sentences, in order, each
  scored by the facts it carries, by being a question or stating the topic (the first real
  sentence of the first user text), and scaled down for tool, system and developer texts.
* :class:`FactSet` is the ordered, deduplicated, capped collection behind both, for callers
  that merge facts of their own (a model's reply); :func:`string_list` reads one fact value of
  any shape as strings.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from memory.text import (
    MONTH_FORMS,
    MONTHS,
    NAME_STOPWORDS,
    OPEN_MARKERS,
    RELATIVE_DAYS,
    SENTENCE_OPENERS,
    WEEKDAYS,
    sentence_starts,
)

__all__ = [
    "FACT_CAPS",
    "FACT_KEYS",
    "Analysis",
    "FactSet",
    "FactSource",
    "Sentence",
    "analyze",
    "extract_facts",
    "string_list",
]

FACT_KEYS: Final = ("identifiers", "numbers", "names", "dates", "decisions", "open_questions")
"""The keys of every facts mapping (as in :attr:`memory.build.summarize.Summary.facts`), always all
present, in this order."""

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


class FactSource(Protocol):
    """A text to read facts from: a message, or a summary together with the facts it holds."""

    @property
    def role(self) -> str | None: ...

    @property
    def text(self) -> str: ...

    @property
    def facts(self) -> Mapping[str, list[str]] | None: ...


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
_MONTH_FORMS = [month.capitalize() for month in MONTH_FORMS]
_DAY_OF_MONTH = r"\.?\s+\d{1,2}(?:st|nd|rd|th)?\b(?:,?\s+\d{4}\b)?|\s+\d{4}\b"
# Capitalised or upper-case words: months, EOD, Q3, FY24, and TBD / TODO / FIXME.
_OPEN_CAPS = frozenset(OPEN_MARKERS)
_CAPS_WORDS_RE = re.compile(
    _words(
        [
            # A bare month name counts when spelled out ("in March"), except "May" (the verb);
            # abbreviations and May only with a day or a year.
            *(
                f"{m}(?:{_DAY_OF_MONTH})?"
                if i < len(MONTHS) and m != "May"
                else f"{m}(?:{_DAY_OF_MONTH})"
                for i, m in enumerate(_MONTH_FORMS)
            ),
            r"EO[DWMY]",
            r"Q[1-4](?:\s+(?:FY)?\d{2,4})?",
            r"FY\s?\d{2,4}",
            *OPEN_MARKERS,
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
_WEEKDAYS = "|".join(WEEKDAYS)
_DATE_WORDS = [
    rf"(?:next|last|this)\s+(?:{_WEEKDAYS}|week|month|quarter|year|sprint)",
    _WEEKDAYS,
    "|".join(RELATIVE_DAYS),
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
_LEAD_RE = re.compile(r"\W*")
_JSON_KEY_RE = re.compile(r'"[\w.$@-]{1,64}"(?=\s*:)')
_SPACES_RE = re.compile(r"\s+")

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


class FactSet:
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
            lists = [string_list(c.get(key)) for c in present]
            for row in range(max((len(values) for values in lists), default=0)):
                for values in lists:
                    if row < len(values):
                        self.add(key, values[row])


def string_list(value: Any) -> list[str]:
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
            result.extend(string_list(item))
        return result
    return []


@dataclass(slots=True)
class Sentence:
    """One sentence of the input, with the weight of the facts it carries."""

    item: int
    position: int
    text: str
    score: float
    line_start: bool  # first of its item, or after a line break in the source


@dataclass(slots=True)
class Analysis:
    """All sentences of the input, in order, and its facts."""

    sentences: list[Sentence] = field(default_factory=list)
    facts: FactSet = field(default_factory=FactSet)


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
    # A capital at the start of a sentence says nothing on its own: a lone word there is no
    # name, and a common word there is dropped from the names that follow it.
    if match.start() == sentence_lead:
        if len(words) == 1:
            return None
        if words[0] in SENTENCE_OPENERS:
            words = words[1:]
    while words and words[0] in NAME_STOPWORDS:
        words = words[1:]
    while words and words[-1] in NAME_STOPWORDS:
        words = words[:-1]
    if not words:
        return None
    name = " ".join(words)
    for suffix in ("'s", "\u2019s"):
        name = name.removesuffix(suffix)
    return name if len(name) > 1 else None


def _analyze_item(analysis: Analysis, index: int, item: FactSource, *, topic: bool) -> None:
    text = item.text
    if not text or text.isspace():
        return
    facts = analysis.facts
    starts = sentence_starts(text, prose=True)
    line_starts = [start == 0 or text[start - 1] == "\n" for start in starts]
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
            Sentence(index, len(analysis.sentences), sentence, score * factor, line_starts[number])
        )


def analyze(items: Sequence[FactSource]) -> Analysis:
    """The sentences and key facts of ``items``; see the module docstring."""
    analysis = Analysis()
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


def extract_facts(items: Sequence[FactSource]) -> dict[str, list[str]]:
    """Key facts of ``items`` by regular expressions, merged after the children's own facts."""
    return analyze(items).facts.values
