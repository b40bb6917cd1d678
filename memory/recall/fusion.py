"""Rank fusion: the legs' candidates become one score per node (SPEC §6).

`fuse()` turns the candidates of retrieval's legs (`memory.recall.retrieval`: full text, vector,
passages) into one score per node place:

* reciprocal-rank fusion of the legs (`RRF_K`);
* exact matches win: a node holding a rare identifier of the query gets a bonus worth
  `EXACT_BONUS` first ranks in every leg, a vector hit standing far above the rest of its leg
  one worth `EXACT_BONUS` first ranks;
* temporal contiguity: each message lends a share of its score to the messages next to it
  (`CONTIGUITY`), so an answer right after the best match is found even when it shares no word
  with the question;
* query routing (`ROUTE_WEIGHTS`): sequential questions weight recency heavily, relational ones
  raise summaries, others are flat hybrid with a light recency tie-break;
* periods: a query naming a calendar period ("in March 2023", "on 2023-03-16") raises the
  messages written within it (or in the week after), after contiguity;
* speakers: a query naming one participant (a message `name`) raises that participant's
  messages, after contiguity (what a message lends its neighbours is not raised, so the other
  participant's replies around them do not crowd out the named one's own words).

Pure functions over plain data: no SQL here. Weights were tuned on LoCoMo (see
docs/benchmarks.md).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Final

from memory.recall.query import Route
from memory.stages import staged

__all__ = [
    "CONTIGUITY",
    "RRF_K",
    "Candidates",
    "Key",
    "Place",
    "fuse",
    "ranked",
    "standouts",
]

RRF_K: Final = 20
"""Reciprocal-rank fusion constant: score = Σ weight / (RRF_K + rank). Lower than the usual 60:
tuned on LoCoMo, where the first ranks of each leg deserve more weight."""

CONTIGUITY: Final = (0.8, 0.4)
"""Share of a message's relevance lent to the messages 1, 2, ... places away: an exchange is
about one thing, so a question's answer often sits next to the message that matches best."""

EXACT_BONUS: Final = 2.0
"""A node holding a rare identifier of the query (a word with digits that at most 3 searched
nodes hold: a ticket, a booking reference) gains this many first ranks in every leg; a vector
standout (`STANDOUT_Z`) gains this many first ranks in all. Rank fusion alone would let a
near-miss by meaning, first in both vector legs and lent more by its neighbours, outrank the
exact match; with one bonus of 2 first ranks for both kinds, a standout at similarity 0.40 (its
leg's next at 0.37) outranked the one message holding the code asked for."""

STANDOUT_Z: Final = 4.0
"""How far (in standard deviations) a vector hit must stand above its leg to count as exact."""

SPEAKER_BOOST: Final = 2.0
"""Multiplier of the fused score of candidates written by the one participant a query names."""

PERIOD_BOOST: Final = 2.0
"""Multiplier of the fused score of candidates written within a calendar period the query
names (`memory.recall.query.periods`: "in March 2023" also reaches the week after, when messages
still tell of it)."""


@dataclass(frozen=True)
class Weights:
    """How one route weighs summaries and recency against relevance."""

    summary: float  # multiplier of a summary's fused score
    recency: float  # weight of the recency boost (0: none)


ROUTE_WEIGHTS: Final[Mapping[Route, Weights]] = {
    Route.FLAT: Weights(summary=0.6, recency=0.05),
    Route.SEQUENTIAL: Weights(summary=0.8, recency=1.5),
    Route.RELATIONAL: Weights(summary=1.5, recency=0.05),
}


Key = tuple[int, int, int]
"""A node's place: (conversation id, level, seq), unique in its tenant."""


@dataclass(slots=True)
class Place:
    """What fusion needs to know of a candidate. Not frozen, though never changed: a frozen
    dataclass is built through `object.__setattr__`, four times as slow, and a turn builds
    ~1,600 (0.95 against 0.24 ms per 1,200)."""

    key: Key
    span_end: int
    name: str | None
    exact: bool = False  # holds a rare identifier-like word of the query (digits, ≥ 4 chars)
    similarity: float | None = None  # cosine similarity to the query (vector leg)
    created_at: datetime | None = None


@dataclass(frozen=True)
class Candidates:
    """One leg's candidates, best first."""

    ranked: list[Place]


@staged("fuse")
def fuse(
    legs: Sequence[Candidates],
    *,
    which: Route,
    newest: Mapping[int, int],
    primary: int | None = None,
    speakers: Collection[str] = (),
    exclude_from: tuple[int, int] | None = None,
    kernel: Sequence[float] = CONTIGUITY,
    within: Sequence[tuple[date, date]] = (),
    own: dict[Key, float] | None = None,
) -> dict[Key, float]:
    """Fused score per node place (see the module docstring); `own`, when given, is filled in
    the same pass with what each candidate scores by itself (what `fuse` gives with no
    contiguity: the rest was lent to it by its neighbours), the same floats.

    Reciprocal-rank fusion of the legs; each message lends `kernel[d-1]` of its score to the
    messages `d` places away (which may not be candidates themselves); candidates written by
    the one participant in `speakers`, and those written within one of the periods `within`
    (first day, last day), are then raised; summaries are weighted by the route;
    recency (`newest` maps a conversation to its newest message seq) raises newer nodes, more
    so for sequential queries; other conversations than `primary` weigh a little less."""
    weights = ROUTE_WEIGHTS[which]
    one_speaker = len(speakers) == 1
    base: dict[Key, float] = {}
    span_end: dict[Key, int] = {}
    names: dict[Key, str | None] = {}
    written: dict[Key, date] = {}
    exact: set[Key] = set()
    # Thousands of places and keys per prompt, on the request path: the loops keep their
    # lookups local and skip what the call does not use (names without one speaker, days
    # without periods): 2.4 ms of CPU for three legs of 400 candidates where a plain loop took
    # 4.6. A rank's worth is computed once per rank, and the shares add up in a fixed order
    # (the nearest neighbour first, the earlier side first), so equal inputs fuse to equal floats.
    longest = max((len(leg.ranked) for leg in legs), default=0)
    by_rank = [1.0 / (RRF_K + rank + 1) for rank in range(longest)]
    for leg in legs:
        for worth, place in zip(by_rank, leg.ranked, strict=False):
            key = place.key
            base[key] = base.get(key, 0.0) + worth
            span_end[key] = place.span_end
            if one_speaker:
                names[key] = place.name
            if within and place.created_at is not None:
                written[key] = place.created_at.date()
            if place.exact:
                exact.add(key)
    summary_weight = weights.summary
    recency_weight = weights.recency
    lends = [
        (side * distance, share)
        for distance, share in enumerate(kernel, start=1)
        for side in (-1, 1)
    ]
    # The exact-match bonuses are the node's own: they are not lent to neighbours.
    scores: dict[Key, float] = dict.fromkeys(standouts(legs), EXACT_BONUS / (RRF_K + 1))
    scores.update(dict.fromkeys(exact, EXACT_BONUS * len(legs) / (RRF_K + 1)))
    get = scores.get
    # What each candidate scores by itself (kept only when `own` asks for it).
    unlent: dict[Key, float] = dict(scores) if own is not None else {}
    mine_of = unlent.get
    for key, score in base.items():
        conv, level, seq = key
        if level > 0:
            scores[key] = get(key, 0.0) + score * summary_weight
            if own is not None:
                unlent[key] = mine_of(key, 0.0) + score * summary_weight
            continue
        scores[key] = get(key, 0.0) + score
        if own is not None:
            unlent[key] = mine_of(key, 0.0) + score
        for offset, share in lends:
            near = seq + offset
            if near >= 0:
                lent: Key = (conv, 0, near)
                scores[lent] = get(lent, 0.0) + share * score
    excluded_conv, excluded_from = exclude_from if exclude_from is not None else (None, 0)
    # Per conversation: its newest seq and the scale of its recency decay.
    horizons = {conv: (last, max(50.0, 0.05 * (last + 1))) for conv, last in newest.items()}
    exp = math.exp
    end_of = span_end.get
    horizon_of = horizons.get
    speaker_of = names.get
    day_of = written.get
    kept = own if own is not None else {}
    result: dict[Key, float] = {}
    for key, score in scores.items():
        conv, level, seq = key
        end = end_of(key, seq)
        horizon = horizon_of(conv)
        if level == 0 and (
            (horizon is not None and seq > horizon[0])  # a neighbour past the end
            or (conv == excluded_conv and seq >= excluded_from)
        ):
            continue
        if horizon is None:
            last, scale = end, max(50.0, 0.05 * (end + 1))
        else:
            last, scale = horizon
        # The score by itself, when asked, scaled alike, factor by factor (the same floats as
        # fusing without contiguity).
        mine = mine_of(key)
        gap = last - end
        factor = 1.0 + recency_weight * exp(-(gap if gap > 0 else 0) / scale)
        score *= factor
        if mine is not None:
            mine *= factor
        if primary is not None and conv != primary:
            score *= 0.9
            if mine is not None:
                mine *= 0.9
        if level == 0:
            if one_speaker and speaker_of(key) in speakers:
                score *= SPEAKER_BOOST
                if mine is not None:
                    mine *= SPEAKER_BOOST
            if within:
                day = day_of(key)
                if day is not None and any(a <= day <= b for a, b in within):
                    score *= PERIOD_BOOST
                    if mine is not None:
                        mine *= PERIOD_BOOST
        result[key] = score
        if mine is not None:
            kept[key] = mine
    return result


def standouts(legs: Sequence[Candidates]) -> set[Key]:
    """Candidates whose similarity stands far above the rest of their leg's (more than
    `STANDOUT_Z` standard deviations over the mean of its first 50): a match by meaning that
    clear is as telling as an exact identifier, which rank fusion alone would not show."""
    found: set[Key] = set()
    for leg in legs:
        sims = [p.similarity for p in leg.ranked[:50] if p.similarity is not None]
        if len(sims) < 10:
            continue
        mean = sum(sims) / len(sims)
        spread = math.sqrt(sum((x - mean) ** 2 for x in sims) / len(sims))
        if spread <= 1e-6:
            continue
        for place in leg.ranked[:3]:
            if place.similarity is not None and (place.similarity - mean) / spread > STANDOUT_Z:
                found.add(place.key)
    return found


def ranked(scores: Mapping[Key, float], limit: int) -> list[Key]:
    """The `limit` best-scored places, best first (ties: the newer first)."""
    if limit <= 0 or not scores:
        return []
    # Only the places scoring at least the `limit`-th best score need the full sort.
    floor = heapq.nlargest(limit, scores.values())[-1]
    best = [key for key, score in scores.items() if score >= floor]
    return sorted(best, key=lambda key: (-scores[key], -key[2], key))[:limit]
