"""Reading a query before searching: its route, its full-text form, its identifiers, the
participants and the calendar periods it names (see `memory.recall.retrieval`)."""

from __future__ import annotations

import re
from collections.abc import Collection
from datetime import date, timedelta
from enum import StrEnum
from typing import Final

from memory.text import MONTH_FORMS, MONTHS

__all__ = [
    "Route",
    "asks",
    "identifiers",
    "participants_named",
    "periods",
    "route",
    "websearch_query",
    "without_names",
]


class Route(StrEnum):
    """How a query is answered (SPEC §6 query routing)."""

    FLAT = "flat"
    SEQUENTIAL = "sequential"
    RELATIONAL = "relational"


_SEQUENTIAL = re.compile(
    r"\b(last time|earlier|before|recent(ly)?|previous(ly)?|lately|just now|ago|"
    r"last (week|month|session|conversation|chat))\b",
    re.IGNORECASE,
)
_RELATIONAL = re.compile(
    r"\b(how|why|relate[sd]?|relation(ship)?s?|connect(ed|ion)?s?|overall|in general)\b",
    re.IGNORECASE,
)
_PHRASE = re.compile(r'"([^"]+)"')
_WORD = re.compile(r"[^\s\"()]+")


_ASKING = re.compile(
    r"\?|(^|[.!]\s+)(what|when|where|who|whom|whose|which|why|how|do|does|did|is|are|was|were|"
    r"can|could|would|will|should|have|has|had|remind me|tell me|remember|recall)\b",
    re.IGNORECASE,
)


def asks(query: str) -> bool:
    """Whether a message asks something (a question mark, or a sentence that opens as a
    question or a request to remind): it calls for more recall than a statement."""
    return _ASKING.search(query) is not None


def route(query: str) -> Route:
    """The route of a query: sequential wins over relational, else flat."""
    if _SEQUENTIAL.search(query):
        return Route.SEQUENTIAL
    if _RELATIONAL.search(query):
        return Route.RELATIONAL
    return Route.FLAT


def websearch_query(query: str) -> str:
    """`query` in `websearch_to_tsquery` syntax with its words joined by `or`.

    Quoted phrases stay phrases; a leading `-` (negation) is dropped: recall matters more than
    precision here, the ranking sorts the matches."""
    phrases = [f'"{p.strip()}"' for p in _PHRASE.findall(query) if p.strip()]
    rest = _PHRASE.sub(" ", query)
    words = [w.lstrip("-") for w in _WORD.findall(rest)]
    words = [w for w in words if w and w.lower() != "or"]
    return " or ".join(phrases + words)


_RUN = re.compile(r"[\w./:#-]+")
_DIGIT = re.compile(r"\d")


def identifiers(query: str) -> list[str]:
    """The query's identifier-like words: at least 4 characters, one a digit (tickets,
    references, versions, dates).

    A word is a run of word characters and `./:#-`, from its first word character to its end,
    when a digit follows that character. Read run by run, in linear time: one pattern matching
    such words backtracks through the rest of a long run from each of its characters, which
    takes minutes for a pasted blob of 100,000 characters."""
    found = []
    for run in _RUN.findall(query):
        first = len(run) - len(run.lstrip("./:#-"))
        if _DIGIT.search(run, first + 1):
            found.append(run[first:].strip(".,;:!?#-/"))
    return list(dict.fromkeys(word for word in found if len(word) >= 4))


def participants_named(query: str, participants: Collection[str]) -> set[str]:
    """The participants (message `name`s) that `query` names as a whole word."""
    return {
        name
        for name in participants
        if name and re.search(rf"(?<!\w){re.escape(name)}(?!\w)", query, re.IGNORECASE)
    }


def without_names(query: str, names: Collection[str]) -> str:
    """`query` without the given names (and their possessive 's): inside a conversation its
    participants' names say nothing about the topic, and would pull the vector toward every
    message that greets them."""
    result = query
    for name in sorted(names, key=len, reverse=True):
        result = re.sub(rf"(?<!\w){re.escape(name)}('s)?(?!\w)", " ", result, flags=re.I)
    result = re.sub(r"\s+", " ", result).strip()
    return result or query


# Every spelling of a month, longest first at each position (MONTH_FORMS' order).
_MONTH = "(" + "|".join(MONTH_FORMS) + ")"
_DAY = r"(\d{1,2})(?:st|nd|rd|th)?"
_DATES = re.compile(
    rf"\b(?:{_MONTH}\.?\s+(?:{_DAY},?\s+)?(\d{{4}})|{_DAY}\s+{_MONTH}\.?,?\s+(\d{{4}})|"
    r"(\d{4})-(\d{2})(?:-(\d{2}))?)\b",
    re.IGNORECASE,
)
AFTERWARDS: Final = timedelta(days=7)
"""How long after a period messages may still tell of it ("yesterday I went …")."""


def periods(query: str) -> list[tuple[date, date]]:
    """The calendar periods the query names (`March 2023`, `March 16, 2022`, `16 March 2022`,
    `2023-03`, `2023-03-16`), each as (first day, last day + `AFTERWARDS`)."""
    found: list[tuple[date, date]] = []
    for match in _DATES.finditer(query):
        month_a, day_a, year_a, day_b, month_b, year_b, iso_y, iso_m, iso_d = match.groups()
        try:
            if year_a:
                year, month, day = int(year_a), _month(month_a), int(day_a) if day_a else None
            elif year_b:
                year, month, day = int(year_b), _month(month_b), int(day_b)
            else:
                year, month, day = int(iso_y), int(iso_m), int(iso_d) if iso_d else None
            if day is not None:
                first = last = date(year, month, day)
            else:
                first = date(year, month, 1)
                last = date(year + month // 12, month % 12 + 1, 1) - timedelta(days=1)
        except ValueError:  # no such day
            continue
        found.append((first, last + AFTERWARDS))
    return found


def _month(name: str) -> int:
    return next(i for i, full in enumerate(MONTHS, start=1) if full.startswith(name.lower()[:3]))
