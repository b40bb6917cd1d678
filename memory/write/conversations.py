"""Conversations as an operator sees them: listing, statistics, export, deletion (the
per-request counters those statistics come from are kept by `store.append` with each reply).

Every function is scoped by `tenant_id`: a conversation of another tenant behaves as missing
(`NotFound`). Listing pages by conversation id, newest first, with the last id of a page as the
cursor of the next, so pages stay stable while conversations keep receiving messages.
`delete_conversation` removes the conversation row under its lock; its messages, summaries,
embeddings and jobs go with it by the schema's cascades, and a job of that conversation still
running fails on its next write (the foreign key is gone) instead of bringing rows back.
"""

from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, delete, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory.db import AnyRow, transaction
from memory.errors import InvalidInput, NotFound
from memory.schema import conversations, jobs, nodes, working_contexts
from memory.write import store


@dataclass(frozen=True)
class ConversationSummary:
    """One conversation in a listing."""

    id: int
    external_id: str
    user: str | None
    messages: int
    token_count: int
    requests: int
    tokens_sent: int
    tokens_full: int
    tokens_reused: int
    usage_prompt_tokens: int
    usage_cached_tokens: int
    usage_completion_tokens: int
    # Turns whose working context was compacted (0 while it fits its budget).
    compactions: int
    created_at: datetime
    updated_at: datetime

    @property
    def memory_reuse(self) -> float | None:
        """The share of the prompt tokens sent that repeated the previous prompt's prefix."""
        return None if self.tokens_sent == 0 else self.tokens_reused / self.tokens_sent


@dataclass(frozen=True)
class ConversationPage:
    """One page of a listing; `next_before` is the cursor of the next page, if any."""

    items: list[ConversationSummary]
    next_before: int | None


@dataclass(frozen=True)
class ConversationStats:
    """What a conversation holds and what it cost."""

    conversation: ConversationSummary
    # Nodes and their tokens per level (0: messages).
    levels: dict[int, int]
    level_tokens: dict[int, int]
    # Jobs of the conversation not yet done, by status.
    pending_jobs: dict[str, int]
    # Its working context (None while it fits its budget): version, compactions, where the
    # verbatim turns start, stable-memory messages, kept notes and tokens.
    working_context: dict[str, int] | None = None

    @property
    def compression_ratio(self) -> float | None:
        """Tokens the whole histories would have cost per token actually sent (None before
        the first answered request)."""
        sent = self.conversation.tokens_sent
        return None if sent == 0 else self.conversation.tokens_full / sent


@dataclass(frozen=True)
class Deleted:
    """What deleting a conversation removed."""

    messages: int
    summaries: int
    jobs: int


_SUMMARY_COLUMNS = (
    conversations.c.id,
    conversations.c.external_id,
    conversations.c.user_id.label("user"),
    conversations.c.next_seq.label("messages"),
    conversations.c.token_count,
    conversations.c.requests,
    conversations.c.tokens_sent,
    conversations.c.tokens_full,
    conversations.c.tokens_reused,
    conversations.c.usage_prompt_tokens,
    conversations.c.usage_cached_tokens,
    conversations.c.usage_completion_tokens,
    func.coalesce(
        select(working_contexts.c.compactions)
        .where(working_contexts.c.conversation_id == conversations.c.id)
        .scalar_subquery(),
        0,
    ).label("compactions"),
    conversations.c.created_at,
    conversations.c.updated_at,
)


def _summary(row: AnyRow) -> ConversationSummary:
    return ConversationSummary(**row._mapping)


async def list_conversations(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    limit: int = 50,
    before: int | None = None,
    user: str | None = None,
    prefix: str | None = None,
    updated_after: datetime | None = None,
    updated_before: datetime | None = None,
) -> ConversationPage:
    """The tenant's conversations, newest first, `limit` at a time, from before id `before`;
    filtered by `user`, an `external_id` prefix, and last activity."""
    if not 1 <= limit <= 1000:
        raise InvalidInput("limit must be between 1 and 1000", param="limit")
    where: list[ColumnElement[bool]] = [conversations.c.tenant_id == tenant_id]
    if before is not None:
        where.append(conversations.c.id < before)
    if user is not None:
        where.append(conversations.c.user_id == user)
    if prefix:
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        where.append(conversations.c.external_id.like(f"{escaped}%", escape="\\"))
    if updated_after is not None:
        where.append(conversations.c.updated_at >= updated_after)
    if updated_before is not None:
        where.append(conversations.c.updated_at < updated_before)
    rows = (
        await conn.execute(
            select(*_SUMMARY_COLUMNS)
            .where(*where)
            .order_by(conversations.c.id.desc())
            .limit(limit + 1)
        )
    ).all()
    items = [_summary(row) for row in rows[:limit]]
    return ConversationPage(
        items=items, next_before=items[-1].id if len(rows) > limit and items else None
    )


async def recent(
    conn: AsyncConnection, *, tenant_id: int, external_id: str | None = None, limit: int
) -> dict[int, str]:
    """The tenant's `limit` most recently active conversations (or the one named), external id
    by id: the scope of a tenant-wide search."""
    query = select(conversations.c.id, conversations.c.external_id).where(
        conversations.c.tenant_id == tenant_id
    )
    if external_id is not None:
        query = query.where(conversations.c.external_id == external_id)
    rows = await conn.execute(query.order_by(conversations.c.updated_at.desc()).limit(limit))
    return {int(row.id): str(row.external_id) for row in rows}


async def external_ids(
    conn: AsyncConnection, *, tenant_id: int, ids: Collection[int]
) -> dict[int, str]:
    """The external ids of the tenant's conversations among `ids` (others are left out)."""
    if not ids:
        return {}
    rows = await conn.execute(
        select(conversations.c.id, conversations.c.external_id).where(
            conversations.c.tenant_id == tenant_id, conversations.c.id.in_(list(ids))
        )
    )
    return {int(row.id): str(row.external_id) for row in rows}


async def get_conversation(
    conn: AsyncConnection, *, tenant_id: int, external_id: str
) -> ConversationSummary:
    """The conversation `external_id` of this tenant, or `NotFound`."""
    row = (
        await conn.execute(
            select(*_SUMMARY_COLUMNS).where(
                conversations.c.tenant_id == tenant_id,
                conversations.c.external_id == external_id,
            )
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"conversation {external_id!r} does not exist")
    return _summary(row)


async def stats(conn: AsyncConnection, *, tenant_id: int, external_id: str) -> ConversationStats:
    """Counts, tokens per level, request counters and pending jobs of one conversation."""
    summary = await get_conversation(conn, tenant_id=tenant_id, external_id=external_id)
    levels: dict[int, int] = {}
    level_tokens: dict[int, int] = {}
    rows = await conn.execute(
        select(nodes.c.level, func.count(), func.coalesce(func.sum(nodes.c.token_count), 0))
        .where(nodes.c.tenant_id == tenant_id, nodes.c.conversation_id == summary.id)
        .group_by(nodes.c.level)
        .order_by(nodes.c.level)
    )
    for level, count, token_sum in rows:
        levels[int(level)] = int(count)
        level_tokens[int(level)] = int(token_sum)
    pending = await pending_jobs(conn, tenant_id=tenant_id, ids=[summary.id])
    context = (
        await conn.execute(
            select(
                working_contexts.c.version,
                working_contexts.c.compactions,
                working_contexts.c.verbatim_from,
                func.jsonb_array_length(working_contexts.c.stable).label("stable_messages"),
                func.jsonb_array_length(working_contexts.c.notes).label("notes"),
                working_contexts.c.tokens,
            ).where(working_contexts.c.conversation_id == summary.id)
        )
    ).one_or_none()
    return ConversationStats(
        conversation=summary,
        levels=levels,
        level_tokens=level_tokens,
        pending_jobs=pending.get(summary.id, {}),
        working_context=dict(context._mapping) if context is not None else None,
    )


async def pending_jobs(
    conn: AsyncConnection, *, tenant_id: int, ids: Collection[int]
) -> dict[int, dict[str, int]]:
    """The jobs not done yet of each of the conversations `ids`, by status (one query for a
    page of a listing; a conversation with none is left out)."""
    if not ids:
        return {}
    rows = await conn.execute(
        select(jobs.c.conversation_id, jobs.c.status, func.count())
        .where(
            jobs.c.tenant_id == tenant_id,
            jobs.c.conversation_id.in_(list(ids)),
            jobs.c.status.in_(["queued", "running", "dead"]),
        )
        .group_by(jobs.c.conversation_id, jobs.c.status)
    )
    found: dict[int, dict[str, int]] = {}
    for conversation_id, status, count in rows:
        found.setdefault(int(conversation_id), {})[str(status)] = int(count)
    return found


async def export_messages(
    engine: AsyncEngine, *, tenant_id: int, external_id: str, batch: int = 500
) -> AsyncIterator[dict[str, Any]]:
    """Every message of the conversation's current branch in order, in OpenAI's format with its
    `created_at` (the bulk import's format: what it re-imports is a history, so abandoned
    branches are left out), read `batch` at a time; a system prompt that replaced the
    conversation's (no turn of the history) says so, `"system_prompt": true`, which
    `memstrata import` reads back. `NotFound` is raised before the first message if the
    conversation does not exist."""
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=external_id)
    after = -1
    while True:
        async with transaction(engine) as conn:
            records = await store.list_messages(
                conn,
                tenant_id=tenant_id,
                conversation_id=ref.id,
                after_seq=after,
                limit=batch,
                branch_only=True,
            )
        for record in records:
            replaced = {"system_prompt": True} if record.system_prompt else {}
            yield {**record.as_openai(), **replaced, "created_at": record.created_at.isoformat()}
        if len(records) < batch:
            return
        after = records[-1].seq


async def delete_conversation(
    conn: AsyncConnection, *, tenant_id: int, external_id: str
) -> Deleted:
    """Delete the conversation and everything of it (messages, summaries, embeddings, jobs)."""
    conversation_id = await conn.scalar(
        select(conversations.c.id)
        .where(conversations.c.tenant_id == tenant_id, conversations.c.external_id == external_id)
        .with_for_update()
    )
    if conversation_id is None:
        raise NotFound(f"conversation {external_id!r} does not exist")
    counts = (
        await conn.execute(
            select(
                func.count().filter(nodes.c.level == 0),
                func.count().filter(nodes.c.level > 0),
            ).where(nodes.c.conversation_id == conversation_id)
        )
    ).one()
    job_count = await conn.scalar(
        select(func.count()).where(jobs.c.conversation_id == conversation_id)
    )
    await conn.execute(delete(conversations).where(conversations.c.id == conversation_id))
    return Deleted(messages=int(counts[0]), summaries=int(counts[1]), jobs=int(job_count or 0))
