"""The vector legs of retrieval: the nodes nearest the query's vector, and their passages.

`vector_legs()` runs both in one statement over `memory.recall.legs.SCOPE`: the nearest
embedded nodes by cosine distance, and, when messages are searched, those messages ranked again
by the better of their own similarity and their best passage's (`memory.build.passages`). It
is exact for a small scope and scans the shared HNSW index iteratively for a large one (see its
docstring for what was measured); `memory.recall.retrieval` fuses the legs with full text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from sqlalchemy import TextClause, bindparam, text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.db import FLOATS
from memory.recall.fusion import Candidates, Place
from memory.recall.legs import ARRAYS, CANDIDATES, SCOPE, candidates_of, rows_of, scope_params
from memory.stages import staged

__all__ = ["EXACT_SCAN_MAX", "UNDERFOUND", "vector_legs"]

EXACT_SCAN_MAX: Final = 6000
"""Most messages in scope for which the vector leg computes every distance (see
`vector_legs`): a filtered scan of the HNSW index, shared by every tenant, once missed a
5,000-message conversation's clearly best match (similarity 0.48, the next 0.34) in a database
holding many near-duplicate vectors; the exact scan costs a few ms per thousand messages."""


UNDERFOUND: Final = 8
"""The HNSW scan of a scope of known size that returns fewer than a `1 / UNDERFOUND` share of
the rows asked for is run again exactly. Near-duplicate vectors (a conversation imported twice,
texts repeated across conversations) leave parts of the shared graph that a search does not
reach: in a database holding one 10,001-message conversation's texts three more times, the
filtered scan returned 0 of 400 rows for 6 of `bench.overhead`'s 8 questions, whatever its
`ef_search`, ordering, `max_scan_tuples` or memory, where the exact scan returned 400 (35-65
ms). A scan that stops at `hnsw.max_scan_tuples` in a database far larger than the scope still
returns a few dozen of its nearest rows and is kept."""


# The vector legs in one statement: the nearest embedded nodes, each message with the similarity
# of its best passage (`memory.build.passages`). Only those messages' passages are scored
# (hundreds of messages, a few passages each: a millisecond), so passages need no vector index
# of their own: an HNSW index on them took 45% of the background build's database time
# (`bench.throughput`). `{order}` is the distance (the HNSW index) or the distance `+ 0`, which
# keeps the planner off that index: the scope's rows are read through the (conversation_id,
# level, seq) index and every distance is computed (`vector_legs` says when).
_NEAREST = """
WITH q AS MATERIALIZED (SELECT CAST(CAST(:vector AS real[]) AS vector) AS v{settle}),
nearest AS MATERIALIZED (
    SELECT n.id, n.conversation_id, n.level, n.seq, n.span_end, n.name, n.created_at,
           1 - (n.embedding <=> (SELECT v FROM q)) AS similarity
    FROM nodes n
    WHERE {scope} AND n.embedding IS NOT NULL
    ORDER BY {order}
    LIMIT :limit
)
SELECT {arrays},
       array_agg((SELECT max(1 - (p.embedding <=> (SELECT v FROM q))) FROM passages p
                  WHERE m.level = 0 AND p.node_id = m.id AND p.tenant_id = :tenant_id))
FROM (SELECT *, false AS exact FROM nearest) AS m
"""
# Before an index scan: iterative, `ef_search` from the limit, and sorting off while it is
# planned (see `vector_legs`). `_VECTOR` turns sorting back on once it runs, planned by then:
# the transaction's later statements are planned as usual without another round trip.
_INDEX_SETTINGS = text(
    "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true), "
    "set_config('hnsw.ef_search', :ef, true), set_config('enable_sort', 'off', true)"
)


def _nearest(*, order: str, settle: str) -> TextClause:
    return text(
        _NEAREST.format(scope=SCOPE, order=order, settle=settle, arrays=ARRAYS.format(order=""))
    ).bindparams(bindparam("vector", type_=FLOATS))


_VECTOR = _nearest(
    order="n.embedding <=> (SELECT v FROM q)",
    settle=", set_config('enable_sort', 'on', true) AS sorting",
)
# Equally near nodes (a text said again) are taken and ranked newest first (`_nearest_first`),
# so that a search finds the same whatever connection, plan or heap order read them.
_VECTOR_EXACT = _nearest(
    order="(n.embedding <=> (SELECT v FROM q)) + 0, n.seq DESC, n.conversation_id, n.level",
    settle="",
)


def _similarity(place: Place) -> float:
    return place.similarity or 0.0


def _nearest_first(place: Place) -> tuple[float, int, tuple[int, int, int]]:
    return (-_similarity(place), -place.key[2], place.key)


@staged("vector")
async def vector_legs(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query_vector: Sequence[float],
    limit: int = CANDIDATES,
    levels: Sequence[int] | None = None,
    exclude_from: tuple[int, int] | None = None,
    messages: int | None = None,
    abandoned: bool = False,
) -> list[Candidates]:
    """The legs that need the query's vector, in one statement (`_NEAREST`):

    * the vector leg: embedded nodes by cosine distance to `query_vector`, nearest first;
    * when messages are searched, the passage leg: the vector leg's messages ranked again by
      the better of their own similarity and their best passage's (left out when none has
      passages: it would only repeat the vector leg).

    A small scope (`messages`, the searched conversations' message count, at most
    `EXACT_SCAN_MAX`; unknown: one conversation) is scanned exactly: its rows come from the
    conversation's index and every distance is computed, where the HNSW index, shared by every
    tenant, is approximate. Larger scopes use the HNSW index, scanned iteratively (pgvector
    ≥ 0.8: `relaxed_order`, `ef_search` twice the limit) so that the tenant and conversation
    filter still leaves `limit` rows when enough exist; `hnsw.max_scan_tuples` (20,000 by
    default) bounds what one scan visits whatever the database holds. An index scan that finds
    almost none of a scope of known size (`UNDERFOUND`) is run again exactly.

    Measured (2026-11-24, one database holding conversations of 1,000 and 10,000 messages of
    both `bench.overhead` texts, ~22,000 embedded nodes; buffers are load-independent, times
    were taken at load average 12-16 on 2 cores): at 10,000 messages and limit 400 the exact
    scan read 4,400 buffers (short messages) to 47,600 (varied ones, whose vectors are stored
    out of line) in 58-138 ms of server time; the index 5,800-6,400 buffers in 25-32 ms, its
    400 rows 99.3-99.8% of the exact scan's (the first 100: 99.9-100%). At limit 100 (the memory
    tools') the index read 1,600-1,900 buffers in 1.5-5 ms against 3,800-47,100 and 52-123 ms.
    A lower `ef_search` saved a fifth of the buffers and lost a point of overlap. Below
    `EXACT_SCAN_MAX` the exact scan is kept: a small conversation's rows are a small share of
    a shared index, and the filtered index scan then visits many times more tuples (a
    1,000-message conversation's 400 nearest: 31,000 buffers by the index, 5,400 exact)."""
    if not conversation_ids:
        return [Candidates([])]
    params = {
        **scope_params(
            tenant_id=tenant_id,
            conversation_ids=conversation_ids,
            levels=levels,
            exclude_from=exclude_from,
            abandoned=abandoned,
        ),
        "vector": [float(x) for x in query_vector],
        "limit": limit,
    }
    if (messages is None and len(conversation_ids) == 1) or (
        messages is not None and messages <= EXACT_SCAN_MAX
    ):
        rows = rows_of(await conn.execute(_VECTOR_EXACT, params))
    else:
        # Without `enable_sort = off` the planner, misjudging how many rows the filter keeps,
        # prefers reading the whole conversation and sorting: the exact scan this path avoids.
        await conn.execute(_INDEX_SETTINGS, {"ef": str(max(40, min(1000, 2 * limit)))})
        rows = rows_of(await conn.execute(_VECTOR, params))
        if len(rows) < limit // UNDERFOUND and messages is not None and messages > len(rows):
            # The graph did not reach the scope's messages (see `UNDERFOUND`): every distance.
            rows = rows_of(await conn.execute(_VECTOR_EXACT, params))
    # A relaxed-order scan returns its rows only nearly sorted; fusion goes by rank.
    whole = candidates_of(rows)
    whole.ranked.sort(key=_nearest_first)
    if levels is not None and 0 not in levels:
        return [whole]
    passage = {(row[0], row[1], row[2]): row[8] for row in rows if row[8] is not None}
    if not passage:
        return [whole, Candidates([])]
    # Made whole rather than by `dataclasses.replace`: 400 of them per turn took a millisecond.
    parts = [
        Place(
            key,
            place.span_end,
            place.name,
            place.exact,
            max(_similarity(place), passage.get(key, -1.0)),
            place.created_at,
        )
        for place in whole.ranked
        if (key := place.key)[1] == 0
    ]
    parts.sort(key=_nearest_first)
    return [whole, Candidates(parts)]
