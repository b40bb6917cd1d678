"""Which conversation a request belongs to, where its new messages start, and whether it
branches or repeats an earlier request.

**Chain hashes** (`memory.write.chains`) name each message by the whole path before it.

**Branches.** Every stored message keeps its chain hash. A conversation's messages form a
tree, stored in arrival order (`seq`): its *current branch* is the path the client last sent,
the messages with no `superseded_at`; its head (`head_hash`, `head_seq`) is the branch's last
message. An incoming history that holds the head extends the current branch. One that leaves
it (an edited message, a regenerated answer, a dropped turn) continues the conversation as a
branch from the last message it shares with it (`Branch`): the current branch's messages after
that point are superseded, and messages of an abandoned branch the history holds again are
restored. Such a divergence continues the conversation only when the shared part holds a reply
the gateway recorded (proof the client saw this conversation), when the history's last
assistant message is the conversation's head, such a reply (a client that rewrote its own
messages: `memory.write.rewritten`), or when it leaves the current branch within its latest
exchange (from its last user message on) and holds a user message: a new chat that merely
opens like an old one (the same system prompt) is not taken for it. A
resent history whose system prompt changed (the time in it) is found by its turns alone
(`memory.write.system_prompts`). Results of the head's tool calls sent after the messages before
that call, without it (and without the calls of earlier steps), continue the head
(`memory.write.tool_results`): results follow their call.

`identify` is the first step of the request path: it finds the conversation an incoming history
belongs to (by the client's conversation id, else by the deepest stored message of its chain),
creates it when there is none, and locks its row (`FOR NO KEY UPDATE`) until the caller's
transaction ends, so that concurrent requests on one conversation store their messages one after
the other (`memory.write.store`); the background build's summaries, written under a key-share
lock of the row, do not hold it up (`memory.build.tree`). Two requests that would both start
a new conversation with the same first message are serialized by an advisory lock, so the second
finds the first's.

**Retries** (`memory.write.retries`): a request that repeats an earlier one stores nothing.
"""

import hashlib
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Text, bindparam, func, insert, literal_column, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.db import AnyRow
from memory.errors import InvalidConversationId
from memory.schema import conversations, nodes
from memory.write import chains, retries, rewritten, system_prompts, tool_results, windows
from memory.write.placement import Branch, Found

CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9._:-]*[A-Za-z0-9_:-][A-Za-z0-9._:-]*$"
"""Characters of A-Za-z0-9._:-, not dots alone (`.` and `..` name folders in paths and URLs)."""
CONVERSATION_ID_MAX = 128
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)


def validate_conversation_id(value: str) -> str:
    """Return `value` if it is a valid conversation id, else raise `InvalidConversationId`."""
    if len(value) > CONVERSATION_ID_MAX or not _CONVERSATION_ID.fullmatch(value):
        raise InvalidConversationId(
            "conversation id must be 1-128 characters of A-Z a-z 0-9 . _ : -, not dots alone",
            param="X-Memstrata-Conversation",
        )
    return value


def new_conversation_id() -> str:
    """A fresh conversation id for a history that matches no stored conversation."""
    return f"conv-{uuid.uuid4().hex}"


# -- where a history goes ----------------------------------------------------------------------


async def identify(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    external_id: str | None,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
    request: retries.RequestKey | None = None,
    window: timedelta = retries.DEFAULT_WINDOW,
    new_only: bool = False,
) -> Found:
    """The conversation `messages` belongs to, where its new messages start, and how it
    branches.

    With `external_id`, that conversation (created if new): a history that holds its head is
    resent and the messages after the head are new; one that leaves its current branch where
    a branch may start (module docstring) branches; any other is taken as new messages only
    (a repeated system prompt aside). Without it, the conversation (of the same `user`) holding
    the deepest stored message of the history's chain, when the history extends it or may
    branch from it; else a new one. `request` tells a retry (within `window` for an
    `Idempotency-Key`). `new_only`, with `external_id`: the client says `messages` follow the
    head (a Responses request continuing the latest response), so they never branch."""
    hashes = chains.chain(messages)
    if external_id is not None:
        locked = await lock_or_create(conn, tenant_id=tenant_id, external_id=external_id, user=user)
        # Matched against the stored chain, new input that repeats the conversation's opening
        # ("tell me a joke" twice) was taken for a regeneration of the first answer.
        placed = (
            _after_head(locked.row, messages, created=locked.created)
            if new_only
            else await _place(conn, locked.row, messages, hashes, created=locked.created)
        )
        assert placed is not None  # a named conversation always takes the history
        found = placed
    else:
        found = await _match(conn, tenant_id=tenant_id, user=user, messages=messages, hashes=hashes)
    found = await tool_results.for_the_head(conn, found, messages)
    if request is not None and not found.created:
        results = any(message.get("role") == "tool" for message in messages[found.start :])
        return (
            await retries.as_retry(conn, found, len(messages), request, window, results=results)
            or found
        )
    return found


async def lock_or_create(
    conn: AsyncConnection, *, tenant_id: int, external_id: str, user: str | None
) -> Found:
    """The conversation `external_id`, created if missing, locked (`start` is 0)."""
    row = (
        await conn.execute(
            _LOCK_OR_CREATE, {"tenant_id": tenant_id, "external_id": external_id, "user": user}
        )
    ).one()
    return Found(row=await _as_committed(conn, row), start=0, created=bool(row.inserted))


async def _as_committed(conn: AsyncConnection, row: AnyRow) -> AnyRow:
    """The locked conversation `row` with its head's request and kind as committed.

    A statement that waited for another transaction's lock on the row returns the row as that
    transaction left it, but its subqueries read what was committed when the statement
    began (read committed): the head that transaction stored was not there yet, and a twin of
    its request, sent at once, was not taken for a retry (its message stored twice). The row is
    then read again, in a statement of its own (its lock is this transaction's by now)."""
    if row.head_seq is None or row.head_replied is not None:
        return row
    return (await conn.execute(_LOCK_BY_ID, {"id": row.id})).one()


# The request and kind of the head message, read with the conversation's row (a retry is told
# by them) in the statement that locks it.
_HEAD_NODE = nodes.alias("head")


def _of_head(column: Any, label: str) -> Any:
    # The outer row named as text: SQLAlchemy does not correlate a subquery of a RETURNING.
    return (
        select(column)
        .where(
            _HEAD_NODE.c.conversation_id == literal_column("conversations.id"),
            _HEAD_NODE.c.level == 0,
            _HEAD_NODE.c.seq == literal_column("conversations.head_seq"),
        )
        .scalar_subquery()
        .label(label)
    )


_HEAD_COLUMNS = (
    _of_head(_HEAD_NODE.c.request_key, "head_request"),
    _of_head(_HEAD_NODE.c.model.is_not(None), "head_replied"),
)

# One statement, built once (built per call, it cost three times its execution in CPU time):
# the conflicting update is a no-op that locks the existing row (a new one is ours until
# commit) as `FOR NO KEY UPDATE` does, since it sets no column of a unique key; `xmax` is 0
# only on a row this statement inserted.
_NAMED = pg_insert(conversations).values(
    tenant_id=bindparam("tenant_id"),
    external_id=bindparam("external_id"),
    user_id=bindparam("user", type_=Text),
)
_LOCK_OR_CREATE = _NAMED.on_conflict_do_update(
    constraint="uq_conversations_tenant_external",
    set_={"updated_at": conversations.c.updated_at},
).returning(*conversations.c, *_HEAD_COLUMNS, literal_column("xmax = 0").label("inserted"))

# Built once: the request path runs these on every request without a conversation id.
_CHAIN = bindparam("chain", type_=ARRAY(Text))
# A message (level 0) as a constant, not a parameter: the chain indexes are partial (`level =
# 0`), and a prepared statement's generic plan cannot use a partial index for a parameter. It
# read a 10,000-message conversation whole (4-6 ms, on every request after the fifth) instead.
_MESSAGE = nodes.c.level == literal_column("0")
_SAME_USER = conversations.c.user_id.is_not_distinct_from(bindparam("user", type_=Text))
# The conversation whose head is latest in the history. Locked as found: a candidate that
# another request extended meanwhile is read again after the lock, and skipped if its new head
# is not in this history (the next candidate is taken).
_LOCK_BY_HEAD = (
    select(conversations, *_HEAD_COLUMNS)
    .where(
        conversations.c.tenant_id == bindparam("tenant_id"),
        conversations.c.head_hash == func.any(_CHAIN),
        _SAME_USER,
    )
    .order_by(
        func.array_position(_CHAIN, conversations.c.head_hash).desc(),
        conversations.c.updated_at.desc(),
    )
    .limit(1)
    .with_for_update(of=conversations, key_share=True)
)
# Else the conversation holding the deepest stored message of the history (a current one
# first): the history may branch from it.
_DEEPEST = (
    select(nodes.c.conversation_id)
    .join(conversations, conversations.c.id == nodes.c.conversation_id)
    .where(
        nodes.c.tenant_id == bindparam("tenant_id"),
        _MESSAGE,
        nodes.c.chain_hash == func.any(_CHAIN),
        _SAME_USER,
    )
    .order_by(
        func.array_position(_CHAIN, nodes.c.chain_hash).desc(),
        nodes.c.superseded_at.is_(None).desc(),
        conversations.c.updated_at.desc(),
    )
    .limit(1)
)
# The conversation's messages with these chain hashes (`_path`).
_PATH = select(
    nodes.c.chain_hash,
    nodes.c.seq,
    nodes.c.role,
    nodes.c.model.is_not(None).label("replied"),
    nodes.c.superseded_at.is_(None).label("current"),
).where(
    nodes.c.conversation_id == bindparam("conversation_id"),
    _MESSAGE,
    nodes.c.chain_hash == func.any(_CHAIN),
)
_LOCK_BY_ID = (
    select(conversations, *_HEAD_COLUMNS)
    .where(conversations.c.id == bindparam("id"))
    .with_for_update(of=conversations, key_share=True)
)


async def _match(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
    hashes: Sequence[str],
) -> Found:
    params = {"tenant_id": tenant_id, "chain": list(hashes), "user": user}
    # A history may branch only from a shared part that holds more than its system prompt
    # (`_may_branch`): a conversation sharing no more is not a candidate, and not locked. Every
    # chat opening with the same system prompt holds that message; locking the latest of them
    # made each new conversation wait for another's turn.
    turns = list(hashes[system_prompts.opening(messages) :])
    for attempt in range(2):
        # A conversation whose head the history holds is the one it extends (`_place` always
        # takes it): no savepoint needed, the common case of a resent history costs no round
        # trip more than its lock.
        row = (await conn.execute(_LOCK_BY_HEAD, params)).one_or_none()
        found = (
            None
            if row is None
            else await _place(
                conn, await _as_committed(conn, row), messages, hashes, created=False, named=False
            )
        )
        if found is None and turns:
            found = await _branch_candidate(conn, params, turns, messages, hashes)
        if found is None:
            found = await _prompt_changed(conn, tenant_id, user, messages, hashes)
        if found is None:
            found = await _rewritten(conn, tenant_id, user, messages, hashes)
        if found is None:
            found = await _window_onto(conn, tenant_id, user, messages)
        if found is not None:
            return found
        if attempt == 0:
            # About to start a conversation: one that a concurrent request with the same
            # opening is starting must be found instead (read again once its writer commits).
            # Keyed by the first turn, which chains the system prompt in: chats that share
            # only a system prompt never match each other, so they need not wait in line.
            await conn.execute(
                text("SELECT pg_advisory_xact_lock(:key)"),
                {"key": _opening_lock(tenant_id, [*turns, *hashes, chains.ROOT_HASH][0])},
            )
    row = (
        await conn.execute(
            insert(conversations)
            .values(tenant_id=tenant_id, external_id=new_conversation_id(), user_id=user)
            .returning(*conversations.c)
        )
    ).one()
    return Found(row=row, start=0, created=True, whole=True)


async def _branch_candidate(
    conn: AsyncConnection,
    params: Mapping[str, Any],
    turns: Sequence[str],
    messages: Sequence[Mapping[str, Any]],
    hashes: Sequence[str],
) -> Found | None:
    """The conversation holding the deepest stored message of the history's `turns`, locked,
    when the history may branch from it; else None."""
    deepest = await conn.scalar(_DEEPEST, {**params, "chain": list(turns)})
    if deepest is None:
        return None

    async def branching(row: AnyRow) -> Found | None:
        return await _place(conn, row, messages, hashes, created=False, named=False)

    return await _lock_and_place(conn, deepest, branching)


async def _prompt_changed(
    conn: AsyncConnection,
    tenant_id: int,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
    hashes: Sequence[str],
) -> Found | None:
    """The conversation the history resends under another system prompt
    (`memory.write.system_prompts`), locked; else None."""
    for candidate in await system_prompts.candidates(
        conn, tenant_id=tenant_id, user=user, messages=messages
    ):
        head = candidate.head_hash
        start = system_prompts.start_after(messages, hashes, parent=candidate.parent, head=head)
        if start is None:
            continue

        async def extending(row: AnyRow, start: int = start, head: str = head) -> Found | None:
            # Another request may have moved the head while this one waited for the lock.
            return _extends(row, start, created=False) if row.head_hash == head else None

        found = await _lock_and_place(conn, candidate.conversation_id, extending)
        if found is not None:
            return found
    return None


async def _rewritten(
    conn: AsyncConnection,
    tenant_id: int,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
    hashes: Sequence[str],
) -> Found | None:
    """The conversation whose head is the history's last assistant message, a reply the
    gateway recorded, and whose first message is the history's, when the client rewrote its
    own messages (`memory.write.rewritten`), locked; else None."""

    async def branching(row: AnyRow) -> Found | None:
        # Another request may have moved the head while this one waited for the lock.
        if not await rewritten.continues_head(conn, row, messages, calls=True):
            return None
        window = await windows.place(conn, row, messages, named=False)
        if window is not None:  # not rewritten: trimmed (`memory.write.windows`)
            return _window(row, window, created=False)
        if rewritten.last_reply(messages) is None:  # tied by its tool calls: a window only
            return None
        # The opening shared too: a reply alike ("Sure!") ends chats that share nothing else.
        path = await _path(conn, row.id, hashes)
        return _branch(row, path, hashes, created=False) if path else None

    found = await rewritten.candidates(conn, tenant_id=tenant_id, user=user, messages=messages)
    return await _first_placed(conn, found, branching)


async def _window_onto(
    conn: AsyncConnection,
    tenant_id: int,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
) -> Found | None:
    """The conversation the history is a window onto that leaves its branch before the head
    (`windows.candidates`), locked; else None. Without it, a window retried, regenerated or
    edited once its answer was recorded started a new conversation holding the window again."""

    async def onto(row: AnyRow) -> Found | None:
        window = await windows.place(conn, row, messages, named=False)
        return None if window is None else _window(row, window, created=False)

    found = await windows.candidates(conn, tenant_id=tenant_id, user=user, messages=messages)
    return await _first_placed(conn, found, onto)


async def _first_placed(
    conn: AsyncConnection,
    conversation_ids: Sequence[int],
    place: Callable[[AnyRow], Awaitable[Found | None]],
) -> Found | None:
    """Where the history goes in the first of the candidate conversations it belongs to
    (`_lock_and_place`), that one locked; None when it belongs to none."""
    for conversation_id in conversation_ids:
        found = await _lock_and_place(conn, conversation_id, place)
        if found is not None:
            return found
    return None


async def _lock_and_place(
    conn: AsyncConnection,
    conversation_id: int,
    place: Callable[[AnyRow], Awaitable[Found | None]],
) -> Found | None:
    """Where the history goes in a candidate conversation once it is locked (`place`); None,
    with its lock let go, when the history does not belong to it."""
    # The lock goes with the savepoint: held while this request waits for the opening lock, it
    # deadlocked with the request holding that lock and locking the same candidate (64 clients
    # sharing a system prompt: a third of their requests failed).
    candidate = await conn.begin_nested()
    locked = await conn.execute(_LOCK_BY_ID, {"id": conversation_id})
    found = await place(await _as_committed(conn, locked.one()))
    if found is None:
        await candidate.rollback()
    else:
        await candidate.commit()
    return found


def _opening_lock(tenant_id: int, first: str) -> int:
    digest = hashlib.sha256(f"{tenant_id}\n{first}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@dataclass(frozen=True)
class _Stored:
    """A stored message on the history's path."""

    seq: int
    role: str | None
    replied: bool
    current: bool


async def _place(
    conn: AsyncConnection,
    row: AnyRow,
    messages: Sequence[Mapping[str, Any]],
    hashes: Sequence[str],
    *,
    created: bool,
    named: bool = True,
) -> Found | None:
    """Where `messages` go in the locked conversation `row`; None when they do not belong
    to it (only without a conversation id: `named` False)."""
    head = row.head_hash
    if head is None:  # nothing stored yet
        return Found(row=row, start=0, created=created, whole=True)
    start = chains.after_head(hashes, head)
    if start is not None:
        return _extends(row, start, created=created)
    path = await _path(conn, row.id, hashes)
    if path and await _may_branch(conn, row.id, path):
        return _branch(row, path, hashes, created=created)
    window = await windows.place(conn, row, messages, named=named)
    if window is not None:
        return _window(row, window, created=created)
    if not named:
        # One under another system prompt is `_prompt_changed`'s to find.
        rewrote = await rewritten.continues_head(conn, row, messages)
        return _branch(row, path, hashes, created=created) if rewrote else None
    if system_prompts.resends(messages):
        parent = await system_prompts.parent_of(conn, row.id)
        start = system_prompts.start_after(messages, hashes, parent=parent, head=head)
        if start is not None:
            return _extends(row, start, created=created)
    if await rewritten.continues_head(conn, row, messages):
        return _branch(row, path, hashes, created=created)
    return _after_head(row, messages, created=created)


def _branch(row: AnyRow, path: Sequence[_Stored], hashes: Sequence[str], *, created: bool) -> Found:
    """The history continues the locked conversation `row` as a branch from the last message
    of `path` it shares with it (from the root when none)."""
    # The path is current up to the fork (a current message's ancestors are), then runs
    # through an abandoned branch, if at all.
    fork = next((i for i, node in enumerate(path) if not node.current), len(path)) - 1
    return Found(
        row=row,
        start=len(path),
        created=created,
        parent=hashes[len(path) - 1] if path else chains.ROOT_HASH,
        parent_seq=path[-1].seq if path else None,
        branch=Branch(
            fork_seq=path[fork].seq if fork >= 0 else None,
            restore=tuple(node.seq for node in path[fork + 1 :]),
        ),
        whole=True,
    )


def _extends(row: AnyRow, start: int, *, created: bool) -> Found:
    """A resent history that holds the head of the locked conversation `row`, its new
    messages from `start` on."""
    return Found(
        row=row,
        start=start,
        created=created,
        parent=row.head_hash,
        parent_seq=row.head_seq,
        whole=True,
    )


def _window(row: AnyRow, window: windows.Window, *, created: bool) -> Found:
    """A history that is a window onto the current branch of the locked conversation `row`
    (`memory.write.windows`): the client's whole view of it."""
    if window.fork is None:
        parent, parent_seq, branch = row.head_hash, row.head_seq, None
    else:  # the head's request again (a retry: `memory.write.retries`), or an edit
        (parent, parent_seq), branch = window.fork, Branch(fork_seq=window.fork[1])
    return Found(
        row=row,
        start=window.start,
        created=created,
        parent=parent,
        parent_seq=parent_seq,
        branch=branch,
        whole=True,
    )


def _after_head(row: AnyRow, messages: Sequence[Mapping[str, Any]], *, created: bool) -> Found:
    """`messages` as new messages only, after the head of the locked conversation `row`."""
    if row.head_hash is None:
        return Found(row=row, start=0, created=created, whole=True)
    start = system_prompts.repeated(row.system_hash, messages)
    return Found(
        row=row,
        start=start,
        created=created,
        parent=row.head_hash,
        parent_seq=row.head_seq,
        system_prompt=max(0, system_prompts.opening(messages) - start),
    )


async def _path(
    conn: AsyncConnection, conversation_id: int, hashes: Sequence[str]
) -> list[_Stored]:
    """The stored messages of the conversation that the history begins with, in order."""
    if not hashes:
        return []
    rows = await conn.execute(_PATH, {"conversation_id": conversation_id, "chain": list(hashes)})
    by_hash: dict[str, _Stored] = {}
    for found in rows:
        stored = _Stored(
            seq=found.seq, role=found.role, replied=found.replied, current=found.current
        )
        # The same path stored twice (data older than branches): the current copy wins.
        if found.chain_hash not in by_hash or stored.current:
            by_hash[found.chain_hash] = stored
    path: list[_Stored] = []
    for digest in hashes:
        if digest not in by_hash:
            break
        path.append(by_hash[digest])
    return path


async def _may_branch(conn: AsyncConnection, conversation_id: int, path: Sequence[_Stored]) -> bool:
    """Whether a history that shares `path` with the conversation, then leaves it, is a branch
    of it (see the module docstring)."""
    if any(node.role == "assistant" and node.replied for node in path):
        return True
    last = path[-1]
    if not last.current or not any(node.role == "user" for node in path):
        return False
    after = (
        select(nodes.c.seq)
        .where(
            nodes.c.conversation_id == conversation_id,
            nodes.c.level == 0,
            nodes.c.superseded_at.is_(None),
            nodes.c.seq > last.seq,
        )
        .order_by(nodes.c.seq)
    )
    users = list(await conn.scalars(after.where(nodes.c.role == "user").limit(2)))
    if not users:
        return True
    return len(users) == 1 and users[0] == await conn.scalar(after.limit(1))
