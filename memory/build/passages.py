"""A message's passages: its sentences, each embedded on its own beside the whole message.

A message's vector averages everything it says, so the one sentence that answers a question
("I was in the final of a big Valorant tournament") is diluted by the greeting and small talk
around it. `split()` cuts a message's text into the sentences worth a vector of their own; the
summary tree's build embeds them with the message (`memory.build.tree`) into the `passages`
table, and retrieval's passage leg (`memory.recall.nearest.vector_legs`) ranks the vector
leg's candidates again, each by whichever matches the query best, its whole text or one of its
passages.

A message gets passages only when it has at least two sentences of `MIN_WORDS` words or more:
a one-sentence message's passage would be its whole text again. Past `MAX_PASSAGES` sentences,
neighbouring sentences are grouped so that a long pasted document costs at most that many
vectors. The cost is ~1.5x the embedding work per message, in the background;
`MEMSTRATA_PASSAGES=off` skips it (docs/benchmarks.md has what it buys on LoCoMo).
"""

from __future__ import annotations

from typing import Final

from memory.text import split_sentences

MIN_WORDS: Final = 3
"""Shortest sentence, in words, embedded on its own ("Hey Joanna!" says nothing to find)."""

MAX_PASSAGES: Final = 16
"""Most passages of one message (`passages.ordinal` is a smallint)."""


def split(text: str) -> list[str]:
    """The passages of a message's `text`, in order; none when it has fewer than two."""
    sentences = [part for part in split_sentences(text) if len(part.split()) >= MIN_WORDS]
    if len(sentences) < 2:
        return []
    if len(sentences) <= MAX_PASSAGES:
        return sentences
    size = -(-len(sentences) // MAX_PASSAGES)
    return [" ".join(sentences[i : i + size]) for i in range(0, len(sentences), size)]
