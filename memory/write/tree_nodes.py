"""Nodes of the summary tree as readers see them: a node whole (`NodeRecord`, with its
children's ids and whether it has a vector), one node, a conversation's nodes from a level up,
and how many nodes each level holds.

Every function takes the connection and keyword-only arguments, and is scoped by `tenant_id`:
a node of another tenant behaves as missing (`NotFound`).
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.db import AnyRow
from memory.errors import NotFound
from memory.schema import nodes


@dataclass(frozen=True)
class NodeRecord:
    """One node of the hierarchy: a message (level 0) or a summary."""

    id: int
    conversation_id: int
    level: int
    seq: int
    span_start: int
    span_end: int
    parent_id: int | None
    children: list[int]
    role: str | None
    text: str
    content: Any
    name: str | None
    tool_calls: list[dict[str, Any]] | None
    tool_call_id: str | None
    # Messages: the message it follows where a branch starts, and when it left the branch.
    follows_seq: int | None
    superseded_at: datetime | None
    system_prompt: bool
    """A message that replaced the conversation's system prompt: never a turn of the history."""
    facts: dict[str, list[str]] | None
    method: str | None
    model: str | None
    token_count: int
    importance: float
    pinned: bool
    status: str
    embedded: bool
    created_at: datetime
    meta: dict[str, Any]


async def level_counts(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int
) -> dict[int, int]:
    """How many nodes each level of the conversation holds."""
    rows = await conn.execute(
        select(nodes.c.level, func.count())
        .where(nodes.c.tenant_id == tenant_id, nodes.c.conversation_id == conversation_id)
        .group_by(nodes.c.level)
        .order_by(nodes.c.level)
    )
    return {int(level): int(count) for level, count in rows}


async def list_nodes(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    min_level: int = 1,
    max_level: int | None = None,
) -> list[NodeRecord]:
    """The conversation's nodes from `min_level` up (summaries by default), with children."""
    query = select_nodes().where(
        nodes.c.tenant_id == tenant_id,
        nodes.c.conversation_id == conversation_id,
        nodes.c.level >= min_level,
    )
    if max_level is not None:
        query = query.where(nodes.c.level <= max_level)
    rows = await conn.execute(query.order_by(nodes.c.level.desc(), nodes.c.seq))
    return [node_record(row) for row in rows]


async def get_node(conn: AsyncConnection, *, tenant_id: int, node_id: int) -> NodeRecord:
    """One node of this tenant, or `NotFound` (also for another tenant's node)."""
    row = (
        await conn.execute(
            select_nodes().where(nodes.c.id == node_id, nodes.c.tenant_id == tenant_id)
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"node {node_id} does not exist")
    return node_record(row)


def select_nodes() -> Select[Any]:
    """A select of whole nodes as `node_record` reads them: with their children's ids, in
    order, and whether they have a vector."""
    child = nodes.alias("child")
    children = (
        select(func.array_agg(aggregate_order_by(child.c.id, child.c.seq)))
        .where(child.c.parent_id == nodes.c.id)
        .scalar_subquery()
        .label("children")
    )
    return select(nodes, children, nodes.c.embedding.is_not(None).label("embedded"))


def node_record(row: AnyRow) -> NodeRecord:
    return NodeRecord(
        id=row.id,
        conversation_id=row.conversation_id,
        level=row.level,
        seq=row.seq,
        span_start=row.span_start,
        span_end=row.span_end,
        parent_id=row.parent_id,
        children=list(row.children or []),
        role=row.role,
        text=row.text,
        content=row.content,
        name=row.name,
        tool_calls=row.tool_calls,
        tool_call_id=row.tool_call_id,
        follows_seq=row.follows_seq,
        superseded_at=row.superseded_at,
        system_prompt=row.system_prompt,
        facts=row.facts,
        method=row.method,
        model=row.model,
        token_count=row.token_count,
        importance=row.importance,
        pinned=row.pinned,
        status=row.status,
        embedded=row.embedded,
        created_at=row.created_at,
        meta=row.meta,
    )
