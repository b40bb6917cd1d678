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
    "RELATIONAL_LENGTH",
    "Route",
    "asks",
    "asks_for_old",
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
    GRAPH = "graph"  # relational, answered with the concept graph too (`memory.recall.graph`)


_SEQUENTIAL = re.compile(
    r"\b(last time|earlier|before|recent(ly)?|previous(ly)?|lately|just now|ago|"
    r"last (week|month|session|conversation|chat))\b",
    re.IGNORECASE,
)
_RELATIONAL = re.compile(
    r"\b(how|why|relate[sd]?|relation(ship)?s?|connect(ed|ion)?s?|overall|in general|"
    r"explain(s|ed|ing)?|explanation|caus(e|es|ed|ing)|effects?)\b",
    re.IGNORECASE,
)
RELATIONAL_LENGTH: Final = 80
"""A query longer than this (in characters) is relational: it describes, rather than names,
what it looks for."""
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
    """The route of a query: sequential ("last time", "earlier", ...) wins over relational
    ("how", "why", "relate", "explain", "cause", "effect", ... or longer than
    `RELATIONAL_LENGTH`), else flat. Where the concept graph's leg is asked for, a relational
    query takes the graph route when the graph knows some of its concepts
    (`memory.recall.graph.leg`); otherwise it keeps the flat legs, its summaries raised."""
    if _SEQUENTIAL.search(query):
        return Route.SEQUENTIAL
    if _RELATIONAL.search(query) or len(query.strip()) > RELATIONAL_LENGTH:
        return Route.RELATIONAL
    return Route.FLAT


_OLD = re.compile(
    r"\b(old|older|oldest|long ago|(years?|months?) ago|originally|at first|first time|"
    r"back (then|when|in)|in the beginning|ever|used to|archived?)\b",
    re.IGNORECASE,
)


def asks_for_old(query: str) -> bool:
    """Whether a query asks for old things ("years ago", "originally", "back then", a calendar
    period it names): such a query is not answered from the hot and warm tiers alone."""
    return bool(_OLD.search(query)) or bool(periods(query))


def websearch_query(query: str) -> str:
    """`query` in `websearch_to_tsquery` syntax with its words joined by `or`.

    Quoted phrases stay phrases; a leading `-` (negation) is dropped: recall matters more than
    precision here, the ranking sorts the matches."""
    phrases = [f'"{p.strip()}"' for p in _PHRASE.findall(query) if p.strip()]
    rest = _PHRASE.sub(" ", query)
    words = [w.lstrip("-") for w in _WORD.findall(rest)]
    words = [w for w in words if w and w.lower() != "or"]
    return " or ".join(phrases + words)


_IDENTIFIER = re.compile(r"[\w][\w./:#-]*\d[\w./:#-]*|[\w][\w./:#-]*[./:#-]\d+")


def identifiers(query: str) -> list[str]:
    """The query's identifier-like words: at least 4 characters, one a digit (tickets,
    references, versions, dates)."""
    found = (word.strip(".,;:!?#-/") for word in _IDENTIFIER.findall(query))
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
