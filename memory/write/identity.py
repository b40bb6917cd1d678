"""Which conversation a request belongs to: conversation ids and message hash chains.

A message's chain hash is sha256 over its parent's chain hash and the message's identity
(role, name, content, tool calls, tool_call_id) in canonical JSON, so the hash of the last
message stands for the whole history before it. A conversation stores the hash of its newest
message (`head_hash`); an incoming history that contains that hash extends the conversation,
and only the messages after it are new. Fields a client may add or drop when it resends a
message it received (`refusal`, `annotations`, `audio`, a null `content` vs ``""``) are left
out of the hash so that resending the SDK's own objects still matches.

`content_hash(content)` fingerprints a message's content alone: a conversation keeps the one of
its newest system prompt (`system_hash`) to recognise a client that repeats it.

`identify` is the first step of the request path: it finds the conversation an incoming history
belongs to (by the client's conversation id, else by its hash chain), creates it when there is
none, and locks its row (`FOR UPDATE`) until the caller's transaction ends, so that concurrent
requests on one conversation store their messages one after the other (`memory.write.store`).
"""

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, bindparam, func, insert, literal_column, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.db import AnyRow
from memory.errors import InvalidConversationId
from memory.schema import conversations

CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9._:-]*[A-Za-z0-9_:-][A-Za-z0-9._:-]*$"
"""Characters of A-Za-z0-9._:-, not dots alone (`.` and `..` name folders in paths and URLs)."""
CONVERSATION_ID_MAX = 128
_CONVERSATION_ID = re.compile(CONVERSATION_ID_PATTERN)
ROOT_HASH = ""
_SYSTEM_ROLES = ("system", "developer")


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


def _identity(message: Mapping[str, Any]) -> dict[str, Any]:
    tool_calls = [
        {
            "id": call.get("id"),
            "name": (call.get("function") or {}).get("name"),
            "arguments": (call.get("function") or {}).get("arguments"),
        }
        for call in message.get("tool_calls") or []
    ]
    return {
        "role": message.get("role"),
        "name": message.get("name"),
        "content": message.get("content") or "",
        "tool_calls": tool_calls,
        "tool_call_id": message.get("tool_call_id"),
    }


def content_hash(content: Any) -> str:
    """A fingerprint of a message's content (a string or a list of parts)."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def chain_hash(parent: str, message: Mapping[str, Any]) -> str:
    """The chain hash of `message` following a message whose chain hash is `parent`."""
    canonical = json.dumps(_identity(message), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{parent}\n{canonical}".encode()).hexdigest()


def chain(messages: Sequence[Mapping[str, Any]], parent: str = ROOT_HASH) -> list[str]:
    """Chain hashes of `messages`, the first one following `parent`."""
    hashes: list[str] = []
    for message in messages:
        parent = chain_hash(parent, message)
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Found:
    """The conversation a history belongs to, locked until the transaction ends."""

    row: AnyRow
    """The conversation's row as locked (`memory.schema.conversations`)."""
    start: int
    """Where the history's new messages start."""
    created: bool


async def identify(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    external_id: str | None,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
) -> Found:
    """The conversation `messages` belongs to, and where its new messages start.

    With `external_id`, that conversation (created if new): the messages after its stored chain
    are new; a history that does not contain its chain is taken as new messages only (a repeated
    system prompt aside). Without it, the conversation whose whole chain is the longest prefix
    of `messages` (of the same `user`), or a new one."""
    hashes = chain(messages)
    if external_id is None:
        return await _match_prefix(conn, tenant_id=tenant_id, user=user, hashes=hashes)
    found = await lock_or_create(conn, tenant_id=tenant_id, external_id=external_id, user=user)
    start = after_head(hashes, found.row.head_hash)
    if start is None:
        start = _repeated_system(found.row.system_hash, messages)
    return Found(row=found.row, start=start, created=found.created)


async def lock_or_create(
    conn: AsyncConnection, *, tenant_id: int, external_id: str, user: str | None
) -> Found:
    """The conversation `external_id`, created if missing, locked (`start` is 0)."""
    # One statement: the conflicting update is a no-op that locks the existing row (a new one
    # is ours until commit); `xmax` is 0 only on a row this statement inserted.
    statement = pg_insert(conversations).values(
        tenant_id=tenant_id, external_id=external_id, user_id=user
    )
    row = (
        await conn.execute(
            statement.on_conflict_do_update(
                constraint="uq_conversations_tenant_external",
                set_={"external_id": statement.excluded.external_id},
            ).returning(*conversations.c, literal_column("xmax = 0").label("inserted"))
        )
    ).one()
    return Found(row=row, start=0, created=bool(row.inserted))


def after_head(hashes: Sequence[str], head: str | None) -> int | None:
    """Where the new messages start, or None when the history does not contain the head."""
    if head is None:
        return 0
    try:
        return hashes.index(head) + 1
    except ValueError:
        return None


def _repeated_system(system_hash: str | None, messages: Sequence[Mapping[str, Any]]) -> int:
    """Clients that send only new turns usually repeat their system prompt: store it once
    (1 to skip it, when it is the conversation's newest stored system prompt)."""
    if system_hash is None or not messages:
        return 0
    first = messages[0]
    if first.get("role") not in _SYSTEM_ROLES:
        return 0
    return 1 if content_hash(first.get("content")) == system_hash else 0


# Built once: the request path runs it on every request without a conversation id.
_CHAIN = bindparam("chain", type_=ARRAY(Text))
# The conversation whose head is latest in the history. Locked as found: a candidate that
# another request extended meanwhile is read again after the lock, and skipped if its new head
# is not in this history (the next candidate is taken).
_LOCK_BY_PREFIX = (
    select(conversations)
    .where(
        conversations.c.tenant_id == bindparam("tenant_id"),
        conversations.c.head_hash == func.any(_CHAIN),
        conversations.c.user_id.is_not_distinct_from(bindparam("user", type_=Text)),
    )
    .order_by(
        func.array_position(_CHAIN, conversations.c.head_hash).desc(),
        conversations.c.updated_at.desc(),
    )
    .limit(1)
    .with_for_update()
)


async def _match_prefix(
    conn: AsyncConnection, *, tenant_id: int, user: str | None, hashes: Sequence[str]
) -> Found:
    row = (
        await conn.execute(
            _LOCK_BY_PREFIX, {"tenant_id": tenant_id, "chain": list(hashes), "user": user}
        )
    ).one_or_none()
    if row is not None:
        return Found(row=row, start=hashes.index(row.head_hash) + 1, created=False)
    row = (
        await conn.execute(
            insert(conversations)
            .values(tenant_id=tenant_id, external_id=new_conversation_id(), user_id=user)
            .returning(*conversations.c)
        )
    ).one()
    return Found(row=row, start=0, created=True)
