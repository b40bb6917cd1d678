"""The summary tree read a piece at a time, as an operator browses it (`/admin`, `/ui`).

`tree_page` gives consecutive siblings: the nodes directly under one summary, or the roots (what
no summary covers yet), in time order, a page at a time, after or before a message. Siblings
cover disjoint runs of messages, so the first message a node covers orders and pages them; a
page costs the same at 10 or 100,000 messages, and nothing ever reads the tree whole.
`node_path` gives a node's place: the summaries above it, the root first, in one recursive query.

Every function is scoped by `tenant_id`: another tenant's node behaves as missing (`NotFound`).
"""

from dataclasses import dataclass

from sqlalchemy import exists, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.errors import InvalidInput, NotFound
from memory.schema import nodes
from memory.write import tree_nodes


async def node_path(
    conn: AsyncConnection, *, tenant_id: int, node_id: int
) -> list[tree_nodes.NodeRecord]:
    """The node and the summaries above it, the root first; `NotFound` for a node that does not
    exist for this tenant. One recursive query up the parent links, however deep the tree."""
    up = (
        select(nodes.c.id, nodes.c.parent_id, literal(0).label("depth"))
        .where(nodes.c.id == node_id, nodes.c.tenant_id == tenant_id)
        .cte("up", recursive=True)
    )
    up = up.union_all(
        select(nodes.c.id, nodes.c.parent_id, (up.c.depth + 1).label("depth")).where(
            nodes.c.id == up.c.parent_id, nodes.c.tenant_id == tenant_id
        )
    )
    rows = await conn.execute(
        tree_nodes.select_nodes().join(up, up.c.id == nodes.c.id).order_by(up.c.depth.desc())
    )
    path = [tree_nodes.node_record(row) for row in rows]
    if not path:
        raise NotFound(f"node {node_id} does not exist")
    return path


@dataclass(frozen=True)
class TreePage:
    """Consecutive siblings of the tree, in time order, and whether more lie on either side."""

    nodes: list[tree_nodes.NodeRecord]
    more_before: bool
    more_after: bool


async def tree_page(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    parent_id: int | None,
    after_span: int | None = None,
    before_span: int | None = None,
    limit: int = 50,
) -> TreePage:
    """Up to `limit` nodes directly under `parent_id` (None: the roots, what no summary covers
    yet), by the first message they cover: those starting after message `after_span`, else
    those just before message `before_span`, else the first ones.

    Siblings cover disjoint runs of messages, so the first message they cover orders them and
    pages them: one page costs one indexed read however large the conversation (its tree is
    never read whole)."""
    if not 1 <= limit <= 1000:
        raise InvalidInput("limit must be between 1 and 1000", param="limit")
    under = nodes.c.parent_id.is_(None) if parent_id is None else nodes.c.parent_id == parent_id
    siblings = [nodes.c.tenant_id == tenant_id, nodes.c.conversation_id == conversation_id, under]
    backwards = after_span is None and before_span is not None
    if backwards:
        edge = nodes.c.span_start < before_span
        beyond = nodes.c.span_start >= before_span
        order = nodes.c.span_start.desc()
    else:
        start = -1 if after_span is None else after_span
        edge = nodes.c.span_start > start
        beyond = nodes.c.span_start <= start
        order = nodes.c.span_start.asc()
    rows = (
        await conn.execute(
            tree_nodes.select_nodes().where(*siblings, edge).order_by(order).limit(limit + 1)
        )
    ).all()
    found = [tree_nodes.node_record(row) for row in rows[:limit]]
    more = len(rows) > limit
    behind = bool(await conn.scalar(select(exists().where(*siblings, beyond))))
    if backwards:
        return TreePage(nodes=found[::-1], more_before=more, more_after=behind)
    return TreePage(nodes=found, more_before=behind, more_after=more)
