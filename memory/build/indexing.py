"""What a node gains when it is embedded for retrieval, and how that is written.

`embed()` computes, for nodes with text, their vector, their importance and pin
(`memory.build.importance`, messages only) and, for messages, one vector per passage
(`memory.build.passages`), all in one embedder call. `write()` writes what nodes gain (a vector with
its importance, pin and passages, a parent, or both) in one UPDATE for the nodes and one INSERT
for the passages: the caller's transaction makes a message's vector and its passages appear
together. `memory.build.tree` decides when nodes are embedded and adopted; this module only
computes and writes.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import REAL, BigInteger, Boolean, bindparam, cast, func, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.build import importance, passages
from memory.db import FLOATS, AnyRow
from memory.embeddings import Embedder, Vector
from memory.schema import nodes
from memory.schema import passages as passages_table

__all__ = ["HAS_TEXT", "Embedded", "embed", "has_text", "write"]


# One statement writes whatever a node gains: a vector with its importance and pin, a parent,
# or both at once. A NULL parameter leaves its column as it is, and a node keeps a parent it
# already has (a racing build adopted it).
_WRITE_NODE = (
    update(nodes)
    .where(nodes.c.id == bindparam("node_id"))
    .values(
        embedding=func.coalesce(
            cast(bindparam("vector", type_=FLOATS), nodes.c.embedding.type), nodes.c.embedding
        ),
        importance=func.coalesce(bindparam("score", type_=REAL), nodes.c.importance),
        pinned=func.coalesce(bindparam("pin", type_=Boolean), nodes.c.pinned),
        parent_id=func.coalesce(nodes.c.parent_id, bindparam("parent", type_=BigInteger)),
    )
)

# A message's passages are written with its vector (a rebuilt node's are already there).
_WRITE_PASSAGE = (
    pg_insert(passages_table)
    .values(
        node_id=bindparam("node_id"),
        ordinal=bindparam("ordinal"),
        tenant_id=bindparam("tenant_id"),
        embedding=cast(bindparam("vector", type_=FLOATS), passages_table.c.embedding.type),
    )
    .on_conflict_do_nothing()
)


@dataclass(frozen=True)
class Embedded:
    """A node's new vector, importance, pin and passage vectors, not yet written."""

    vector: Vector
    score: float
    pin: bool
    passages: Sequence[Vector] = ()

    def params(self, node_id: int, parent: int | None = None) -> dict[str, Any]:
        return {
            "node_id": node_id,
            "vector": self.vector,
            "score": self.score,
            "pin": self.pin,
            "parent": parent,
        }


# Whitespace embeds as much as nothing does; such nodes keep no vector (and are not retried).
HAS_TEXT: Final = nodes.c.text.regexp_match(r"\S")
"""Whether a node has anything to embed, in SQL (`has_text` in Python)."""


def has_text(text: str) -> bool:
    """Whether a node has anything to embed (`HAS_TEXT` in SQL)."""
    return not text.isspace() and bool(text)


async def embed(
    embedder: Embedder, *, rows: Sequence[AnyRow], passages: bool
) -> dict[int, Embedded]:
    """What `rows` (nodes with text) gain, by node id; messages and, when `passages` is on,
    their passages are embedded in one call."""
    if not rows:
        return {}
    parts = [_passages(row) if passages else [] for row in rows]
    vectors = await embedder.embed(
        [row.text for row in rows] + [part for group in parts for part in group]
    )
    rest = iter(vectors[len(rows) :])
    embedded = {}
    for row, vector, group in zip(rows, vectors[: len(rows)], parts, strict=True):
        score = importance.score(row.role, row.text) if row.level == 0 else 0.0
        embedded[row.id] = Embedded(
            vector,
            score,
            row.level == 0 and importance.is_milestone(score),
            [next(rest) for _ in group],
        )
    return embedded


def _passages(row: AnyRow) -> list[str]:
    return passages.split(row.text) if row.level == 0 else []


async def write(
    conn: AsyncConnection,
    writes: Sequence[tuple[int, Embedded | None, int | None]],
    *,
    tenant_id: int,
) -> None:
    """Write what nodes gain, as (node id, new vector or None, new parent or None)."""
    if not writes:
        return
    await conn.execute(
        _WRITE_NODE,
        [
            item.params(node, parent)
            if item is not None
            else {"node_id": node, "vector": None, "score": None, "pin": None, "parent": parent}
            for node, item, parent in writes
        ],
    )
    rows = [
        {"node_id": node, "ordinal": ordinal, "tenant_id": tenant_id, "vector": vector}
        for node, item, _ in writes
        if item is not None
        for ordinal, vector in enumerate(item.passages)
    ]
    if rows:
        await conn.execute(_WRITE_PASSAGE, rows)
