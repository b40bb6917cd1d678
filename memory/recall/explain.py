"""Why retrieval picked what it picked: each recalled node's place in the legs and its rank.

`explain(legs, scores, hits)` reads what a fusion already holds (the legs' candidates, best
first, and the fused score of every place, `memory.recall.fusion`) and says, for each hit:

* its rank among every fused place (1: the best) and its fused score;
* its rank in each leg that found it (full text, vector, passages; or, for a recall note drawn
  from the candidates prepared after the last reply, `prepared`; 1-based), with the cosine
  similarity the vector legs measured;
* `exact`: it holds a rare identifier of the query (a bonus in every leg); `standout`: its
  similarity stands far above the rest of its vector leg (`fusion.standouts`);
* `lent`: no leg found it; it is there because a neighbour found by a leg lent it part of its
  score (temporal contiguity), such as the answer right after a matching question;
* `pinned`: a milestone, in the prompt whatever the query (its legs and rank, if any, say how
  much it bears on this one).

Pure function over plain data, run only where a caller asks for an explanation (the admin
dry run): the request path never pays for it.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from memory.recall.fusion import Candidates, Key, standouts
from memory.recall.retrieval import Hit

__all__ = ["GRAPH_LEG", "LEGS", "PREPARED_LEGS", "LegRank", "Why", "explain"]

LEGS: Final = ("full text", "vector", "passages")
"""The legs' names, in the order retrieval runs them (`retrieval.search`, `prompt.build`)."""
GRAPH_LEG: Final = "graph"
"""The concept graph's leg, after the others when a relational query takes it
(`memory.recall.graph.leg`)."""
PREPARED_LEGS: Final = ("prepared", "full text")
"""The legs of a recall note from prepared candidates: those candidates by similarity, then the
identifiers the new message names (`recall_note.recall`)."""


@dataclass(frozen=True)
class LegRank:
    """Where one leg placed a node."""

    leg: str
    rank: int  # 1: the leg's best
    similarity: float | None  # cosine similarity to the query (vector legs)


@dataclass(frozen=True)
class Why:
    """Why one node was recalled."""

    node_id: int
    level: int
    seq: int
    rank: int  # among every fused place, 1: the best
    score: float
    legs: tuple[LegRank, ...]
    exact: bool
    standout: bool
    lent: bool
    pinned: bool


def explain(
    legs: Sequence[Candidates],
    scores: Mapping[Key, float],
    hits: Sequence[Hit],
    *,
    pinned: Collection[int] = (),
    names: Sequence[str] = LEGS,
) -> list[Why]:
    """Why each of `hits` was found, best rank first (see the module docstring). `legs` are
    named by `names`, in order; `scores` is what fusion made of them; `pinned` are the
    milestones' ids."""
    places: list[dict[Key, tuple[int, float | None]]] = []
    exact: set[Key] = set()
    for leg in legs:
        ranks: dict[Key, tuple[int, float | None]] = {}
        for index, place in enumerate(leg.ranked):
            ranks.setdefault(place.key, (index + 1, place.similarity))
            if place.exact:
                exact.add(place.key)
        places.append(ranks)
    clear = standouts(legs)
    # Ascending, so that the places scoring above a hit are counted by one bisection.
    ordered = sorted(scores.values())
    explained: list[Why] = []
    for hit in hits:
        key: Key = (hit.conversation_id, hit.level, hit.seq)
        found: list[LegRank] = []
        for index, ranks in enumerate(places):
            if key in ranks:
                rank, similarity = ranks[key]
                found.append(LegRank(leg=names[index], rank=rank, similarity=similarity))
        score = scores.get(key, hit.score)
        explained.append(
            Why(
                node_id=hit.node_id,
                level=hit.level,
                seq=hit.seq,
                rank=len(ordered) - bisect.bisect_right(ordered, score) + 1,
                score=score,
                legs=tuple(found),
                exact=key in exact,
                standout=key in clear,
                lent=not found and key in scores,
                pinned=hit.node_id in pinned,
            )
        )
    return sorted(explained, key=lambda why: (why.rank, why.node_id))
