"""Reading a query before searching: its route, its full-text form, its identifiers, and the
participants it names (see `memory.retrieval`)."""

from __future__ import annotations

import re
from collections.abc import Collection
from enum import StrEnum

__all__ = [
    "Route",
    "identifiers",
    "participants_named",
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
