"""Graph recall: the concept graph (`memory.build.graph`) walked for relational questions.

* **Seeds** (`seeds`): the concepts of the searched conversations' scopes
  (`memory.concepts.scope_key`) that the query names (a key among the query's n-grams,
  `memory.concepts.query_keys`: weight 1) or means (the `SEED_VECTORS` nearest by cosine to
  the query's vector at `SEED_SIMILARITY` or more: weight = similarity).
* **Walk** (`walk`): breadth first from the seeds over `co_occurs` and `precedes` edges, both
  ways, at most `DEPTH` steps, each concept following its `FANOUT` heaviest edges; one
  recursive CTE that carries the path it took, so no concept is visited twice on one path
  (cycles end there). A concept reached scores its seed's weight times `DECAY` per step times
  the edge's strength (`w / (w + 1)`); reached several ways, it keeps its best.
* **The leg** (`candidates`): the nodes of the searched conversations that mention the
  concepts reached (each concept's `MENTIONS` most mentioning), a node scoring the sum over
  its concepts of score x mentions x specificity (`1 / √frequency`: a concept found in every
  segment, such as a participant's name, tells little), best first, as one more leg of fusion
  (`memory.recall.fusion`), the route then `graph`. An empty graph (no seed) gives no leg:
  retrieval falls back to the flat legs (the route stays `relational`).
* **`related`** (the `memory_related` tool): one concept by name, its neighbours (schematic
  ones first) and the messages that mention them.
* **The admin API**: `conversation_graph` (the concepts one conversation mentions, the edges
  between them, its scope's version) and `find_concepts` (the tenant's concepts by name).

Everything reads within one tenant: a concept of another tenant or scope behaves as missing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.concepts import SCHEMATIC, concept_key, query_keys
from memory.embeddings import vector_literal
from memory.recall.fusion import Candidates, Place
from memory.recall.query import Route

__all__ = [
    "DEPTH",
    "FANOUT",
    "ConceptRecord",
    "ConversationGraph",
    "EdgeRecord",
    "Neighbour",
    "Related",
    "candidates",
    "conversation_graph",
    "find_concepts",
    "leg",
    "related",
    "scopes",
    "seeds",
    "walk",
]

DEPTH: Final = 2
"""Most steps of a walk from a seed."""
FANOUT: Final = 8
"""Edges a concept is followed by, heaviest first."""
DECAY: Final = 0.5
"""A concept one step further weighs this much less."""
SEED_VECTORS: Final = 5
SEED_SIMILARITY: Final = 0.5
"""Cosine similarity (all-MiniLM-L6-v2) of a concept's name to the query that seeds a walk."""
MENTIONS: Final = 64
"""Nodes read per concept reached, most mentioning first."""

_SCOPES = text(
    """
SELECT DISTINCT CASE WHEN user_id IS NULL THEN 'conversation:' || id ELSE 'user:' || user_id END
FROM conversations WHERE tenant_id = :tenant_id AND id = ANY(:ids)
"""
)
_BY_NAME = text(
    """
SELECT id, 1.0 FROM concepts
WHERE tenant_id = :tenant_id AND scope = ANY(:scopes) AND key = ANY(:keys)
"""
)
_BY_VECTOR = text(
    """
SELECT id, similarity FROM (
    SELECT id, 1 - (embedding <=> CAST(:vector AS vector)) AS similarity FROM concepts
    WHERE tenant_id = :tenant_id AND scope = ANY(:scopes) AND embedding IS NOT NULL
    ORDER BY embedding <=> CAST(:vector AS vector) LIMIT :limit
) nearest WHERE similarity >= :floor
"""
)
# The walk. `path` holds the concepts on the way, so a cycle ends where it would close; the
# seeds' own ids are never re-entered either. Edges are read both ways through their two
# indexes (source: the primary key; target: ix_concept_edges_target).
_WALK = text(
    """
WITH RECURSIVE walk(id, depth, score, path) AS (
    SELECT c.id, 0, s.weight, ARRAY[c.id]
    FROM unnest(CAST(:ids AS bigint[]), CAST(:weights AS float8[])) AS s(id, weight)
    JOIN concepts c ON c.id = s.id AND c.tenant_id = :tenant_id
    UNION ALL
    SELECT e.other, w.depth + 1, w.score * :decay * e.weight / (e.weight + 1.0), w.path || e.other
    FROM walk w
    CROSS JOIN LATERAL (
        SELECT other, weight FROM (
            SELECT target_id AS other, weight FROM concept_edges
            WHERE source_id = w.id AND tenant_id = :tenant_id
            UNION ALL
            SELECT source_id, weight FROM concept_edges
            WHERE target_id = w.id AND tenant_id = :tenant_id
        ) both_ways
        ORDER BY weight DESC, other LIMIT :fanout
    ) e
    WHERE w.depth < :depth AND e.other <> ALL(w.path) AND e.other <> ALL(CAST(:ids AS bigint[]))
)
SELECT id, min(depth), max(score) FROM walk GROUP BY id
"""
)
_MENTIONED = text(
    """
SELECT n.conversation_id, n.level, n.seq, n.span_end, n.name, n.created_at, false AS exact,
       NULL::float AS similarity, sum(r.score * m.weight / sqrt(greatest(c.frequency, 1))) AS score
FROM unnest(CAST(:ids AS bigint[]), CAST(:scores AS float8[])) AS r(id, score)
JOIN concepts c ON c.id = r.id AND c.tenant_id = :tenant_id
CROSS JOIN LATERAL (
    SELECT node_id, weight FROM concept_mentions
    WHERE concept_id = r.id AND tenant_id = :tenant_id AND conversation_id = ANY(:conversation_ids)
    ORDER BY weight DESC, node_id DESC LIMIT :mentions
) m
JOIN nodes n ON n.id = m.node_id
WHERE n.tenant_id = :tenant_id
  AND (n.level > 0 OR n.role IS NULL OR n.role NOT IN ('system', 'developer'))
  AND (CAST(:abandoned AS boolean) OR n.superseded_at IS NULL)
  AND (CAST(:levels AS smallint[]) IS NULL OR n.level = ANY(CAST(:levels AS smallint[])))
  AND (CAST(:exclude_conversation AS bigint) IS NULL
       OR n.conversation_id <> CAST(:exclude_conversation AS bigint)
       OR n.span_start < CAST(:exclude_from AS integer))
GROUP BY n.id
ORDER BY score DESC, n.id DESC
LIMIT :limit
"""
)


async def scopes(
    conn: AsyncConnection, *, tenant_id: int, conversation_ids: Sequence[int]
) -> list[str]:
    """The concept scopes of the tenant's conversations among `conversation_ids`."""
    rows = await conn.scalars(_SCOPES, {"tenant_id": tenant_id, "ids": list(conversation_ids)})
    return [str(scope) for scope in rows]


async def seeds(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    scope_keys: Sequence[str],
    query: str,
    vector: Sequence[float] | None,
) -> dict[int, float]:
    """The concepts the query names or means, with their weights (see the module docstring)."""
    found: dict[int, float] = {}
    if not scope_keys:
        return found
    keys = query_keys(query)
    if keys:
        rows = await conn.execute(
            _BY_NAME, {"tenant_id": tenant_id, "scopes": list(scope_keys), "keys": keys}
        )
        found.update({int(concept): float(weight) for concept, weight in rows})
    if vector is not None:
        rows = await conn.execute(
            _BY_VECTOR,
            {
                "tenant_id": tenant_id,
                "scopes": list(scope_keys),
                "vector": vector_literal(vector),
                "limit": SEED_VECTORS,
                "floor": SEED_SIMILARITY,
            },
        )
        for concept, similarity in rows:
            found[int(concept)] = max(found.get(int(concept), 0.0), float(similarity))
    return found


async def walk(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    start: dict[int, float],
    depth: int = DEPTH,
    fanout: int = FANOUT,
) -> dict[int, tuple[int, float]]:
    """The concepts reached from `start` (concept → weight), each with its fewest steps and
    best score; the seeds themselves at depth 0."""
    if not start:
        return {}
    rows = await conn.execute(
        _WALK,
        {
            "tenant_id": tenant_id,
            "ids": list(start),
            "weights": list(start.values()),
            "decay": DECAY,
            "depth": depth,
            "fanout": fanout,
        },
    )
    return {int(concept): (int(steps), float(score)) for concept, steps, score in rows}


async def candidates(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query: str,
    query_vector: Sequence[float] | None,
    limit: int,
    levels: Sequence[int] | None = None,
    exclude_from: tuple[int, int] | None = None,
    abandoned: bool = False,
) -> Candidates:
    """The graph leg: the nodes that mention the concepts a walk from the query's reaches,
    best first; empty when the graph holds none of the query's concepts."""
    scope_keys = await scopes(conn, tenant_id=tenant_id, conversation_ids=conversation_ids)
    start = await seeds(
        conn, tenant_id=tenant_id, scope_keys=scope_keys, query=query, vector=query_vector
    )
    reached = await walk(conn, tenant_id=tenant_id, start=start)
    if not reached:
        return Candidates([])
    rows = await conn.execute(
        _MENTIONED,
        {
            "tenant_id": tenant_id,
            "ids": list(reached),
            "scores": [score for _, score in reached.values()],
            "conversation_ids": list(conversation_ids),
            "mentions": MENTIONS,
            "levels": list(levels) if levels is not None else None,
            "exclude_conversation": exclude_from[0] if exclude_from else None,
            "exclude_from": exclude_from[1] if exclude_from else None,
            "limit": limit,
            "abandoned": abandoned,
        },
    )
    return Candidates(
        [
            Place(key=(conv, level, seq), span_end=span_end, name=name, created_at=created_at)
            for conv, level, seq, span_end, name, created_at, *_ in rows
        ]
    )


async def leg(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query: str,
    query_vector: Sequence[float] | None,
    which: Route,
    limit: int,
    levels: Sequence[int] | None = None,
    exclude_from: tuple[int, int] | None = None,
    abandoned: bool = False,
) -> tuple[list[Candidates], Route]:
    """The graph leg (none unless the query is relational) and the route retrieval takes: the
    graph route when the graph knows some of the query's concepts; else the relational one,
    without a graph leg (flat retrieval, its summaries raised)."""
    if which is not Route.RELATIONAL or not conversation_ids:
        return [], which
    found = await candidates(
        conn,
        tenant_id=tenant_id,
        conversation_ids=conversation_ids,
        query=query,
        query_vector=query_vector,
        limit=limit,
        levels=levels,
        exclude_from=exclude_from,
        abandoned=abandoned,
    )
    if not found.ranked:
        return [], which
    return [found], Route.GRAPH


# -- the memory_related tool ------------------------------------------------------------------


@dataclass(frozen=True)
class Neighbour:
    """A concept reached from the one asked about."""

    id: int
    name: str
    frequency: int
    depth: int
    score: float

    @property
    def schematic(self) -> bool:
        return self.frequency >= SCHEMATIC


@dataclass(frozen=True)
class Related:
    """The concept asked about (None: the graph has none by that name or meaning), its
    neighbours (schematic first, then by score) and the node ids that mention them."""

    concept: Neighbour | None
    neighbours: list[Neighbour]
    mentions: list[int]


_CONCEPTS = text(
    "SELECT id, name, frequency FROM concepts WHERE tenant_id = :tenant_id AND id = ANY(:ids)"
)


async def related(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    concept: str,
    vector: Sequence[float] | None,
    limit: int,
) -> Related:
    """`concept` (by key, else the nearest by meaning) among the conversations' scopes, the
    concepts a walk from it reaches and the nodes of the conversations that mention them."""
    scope_keys = await scopes(conn, tenant_id=tenant_id, conversation_ids=conversation_ids)
    start: dict[int, float] = {}
    key = concept_key(concept)
    if scope_keys and key:
        rows = await conn.execute(
            _BY_NAME, {"tenant_id": tenant_id, "scopes": scope_keys, "keys": [key]}
        )
        start = {int(found): 1.0 for found, _ in rows}
    if not start and vector is not None and scope_keys:
        rows = await conn.execute(
            _BY_VECTOR,
            {
                "tenant_id": tenant_id,
                "scopes": scope_keys,
                "vector": vector_literal(vector),
                "limit": 1,
                "floor": SEED_SIMILARITY,
            },
        )
        start = {int(found): 1.0 for found, _ in rows}
    if not start:
        return Related(concept=None, neighbours=[], mentions=[])
    reached = await walk(conn, tenant_id=tenant_id, start=start)
    described = await _describe(conn, tenant_id=tenant_id, reached=reached)
    seed = next(item for item in described if item.id in start)
    neighbours = sorted(
        (item for item in described if item.id not in start),
        key=lambda item: (not item.schematic, -item.score, item.name),
    )[:limit]
    found = await candidates_for(
        conn,
        tenant_id=tenant_id,
        conversation_ids=conversation_ids,
        reached={item.id: item.score for item in [seed, *neighbours]},
        limit=limit,
    )
    return Related(concept=seed, neighbours=neighbours, mentions=found)


async def candidates_for(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    reached: dict[int, float],
    limit: int,
) -> list[int]:
    """Ids of the messages of the conversations that mention the `reached` concepts most."""
    rows = await conn.execute(
        text(
            """
SELECT m.node_id FROM unnest(CAST(:ids AS bigint[]), CAST(:scores AS float8[])) AS r(id, score)
JOIN concept_mentions m ON m.concept_id = r.id
JOIN nodes n ON n.id = m.node_id AND n.level = 0
WHERE m.tenant_id = :tenant_id AND m.conversation_id = ANY(:conversation_ids)
  AND n.tenant_id = :tenant_id
GROUP BY m.node_id ORDER BY sum(r.score * m.weight) DESC, m.node_id LIMIT :limit
"""
        ),
        {
            "tenant_id": tenant_id,
            "ids": list(reached),
            "scores": list(reached.values()),
            "conversation_ids": list(conversation_ids),
            "limit": limit,
        },
    )
    return [int(node) for node in rows.scalars()]


async def _describe(
    conn: AsyncConnection, *, tenant_id: int, reached: dict[int, tuple[int, float]]
) -> list[Neighbour]:
    rows = await conn.execute(_CONCEPTS, {"tenant_id": tenant_id, "ids": list(reached)})
    return [
        Neighbour(
            id=int(concept),
            name=str(name),
            frequency=int(frequency),
            depth=reached[int(concept)][0],
            score=reached[int(concept)][1],
        )
        for concept, name, frequency in rows
    ]


# -- the admin API ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConceptRecord:
    """A concept as the admin API shows it."""

    id: int
    name: str
    scope: str
    frequency: int
    mentions: int = 0

    @property
    def schematic(self) -> bool:
        return self.frequency >= SCHEMATIC


@dataclass(frozen=True)
class EdgeRecord:
    source: int
    target: int
    kind: str
    weight: int


@dataclass(frozen=True)
class ConversationGraph:
    """The concepts a conversation mentions (most frequent first), the edges between them
    and the version of their scope's graph."""

    scope: str
    version: int
    concepts: list[ConceptRecord]
    edges: list[EdgeRecord]


_MENTIONED_IN = text(
    """
SELECT c.id, c.name, c.scope, c.frequency, count(*) AS mentions
FROM concept_mentions m JOIN concepts c ON c.id = m.concept_id AND c.tenant_id = :tenant_id
WHERE m.tenant_id = :tenant_id AND m.conversation_id = :conversation_id
GROUP BY c.id ORDER BY c.frequency DESC, mentions DESC, c.id LIMIT :limit
"""
)
_EDGES_AMONG = text(
    """
SELECT source_id, target_id, kind, weight FROM concept_edges
WHERE tenant_id = :tenant_id AND source_id = ANY(:ids) AND target_id = ANY(:ids)
ORDER BY weight DESC, source_id, target_id, kind
"""
)
_FIND = text(
    """
SELECT id, name, scope, frequency FROM concepts
WHERE tenant_id = :tenant_id AND position(:q IN key) > 0
ORDER BY frequency DESC, id LIMIT :limit
"""
)


async def conversation_graph(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, limit: int
) -> ConversationGraph:
    """The graph of one conversation of the tenant (see `ConversationGraph`), at most `limit`
    concepts."""
    [scope] = await scopes(conn, tenant_id=tenant_id, conversation_ids=[conversation_id])
    version = await conn.scalar(
        text("SELECT version FROM concept_graphs WHERE tenant_id = :t AND scope = :s"),
        {"t": tenant_id, "s": scope},
    )
    rows = await conn.execute(
        _MENTIONED_IN, {"tenant_id": tenant_id, "conversation_id": conversation_id, "limit": limit}
    )
    found = [ConceptRecord(*row) for row in rows]
    edges = await conn.execute(
        _EDGES_AMONG, {"tenant_id": tenant_id, "ids": [concept.id for concept in found]}
    )
    return ConversationGraph(
        scope=scope,
        version=int(version or 0),
        concepts=found,
        edges=[EdgeRecord(*row) for row in edges],
    )


async def find_concepts(
    conn: AsyncConnection, *, tenant_id: int, query: str, limit: int
) -> list[ConceptRecord]:
    """The tenant's concepts whose key holds the query's key, most frequent first."""
    key = concept_key(query)
    if not key:
        return []
    rows = await conn.execute(_FIND, {"tenant_id": tenant_id, "q": key, "limit": limit})
    return [ConceptRecord(*row) for row in rows]
