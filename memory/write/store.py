"""Storing and reading conversations and their messages: the verbatim, lossless layer.

Every function takes the connection and keyword-only arguments, and is scoped by `tenant_id`:
a conversation or node of another tenant behaves as missing. Writes that touch a conversation
lock its row first (`FOR UPDATE`), so concurrent requests on one conversation get consecutive,
never duplicated, sequence numbers and a consistent hash chain. Callers own the transaction:
`store_new` and `append` do their work inside the caller's transaction, and queue the build of
the conversation's tree there (`memory.build.tree.enqueue`, deduplicated), so that the
background work commits or rolls back with the messages it concerns. They are the only place a
write queues its build: no caller can store messages and forget them.

The request path runs `store_new` and `append` on every chat request, so each keeps its round
trips to the database few: the conversation is found and locked in one statement, and what
the request path needs next (the conversation's token count and user) comes back in `Appended`.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Text, bindparam, func, insert, select, update
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import tokens
from memory.build import tree
from memory.db import AnyRow
from memory.errors import NotFound
from memory.schema import DEFAULT_TENANT, conversations, nodes, tenants
from memory.text import escape_unstorable
from memory.write import identity

MESSAGE_FIELDS = ("role", "name", "content", "tool_calls", "tool_call_id")
"""Fields of an OpenAI message stored in columns; the rest are kept in `meta`."""
_SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class ConversationRef:
    """A conversation as the request path needs it."""

    id: int
    external_id: str
    created: bool


@dataclass(frozen=True)
class Appended:
    """What `store_new` or `append` stored, and the conversation as it is now."""

    conversation: ConversationRef
    node_ids: list[int]
    first_seq: int
    token_count: int
    """Tokens of every message the conversation holds, the new ones included."""
    user_id: str | None


@dataclass(frozen=True)
class MessageRecord:
    """One stored message (a level-0 node)."""

    node_id: int
    seq: int
    role: str
    name: str | None
    content: Any
    tool_calls: list[dict[str, Any]] | None
    tool_call_id: str | None
    status: str
    token_count: int
    created_at: datetime
    meta: dict[str, Any]
    escaped: bool = False
    """Text Postgres cannot hold (NUL, unpaired surrogates) was stored escaped."""

    def as_openai(self) -> dict[str, Any]:
        """The message in OpenAI's chat format, as the client sent or received it."""
        return openai_message(self)


async def tenant_id_by_name(conn: AsyncConnection, *, name: str = DEFAULT_TENANT) -> int:
    """The id of the tenant called `name`."""
    found = await conn.scalar(select(tenants.c.id).where(tenants.c.name == name))
    if found is None:
        raise NotFound(f"tenant {name!r} does not exist")
    return int(found)


async def store_new(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    found: identity.Found,
    messages: Sequence[Mapping[str, Any]],
    model: str,
    created_at: Sequence[datetime | None] | None = None,
) -> Appended:
    """Store the part of an incoming history that is new to the conversation `identity.identify`
    found (and locked): `messages` from `found.start` on. `created_at`, if given, holds one
    timestamp (or None: now) per message of `messages`."""
    start = found.start
    return await _append_locked(
        conn,
        tenant_id=tenant_id,
        conv=found.row,
        created=found.created,
        messages=messages[start:],
        model=model,
        created_at=created_at[start:] if created_at is not None else None,
    )


async def append(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    messages: Sequence[Mapping[str, Any]],
    model: str,
    status: str = "complete",
    created_at: Sequence[datetime | None] | None = None,
    request_tokens: tuple[int, int] | None = None,
) -> Appended:
    """Append `messages` to a stored conversation (a reply, or a bulk import).

    `request_tokens`, for a reply: the prompt tokens sent upstream for the request it answers
    and what the whole history would have cost, counted on the conversation with the reply
    (its statistics: requests, tokens sent, tokens full)."""
    conv = (
        await conn.execute(_LOCK_BY_ID, {"id": conversation_id, "tenant_id": tenant_id})
    ).one_or_none()
    if conv is None:
        raise NotFound(f"conversation {conversation_id} does not exist")
    return await _append_locked(
        conn,
        tenant_id=tenant_id,
        conv=conv,
        created=False,
        messages=messages,
        model=model,
        status=status,
        created_at=created_at,
        request_tokens=request_tokens,
    )


async def open_conversation(
    conn: AsyncConnection, *, tenant_id: int, external_id: str, user: str | None = None
) -> tuple[ConversationRef, int]:
    """The conversation `external_id`, created if missing and locked until the transaction
    ends, and the number of messages it holds."""
    found = await identity.lock_or_create(
        conn, tenant_id=tenant_id, external_id=external_id, user=user
    )
    ref = ConversationRef(id=found.row.id, external_id=external_id, created=found.created)
    return ref, found.row.next_seq


async def resume_point(
    conn: AsyncConnection, *, conversation_id: int, messages: Sequence[Mapping[str, Any]]
) -> int:
    """How many leading `messages` the conversation already holds: an import that is run
    again, or resumed after a failure, continues after them instead of storing them twice."""
    head = await conn.scalar(
        select(conversations.c.head_hash).where(conversations.c.id == conversation_id)
    )
    start = identity.after_head(identity.chain(messages), head)
    return 0 if start is None else start


async def find_conversation(
    conn: AsyncConnection, *, tenant_id: int, external_id: str
) -> ConversationRef:
    """The conversation `external_id` of this tenant, or `NotFound`."""
    found = await conn.scalar(
        select(conversations.c.id).where(
            conversations.c.tenant_id == tenant_id, conversations.c.external_id == external_id
        )
    )
    if found is None:
        raise NotFound(f"conversation {external_id!r} does not exist")
    return ConversationRef(id=int(found), external_id=external_id, created=False)


async def external_id(conn: AsyncConnection, *, tenant_id: int, conversation_id: int) -> str:
    """The id clients know the conversation by, or `NotFound`."""
    found = await conn.scalar(
        select(conversations.c.external_id).where(
            conversations.c.id == conversation_id, conversations.c.tenant_id == tenant_id
        )
    )
    if found is None:
        raise NotFound(f"conversation {conversation_id} does not exist")
    return str(found)


async def list_messages(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    after_seq: int = -1,
    limit: int | None = None,
) -> list[MessageRecord]:
    """Stored messages of a conversation in order, from `after_seq + 1`."""
    query = (
        select(nodes)
        .where(
            nodes.c.tenant_id == tenant_id,
            nodes.c.conversation_id == conversation_id,
            nodes.c.level == 0,
            nodes.c.seq > after_seq,
        )
        .order_by(nodes.c.seq)
        .limit(limit)
    )
    return [_message_record(row) for row in await conn.execute(query)]


async def history(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, before_seq: int
) -> list[dict[str, Any]]:
    """Stored messages before seq `before_seq`, as a prompt carries them back upstream
    (`prompt_message`; only the columns a prompt needs: the request path reads this)."""
    rows = await conn.execute(
        select(
            nodes.c.role,
            nodes.c.content,
            nodes.c.name,
            nodes.c.tool_calls,
            nodes.c.tool_call_id,
            nodes.c.meta,
        )
        .where(
            nodes.c.tenant_id == tenant_id,
            nodes.c.conversation_id == conversation_id,
            nodes.c.level == 0,
            nodes.c.seq < before_seq,
        )
        .order_by(nodes.c.seq)
    )
    return [prompt_message(row) for row in rows]


# -- internals ---------------------------------------------------------------------------

# The statements every chat request runs, built once: SQLAlchemy then neither rebuilds them nor
# recomputes their cache keys on each call.
_LOCK_BY_ID = (
    select(conversations)
    .where(
        conversations.c.id == bindparam("id"), conversations.c.tenant_id == bindparam("tenant_id")
    )
    .with_for_update()
)
# Moves the head after new messages (a NULL hash keeps the stored one) and counts a request.
_MOVE_HEAD = (
    update(conversations)
    .where(conversations.c.id == bindparam("conversation"))
    .values(
        next_seq=bindparam("new_next_seq"),
        token_count=conversations.c.token_count + bindparam("added"),
        head_hash=func.coalesce(bindparam("new_head", type_=Text), conversations.c.head_hash),
        system_hash=func.coalesce(bindparam("new_system", type_=Text), conversations.c.system_hash),
        requests=conversations.c.requests + bindparam("requests"),
        tokens_sent=conversations.c.tokens_sent + bindparam("sent"),
        tokens_full=conversations.c.tokens_full + bindparam("full"),
        updated_at=func.now(),
    )
)


async def _append_locked(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conv: AnyRow,
    created: bool,
    messages: Sequence[Mapping[str, Any]],
    model: str,
    status: str = "complete",
    created_at: Sequence[datetime | None] | None = None,
    request_tokens: tuple[int, int] | None = None,
) -> Appended:
    """Insert `messages` after the locked conversation's head and move the head."""
    ref = ConversationRef(id=conv.id, external_id=conv.external_id, created=created)
    await tree.enqueue(conn, tenant_id=tenant_id, conversation_id=conv.id)
    if not messages and request_tokens is None:
        return Appended(
            conversation=ref,
            node_ids=[],
            first_seq=conv.next_seq,
            token_count=conv.token_count,
            user_id=conv.user_id,
        )
    hashes = identity.chain(messages, conv.head_hash or identity.ROOT_HASH)
    now = datetime.now(UTC)
    rows = []
    for offset, (original, digest) in enumerate(zip(messages, hashes, strict=True)):
        # The hash is the original's, so that a client resending it still matches.
        message, escaped = escape_unstorable(dict(original))
        text = tokens.message_text(message)
        row: dict[str, Any] = {
            "tenant_id": tenant_id,
            "conversation_id": conv.id,
            "level": 0,
            "seq": conv.next_seq + offset,
            "span_start": conv.next_seq + offset,
            "span_end": conv.next_seq + offset,
            **{field: message.get(field) for field in MESSAGE_FIELDS},
            "chain_hash": digest,
            "text": text,
            "token_count": tokens.count_message(message, model=model),
            "status": status,
            "escaped": escaped,
            "meta": {k: v for k, v in message.items() if k not in MESSAGE_FIELDS},
        }
        if created_at is not None:
            row["created_at"] = created_at[offset] or now
        rows.append(row)
    node_ids: list[int] = []
    if rows:
        result = await conn.execute(
            insert(nodes).returning(nodes.c.id, sort_by_parameter_order=True), rows
        )
        node_ids = [int(node_id) for node_id in result.scalars()]
    added = sum(row["token_count"] for row in rows)
    systems = [m for m in messages if m.get("role") in _SYSTEM_ROLES]
    sent, full = request_tokens or (0, 0)
    await conn.execute(
        _MOVE_HEAD,
        {
            "conversation": conv.id,
            "new_next_seq": conv.next_seq + len(rows),
            "added": added,
            "new_head": hashes[-1] if hashes else None,
            "new_system": (identity.content_hash(systems[-1].get("content")) if systems else None),
            "requests": 0 if request_tokens is None else 1,
            "sent": sent,
            "full": full,
        },
    )
    return Appended(
        conversation=ref,
        node_ids=node_ids,
        first_seq=conv.next_seq,
        token_count=conv.token_count + added,
        user_id=conv.user_id,
    )


def openai_message(row: Any) -> dict[str, Any]:
    """A stored message row (any row with its columns) in OpenAI's format, as the client sent
    or received it: its extra fields (`meta`), then role, content and the set optional fields."""
    message: dict[str, Any] = {**(row.meta or {}), "role": row.role, "content": row.content}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(row, key) is not None:
            message[key] = getattr(row, key)
    return message


REPLY_ONLY_FIELDS = frozenset({"annotations", "reasoning_content", "reasoning", "logprobs"})
"""Fields of a stored reply that an upstream sends but does not take back in a prompt (some
refuse them: DeepSeek refuses `reasoning_content` in input)."""


def prompt_message(row: Any) -> dict[str, Any]:
    """A stored message as a prompt may carry it back upstream: `openai_message` without the
    reply-only fields, and a reply's `audio` by its id alone (the form input takes)."""
    message = {k: v for k, v in openai_message(row).items() if k not in REPLY_ONLY_FIELDS}
    audio = message.get("audio")
    if isinstance(audio, dict):
        if isinstance(audio.get("id"), str):
            message["audio"] = {"id": audio["id"]}
        else:
            del message["audio"]
    return message


def _message_record(row: AnyRow) -> MessageRecord:
    return MessageRecord(
        node_id=row.id,
        seq=row.seq,
        role=row.role,
        name=row.name,
        content=row.content,
        tool_calls=row.tool_calls,
        tool_call_id=row.tool_call_id,
        status=row.status,
        token_count=row.token_count,
        created_at=row.created_at,
        meta=row.meta,
        escaped=row.escaped,
    )


# -- the tree ------------------------------------------------------------------------------------


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
    query = select(nodes, *_node_extras()).where(
        nodes.c.tenant_id == tenant_id,
        nodes.c.conversation_id == conversation_id,
        nodes.c.level >= min_level,
    )
    if max_level is not None:
        query = query.where(nodes.c.level <= max_level)
    rows = await conn.execute(query.order_by(nodes.c.level.desc(), nodes.c.seq))
    return [_node_record(row) for row in rows]


async def get_node(conn: AsyncConnection, *, tenant_id: int, node_id: int) -> NodeRecord:
    """One node of this tenant, or `NotFound` (also for another tenant's node)."""
    row = (
        await conn.execute(
            select(nodes, *_node_extras()).where(
                nodes.c.id == node_id, nodes.c.tenant_id == tenant_id
            )
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"node {node_id} does not exist")
    return _node_record(row)


def _node_extras() -> list[Any]:
    child = nodes.alias("child")
    children = (
        select(func.array_agg(aggregate_order_by(child.c.id, child.c.seq)))
        .where(child.c.parent_id == nodes.c.id)
        .scalar_subquery()
        .label("children")
    )
    return [children, nodes.c.embedding.is_not(None).label("embedded")]


def _node_record(row: AnyRow) -> NodeRecord:
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
