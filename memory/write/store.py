"""Storing and reading conversations and their messages: the verbatim, lossless layer.

Every function takes the connection and keyword-only arguments, and is scoped by `tenant_id`:
a conversation or node of another tenant behaves as missing. Writes that touch a conversation
lock its row first (`FOR NO KEY UPDATE`), so concurrent requests on one conversation get
consecutive, never duplicated, sequence numbers and a consistent hash chain. Callers own the
transaction: `store_new` and `append` do their work inside the caller's transaction, and queue
the build of the conversation's tree there (`memory.build.tree.enqueue`, deduplicated), so that the
background work commits or rolls back with the messages it concerns. They (and
`memory.write.appends.at_head`, which `store_new` and `memory.write.replies` try first) are the
only places a write queues its build: no caller can store messages and forget them. A reply to
a prompt built from the working context also queues `appends.CONTEXT_JOB` (deduplicated,
behind the build): the read path's preparation of the next turn (`memory.recall.anticipation`,
`memory.recall.compaction`), whose handler `gateway.background` composes.

The request path runs `store_new` and `append` (through `memory.write.replies`) on every chat
request, so each keeps its round trips to the database few: the conversation is found and
locked in one statement, a turn that adds one message after the head stores it, moves the head
and queues the build in one more (`appends.at_head`), and what the request path needs next
(the conversation's token count and user) comes back in `Appended`.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ColumnElement, bindparam, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.build import jobs, tree
from memory.db import AnyRow
from memory.errors import NotFound
from memory.schema import DEFAULT_TENANT, conversations, nodes, tenants
from memory.write import appends, branches, chains, identity, placement
from memory.write.branches import ReplyTo

__all__ = ["ReplyTo"]  # re-exported: a turn keeps where its reply goes


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
    """The seq of the first message stored; when none was, one past the stored message the
    request's history ended with."""
    token_count: int
    """Tokens of the conversation's current branch, the new messages included."""
    user_id: str | None
    whole: bool = False
    """The request's messages are the conversation's whole current branch (see `Found`)."""
    branched_at: int | None = None
    """The first seq whose message left or rejoined the current branch, when this write moved
    it: a prompt or summary built from messages from there on no longer holds (see
    `memory.write.branches`)."""
    reply_to: ReplyTo | None = None
    """Where this turn's reply goes (`store_new` only)."""
    prompt_fingerprint: Any = None
    """The fingerprint of the conversation's last prompt (`RequestStats.fingerprint`)."""


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
    superseded_at: datetime | None = None
    """When the message left the current branch (None: it is on it)."""
    follows_seq: int = -1
    """The seq of the message it follows (-1: the conversation's root)."""
    model: str | None = None
    """The model whose reply this is, when the gateway recorded it from the upstream."""
    system_prompt: bool = False
    """It replaced the conversation's system prompt: never a turn of the history."""

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
    found: placement.Found,
    messages: Sequence[Mapping[str, Any]],
    model: str,
    created_at: Sequence[datetime | None] | None = None,
    request_key: str | None = None,
) -> Appended:
    """Store the part of an incoming history that is new to the conversation `identity.identify`
    found (and locked): `messages` from `found.start` on, after moving the current branch when
    the history branches (or a retry moves past a cut answer); nothing for a retry.
    `created_at`, if given, holds one timestamp (or None: now) per message of `messages`;
    `request_key` is recorded with what is stored."""
    conv = found.row
    ref = ConversationRef(id=conv.id, external_id=conv.external_id, created=found.created)
    start = len(messages) if found.retry else found.start
    one = await _one_after_head(
        conn,
        tenant_id=tenant_id,
        found=found,
        messages=messages[start:],
        model=model,
        created_at=created_at[start:] if created_at is not None else None,
        request_key=request_key,
    )
    if one is not None:
        return Appended(
            conversation=ref,
            node_ids=[one.node_id],
            first_seq=one.seq,
            token_count=conv.token_count + one.tokens,
            user_id=conv.user_id,
            whole=found.whole,
            reply_to=ReplyTo(parent=one.chain_hash, parent_seq=one.seq, request_key=request_key),
            prompt_fingerprint=conv.prompt_fingerprint,
        )
    await tree.enqueue(conn, tenant_id=tenant_id, conversation_id=conv.id)
    moved = branches.Moved(branched_at=None, tokens=0)
    if found.branch is not None:  # a retry's too: it moves past a cut answer (`identity`)
        moved = await branches.move(
            conn,
            conversation_id=conv.id,
            fork_seq=found.branch.fork_seq,
            restore=found.branch.restore,
        )
    inserted = await _insert(
        conn,
        tenant_id=tenant_id,
        conv=conv,
        messages=messages[start:],
        after=(found.parent, found.parent_seq),
        model=model,
        created_at=created_at[start:] if created_at is not None else None,
        request_key=request_key,
        system_prompts=found.system_prompt,
    )
    head = inserted.head or (found.parent, found.parent_seq)
    if inserted.node_ids or found.branch is not None:
        systems = [m for m in messages[start:] if m.get("role") in chains.SYSTEM_ROLES]
        await _move_head(
            conn,
            conv=conv,
            stored=len(inserted.node_ids),
            added=inserted.tokens + moved.tokens,
            head=head,
            system=systems[-1].get("content") if systems else None,
        )
    return Appended(
        conversation=ref,
        node_ids=inserted.node_ids,
        first_seq=conv.next_seq if inserted.node_ids else _after(found.parent_seq),
        token_count=conv.token_count + inserted.tokens + moved.tokens,
        user_id=conv.user_id,
        whole=found.whole,
        branched_at=moved.branched_at,
        reply_to=ReplyTo(
            parent=head[0], parent_seq=head[1], request_key=request_key, retry=found.retry
        ),
        prompt_fingerprint=conv.prompt_fingerprint,
    )


async def _one_after_head(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    found: placement.Found,
    messages: Sequence[Mapping[str, Any]],
    model: str,
    created_at: Sequence[datetime | None] | None,
    request_key: str | None,
) -> appends.Stored | None:
    """The most common turn, one new message right after the head, stored in one statement
    (`appends.at_head`); None when the turn is another kind, or the head is elsewhere."""
    conv = found.row
    if (
        len(messages) != 1
        or found.system_prompt
        or found.branch is not None
        or found.parent_seq is None
        or found.parent_seq != conv.next_seq - 1
        or (created_at is not None and any(created_at))
    ):
        return None
    return await appends.at_head(
        conn,
        tenant_id=tenant_id,
        conversation_id=conv.id,
        message=messages[0],
        after=(found.parent, found.parent_seq),
        model=model,
        request_key=request_key,
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
    request: appends.RequestStats | None = None,
    reply_to: ReplyTo | None = None,
    system_prompts: int = 0,
) -> Appended:
    """Append `messages` to a stored conversation's current branch (a reply, or a bulk import).

    `system_prompts`, for an import: how many of the first messages are a system prompt that
    replaced the conversation's, stored marked (`placement.Found.system_prompt`).
    `request`, for a reply: what the request it answers cost, counted on the conversation with
    the reply (its statistics: requests, tokens sent, full, reused, what the upstream
    reported); the reply is stored as written by `model`. `reply_to`, for a reply, says where
    it goes when the head has moved since its turn was stored (`branches.place_reply`: a
    retry's reply whose first answer is recorded is not stored again)."""
    conv = (
        await conn.execute(_LOCK_BY_ID, {"id": conversation_id, "tenant_id": tenant_id})
    ).one_or_none()
    if conv is None:
        raise NotFound(f"conversation {conversation_id} does not exist")
    ref = ConversationRef(id=conv.id, external_id=conv.external_id, created=False)
    await tree.enqueue(conn, tenant_id=tenant_id, conversation_id=conv.id)
    if request is not None and request.prepare_context:
        # Behind the build just queued: jobs of one conversation run in order.
        await jobs.enqueue(
            conn,
            kind=appends.CONTEXT_JOB,
            tenant_id=tenant_id,
            conversation_id=conv.id,
            dedupe_key=appends.context_key(conv.id),
        )
    if not messages and request is None:
        return Appended(
            conversation=ref,
            node_ids=[],
            first_seq=conv.next_seq,
            token_count=conv.token_count,
            user_id=conv.user_id,
            prompt_fingerprint=conv.prompt_fingerprint,
        )
    place = branches.Place(after=(conv.head_hash or chains.ROOT_HASH, conv.head_seq))
    if reply_to is not None and conv.head_hash != reply_to.parent:
        place = await branches.place_reply(conn, conv=conv, reply_to=reply_to)
    inserted = await _insert(
        conn,
        tenant_id=tenant_id,
        conv=conv,
        messages=[] if place.answered else messages,
        after=place.after,
        model=model,
        status=status,
        created_at=created_at,
        request_key=reply_to.request_key if reply_to is not None else None,
        replied_by=model if request is not None else None,
        current=place.current,
        system_prompts=system_prompts,
    )
    added = inserted.tokens if place.current else 0
    systems = [m for m in messages if m.get("role") in chains.SYSTEM_ROLES]
    await _move_head(
        conn,
        conv=conv,
        stored=len(inserted.node_ids),
        added=added,
        head=inserted.head if place.current else None,
        system=systems[-1].get("content") if systems and inserted.node_ids else None,
        request=request,
    )
    return Appended(
        conversation=ref,
        node_ids=inserted.node_ids,
        first_seq=conv.next_seq,
        token_count=conv.token_count + added,
        user_id=conv.user_id,
        prompt_fingerprint=conv.prompt_fingerprint,
    )


async def lock(conn: AsyncConnection, *, tenant_id: int, conversation_id: int) -> None:
    """Lock the conversation's row until the transaction ends (`NotFound` if it is gone)."""
    found = await conn.execute(_LOCK_BY_ID, {"id": conversation_id, "tenant_id": tenant_id})
    if found.one_or_none() is None:
        raise NotFound(f"conversation {conversation_id} does not exist")


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
    branch_only: bool = False,
) -> list[MessageRecord]:
    """Stored messages of a conversation in order, from `after_seq + 1`; with `branch_only`,
    those of its current branch only."""
    query = (
        select(nodes)
        .where(
            nodes.c.tenant_id == tenant_id,
            nodes.c.conversation_id == conversation_id,
            nodes.c.level == 0,
            nodes.c.seq > after_seq,
            *([nodes.c.superseded_at.is_(None)] if branch_only else []),
        )
        .order_by(nodes.c.seq)
        .limit(limit)
    )
    return [_message_record(row) for row in await conn.execute(query)]


_SYSTEM_PROMPT_MAX = 8
"""The most messages one system prompt is read as (a request leads with one or two)."""

PROMPT_COLUMNS = (
    nodes.c.role,
    nodes.c.content,
    nodes.c.name,
    nodes.c.tool_calls,
    nodes.c.tool_call_id,
    nodes.c.meta,
)
"""The columns of `nodes` that `prompt_message` reads."""


async def history(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, before_seq: int
) -> list[dict[str, Any]]:
    """The current branch's turns before seq `before_seq`, as a prompt carries them back
    upstream (`prompt_message`; only the columns a prompt needs: the request path reads this).
    A system prompt that replaced the conversation's is no turn (`latest_system_prompt`)."""
    rows = await conn.execute(
        select(*PROMPT_COLUMNS)
        .where(
            *_on_branch_before(tenant_id, conversation_id, before_seq),
            nodes.c.system_prompt.is_(False),
        )
        .order_by(nodes.c.seq)
    )
    return [prompt_message(row) for row in rows]


def _on_branch_before(
    tenant_id: int, conversation_id: int, before_seq: int
) -> tuple[ColumnElement[bool], ...]:
    """The conditions of the current branch's messages before seq `before_seq`."""
    return (
        nodes.c.tenant_id == tenant_id,
        nodes.c.conversation_id == conversation_id,
        nodes.c.level == 0,
        nodes.c.seq < before_seq,
        nodes.c.superseded_at.is_(None),
    )


async def latest_system_prompt(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, before_seq: int
) -> list[dict[str, Any]]:
    """The system prompt that last replaced the conversation's on its current branch before
    seq `before_seq` (the messages one request led with: `placement.Found.system_prompt`), as
    a prompt carries it; empty when none did."""
    rows = (
        await conn.execute(
            select(nodes.c.seq, *PROMPT_COLUMNS)
            .where(
                *_on_branch_before(tenant_id, conversation_id, before_seq),
                nodes.c.system_prompt.is_(True),
            )
            .order_by(nodes.c.seq.desc())
            .limit(_SYSTEM_PROMPT_MAX)
        )
    ).all()
    run = [row for number, row in enumerate(rows) if row.seq == rows[0].seq - number]
    return [prompt_message(row) for row in reversed(run)]


# -- internals ---------------------------------------------------------------------------

# The statements every chat request runs, built once: SQLAlchemy then neither rebuilds them nor
# recomputes their cache keys on each call.
_LOCK_BY_ID = (
    select(conversations)
    .where(
        conversations.c.id == bindparam("id"), conversations.c.tenant_id == bindparam("tenant_id")
    )
    .with_for_update(key_share=True)
)


async def _move_head(
    conn: AsyncConnection,
    *,
    conv: AnyRow,
    stored: int,
    added: int,
    head: tuple[str, int | None] | None,
    system: Any = None,
    request: appends.RequestStats | None = None,
) -> None:
    """Count `stored` messages and `added` tokens of the current branch on the locked `conv`,
    move its head to `head` (None: where it is), note its newest system prompt, count a
    request's figures."""
    values = appends.head_values(
        stored=stored, added=added, head=head, system=system, request=request
    )
    await conn.execute(appends.MOVE_HEAD, {"conversation": conv.id, **values})


@dataclass(frozen=True)
class _Inserted:
    node_ids: list[int]
    tokens: int
    head: tuple[str, int] | None
    """The chain hash and seq of the last message inserted."""


async def _insert(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conv: AnyRow,
    messages: Sequence[Mapping[str, Any]],
    after: tuple[str, int | None],
    model: str,
    status: str = "complete",
    created_at: Sequence[datetime | None] | None = None,
    request_key: str | None = None,
    replied_by: str | None = None,
    current: bool = True,
    system_prompts: int = 0,
) -> _Inserted:
    """Insert `messages` at the end of the locked conversation's storage, chained after
    `after` (a chain hash and its message's seq); superseded when not `current`; the first
    `system_prompts` marked as a system prompt that is no turn (`placement.Found`)."""
    if not messages:
        return _Inserted(node_ids=[], tokens=0, head=None)
    parent, parent_seq = after
    hashes = chains.chain(messages, parent)
    now = datetime.now(UTC)
    rows = []
    for offset, (original, digest) in enumerate(zip(messages, hashes, strict=True)):
        seq = conv.next_seq + offset
        follows = offset == 0 and parent_seq != seq - 1
        row = appends.node_row(
            original,
            tenant_id=tenant_id,
            conversation_id=conv.id,
            seq=seq,
            chain_hash=digest,
            follows_seq=(-1 if parent_seq is None else parent_seq) if follows else None,
            model=model,
            status=status,
            request_key=request_key,
            replied_by=replied_by,
        )
        row["superseded_at"] = None if current else now
        row["system_prompt"] = offset < system_prompts
        if created_at is not None:
            row["created_at"] = created_at[offset] or now
        rows.append(row)
    result = await conn.execute(
        insert(nodes).returning(nodes.c.id, sort_by_parameter_order=True), rows
    )
    return _Inserted(
        node_ids=[int(node_id) for node_id in result.scalars()],
        tokens=sum(row["token_count"] for row in rows),
        head=(hashes[-1], conv.next_seq + len(rows) - 1),
    )


def _after(seq: int | None) -> int:
    return 0 if seq is None else seq + 1


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
        superseded_at=row.superseded_at,
        follows_seq=row.seq - 1 if row.follows_seq is None else row.follows_seq,
        model=row.model,
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
        system_prompt=row.system_prompt,
    )
