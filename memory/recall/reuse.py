"""Memory reuse: how much of a prompt repeats the previous prompt's prefix, byte for byte.

A provider caches a prompt's prefix: what the next prompt repeats of it, from the first byte on,
is billed at the cached rate (OpenAI: half price, Anthropic: a tenth). `measure(previous,
messages, counts, marks)` answers, for a prompt whose messages cost `counts` tokens each, the
tokens it repeats of the previous prompt (`previous`: that prompt's fingerprint) and its own
fingerprint. A fingerprint is a few checkpoints, each the number of leading messages, a hash of
their exact JSON (as the upstream receives it: `json.dumps` of each message with compact
separators, in the dict order given) chained message by message, and their tokens.

Granularity is the message: one that differs by a byte counts as not repeated, whatever the
provider's own rule makes of it (OpenAI caches from 1,024 tokens on, in steps of 128; the
benchmarks apply that rule, this figure does not). Checkpoints are kept at the prompt's end and
at the `marks` given (the end of the system prompt, of each stable-memory message, of the
verbatim turns): the end is what the next prompt repeats when it only grows, the marks are what
a compaction keeps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from itertools import accumulate
from typing import Any

from memory.tokens import compact_json

__all__ = ["Checkpoint", "measure"]

Checkpoint = list[Any]
"""`[messages, hash, tokens]`: a list, as it is stored in JSON."""


def _chain(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    hashes: list[str] = []
    parent = b""
    for message in messages:
        raw = compact_json(message)
        parent = hashlib.blake2b(parent + raw.encode(), digest_size=12).digest()
        hashes.append(parent.hex())
    return hashes


def measure(
    previous: Any,
    messages: Sequence[Mapping[str, Any]],
    counts: Sequence[int],
    marks: Iterable[int] = (),
) -> tuple[int, list[Checkpoint]]:
    """The tokens of `messages` that repeat the longest checkpointed prefix of the previous
    prompt (0 without one), and the fingerprint of `messages`: checkpoints after each of the
    `marks` (message counts) and at the end."""
    if not messages:
        return 0, []
    hashes = _chain(messages)
    tokens = list(accumulate(counts))
    repeated = 0
    if isinstance(previous, list):
        for checkpoint in sorted(previous, key=lambda item: -int(item[0])):
            end = int(checkpoint[0])
            if 0 < end <= len(messages) and hashes[end - 1] == checkpoint[1]:
                repeated = tokens[end - 1]
                break
    ends = sorted({mark for mark in marks if 0 < mark < len(messages)} | {len(messages)})
    return repeated, [[end, hashes[end - 1], tokens[end - 1]] for end in ends]
