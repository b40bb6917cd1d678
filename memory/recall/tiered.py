"""Tier-bounded search (`memory.tiers`): over a large scope, the hot and warm nodes first.

`warm_leg()` is what `memory.recall.retrieval.search` runs before its legs when the scope
holds more than `TIERED_SCOPE` messages and the query does not ask for old things
(`memory.recall.query.asks_for_old`): the scope's hot and warm nodes (those accessed within
`memory.tiers.WINDOW`, a few per cent of a long history), those holding one of the query's
identifiers first (`memory.recall.query.identifiers`: a ticket, a reference), then by cosine
similarity to the query, every distance computed (they are few). When one of them holds such an
identifier or is within `ENOUGH` of the query, they are the answer and the cold history is not
read; otherwise (`None`: they come up short) retrieval searches everything, cold included, as
it would without tiers. A tier therefore never hides a node: a question nothing warm answers
reaches the cold history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.embeddings import vector_literal
from memory.recall.fusion import Candidates, Place
from memory.recall.query import asks_for_old, identifiers

__all__ = ["ENOUGH", "TIERED_SCOPE", "warm_leg"]

TIERED_SCOPE: Final = 20_000
"""Messages in scope above which the hot and warm nodes are searched first."""
ENOUGH: Final = 0.5
"""Cosine similarity (all-MiniLM-L6-v2) at which a warm node answers the query."""

_WARM = text(
    """
SELECT n.conversation_id, n.level, n.seq, n.span_end, n.name, n.created_at,
       coalesce(n.text ILIKE ANY(CAST(:patterns AS text[])), false) AS exact,
       1 - (n.embedding <=> CAST(:vector AS vector)) AS similarity
FROM node_access a
JOIN nodes n ON n.id = a.node_id
WHERE a.tenant_id = :tenant_id AND a.conversation_id = ANY(:conversation_ids)
  AND a.tier <> 'cold' AND n.tenant_id = :tenant_id AND n.embedding IS NOT NULL
  AND (CAST(:abandoned AS boolean) OR n.superseded_at IS NULL)
  AND (n.level > 0 OR n.role IS NULL OR n.role NOT IN ('system', 'developer'))
  AND (CAST(:levels AS smallint[]) IS NULL OR n.level = ANY(CAST(:levels AS smallint[])))
ORDER BY exact DESC, (n.embedding <=> CAST(:vector AS vector)) + 0
LIMIT :limit
"""
)


async def warm_leg(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query: str,
    query_vector: Sequence[float],
    messages: int,
    pool: int,
    levels: Sequence[int] | None = None,
    tiered_from: int = TIERED_SCOPE,
    abandoned: bool = False,
) -> Candidates | None:
    """The scope's hot and warm nodes for the query (at most `pool`, those holding one of its
    identifiers first, then the nearest), or None when the scope (`messages`) holds no more
    than `tiered_from` messages, the query asks for old things, or none of them holds one of
    its identifiers or is within `ENOUGH` of it (see the module docstring). `abandoned`: messages
    off their conversation's current branch count too."""
    if messages <= tiered_from or asks_for_old(query):
        return None
    rows = await conn.execute(
        _WARM,
        {
            "tenant_id": tenant_id,
            "conversation_ids": list(conversation_ids),
            "vector": vector_literal(query_vector),
            "levels": list(levels) if levels is not None else None,
            "patterns": [f"%{_escaped(word)}%" for word in identifiers(query)],
            "limit": pool,
            "abandoned": abandoned,
        },
    )
    ranked = [
        Place(
            key=(conv, level, seq),
            span_end=span_end,
            name=name,
            exact=bool(exact),
            similarity=float(similarity),
            created_at=created_at,
        )
        for conv, level, seq, span_end, name, created_at, exact, similarity in rows
    ]
    if not any(place.exact or (place.similarity or 0.0) >= ENOUGH for place in ranked):
        return None
    return Candidates(ranked)


def _escaped(word: str) -> str:
    """`word` as a literal inside an ILIKE pattern."""
    return word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
