"""What the concept graph is keyed by: shared by the path that builds it (`memory.build.graph`)
and the one that walks it (`memory.recall.graph`).

Pure, deterministic, no I/O.

* A concept belongs to a tenant and a **scope** (`scope_key`): the conversation's OpenAI `user`
  when it has one, else the conversation itself. That is exactly how far recall reaches
  (`MEMSTRATA_CROSS_CONVERSATION` recalls the same user's conversations, never others), so a
  graph never links what recall may not join: conversations without a user never recall each
  other, and one conversation's co-occurrences must not steer another's walk.
* A concept's **key** (`concept_key`) is its name case-folded, with spacing collapsed, edge
  punctuation and a possessive dropped: "Caroline's" and "caroline" are one concept, and
  exact-name matches compare keys.
* **Phrases** (`phrases`) are the candidate concepts of a text in the manner of RAKE: runs of
  at most `MAX_WORDS` content words between stop words (`memory.text.CONCEPT_STOPWORDS`) and
  punctuation. `query_keys` gives every run's n-grams, for matching a question's
  words against concept names.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final

from memory.text import CONCEPT_STOPWORDS

__all__ = [
    "MAX_WORDS",
    "SCHEMATIC",
    "concept_key",
    "phrases",
    "query_keys",
    "scope_key",
]

SCHEMATIC: Final = 5
"""Frequency (segments a concept was found in) from which a concept is schematic: a core concept
of the scope, listed first."""

MAX_WORDS: Final = 3
"""Most words of one phrase."""

_TOKEN = re.compile(r"[^\W_][\w'\u2019&-]*|[.,;:!?()\[\]{}\"\u201c\u201d/|\n]")
_EDGE = re.compile(r"^[\W_]+|[\W_]+$")
_POSSESSIVE = re.compile(r"['\u2019]s?$")
_SPACES = re.compile(r"\s+")


def scope_key(*, user: str | None, conversation_id: int) -> str:
    """The scope of a conversation's concepts (see the module docstring)."""
    return f"user:{user}" if user is not None else f"conversation:{conversation_id}"


def concept_key(name: str) -> str:
    """The key of a concept named `name` (see the module docstring); empty when nothing is left."""
    words = [_POSSESSIVE.sub("", _EDGE.sub("", word)) for word in name.casefold().split()]
    return _SPACES.sub(" ", " ".join(word for word in words if word)).strip()


def _runs(text: str) -> Iterator[list[str]]:
    """Runs of content words (case-folded), cut at stop words and punctuation."""
    stop = CONCEPT_STOPWORDS
    run: list[str] = []
    for token in _TOKEN.findall(text):
        word = _POSSESSIVE.sub("", token.casefold())
        if len(word) < 3 or word in stop or word.isdigit() or not word[0].isalnum():
            if run:
                yield run
            run = []
            continue
        run.append(word)
    if run:
        yield run


def phrases(text: str) -> list[str]:
    """The text's candidate phrases, in order, repeats kept: each run of content words, cut
    into pieces of at most `MAX_WORDS` words."""
    found: list[str] = []
    for run in _runs(text):
        for start in range(0, len(run), MAX_WORDS):
            found.append(" ".join(run[start : start + MAX_WORDS]))
    return found


def query_keys(query: str) -> list[str]:
    """Every n-gram (up to `MAX_WORDS` words) of the query's runs of content words: the keys
    a concept named in the query can have."""
    keys: dict[str, None] = {}
    for run in _runs(query):
        for size in range(1, MAX_WORDS + 1):
            for start in range(len(run) - size + 1):
                keys[" ".join(run[start : start + size])] = None
    return list(keys)
