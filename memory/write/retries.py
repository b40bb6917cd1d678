"""Telling a retry from a new request (`identity.identify` asks `as_retry` once it has found
where a history goes).

A request is known by its `RequestKey`: the client's `Idempotency-Key`, else the
sha256 of its body's JSON. It repeats an earlier request of the conversation (`Found.retry`:
nothing of it is stored and nothing branches; its answer may take the first's place,
`memory.write.replies`) when it carries the same `Idempotency-Key` within the
window, or, without one, when its body is the same JSON as that of the request the
conversation's head came from and either it resends the whole history, or that request is
still unanswered, or the client says it is retrying (`X-Stainless-Retry-Count`, sent by the
OpenAI SDKs), or its new messages hold tool results (a call is answered once). A client that
sends only its new messages may say the same thing twice on purpose ("continue"): that is not
taken for a retry on its bytes alone. A retry of a request whose answer was cut (a stream cut:
the reply stored incomplete, still the head) moves the current branch back before that answer
(`Found.branch`), so the retry's answer takes its place.
"""

import hashlib
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.db import AnyRow
from memory.schema import nodes
from memory.write import chains
from memory.write.placement import Branch, Found

DEFAULT_WINDOW: Final = timedelta(hours=24)
"""How long an `Idempotency-Key` names the request that first carried it."""


@dataclass(frozen=True)
class RequestKey:
    """What tells a retry from a new request (see the module docstring)."""

    value: str
    """`key:` and the sha256 of the client's `Idempotency-Key`, else `body:` and the sha256 of
    the body's JSON (keys sorted: the same JSON however a client spaces or orders it)."""
    explicit: bool
    """The client named the request (`Idempotency-Key`)."""
    retrying: bool = False
    """The client says this is a retry of a request it sent."""

    @classmethod
    def of(cls, *, body: Any, idempotency_key: str | None, retry_count: str | None) -> "RequestKey":
        """The key of a request with this JSON `body` and these header values."""
        retrying = retry_count is not None and retry_count.strip() not in ("", "0")
        if idempotency_key:
            digest = hashlib.sha256(idempotency_key.encode()).hexdigest()
            return cls(value=f"key:{digest}", explicit=True, retrying=retrying)
        digest = hashlib.sha256(chains.canonical_json(body)).hexdigest()
        return cls(value=f"body:{digest}", explicit=False, retrying=retrying)


async def as_retry(
    conn: AsyncConnection,
    found: Found,
    count: int,
    request: RequestKey,
    window: timedelta,
    *,
    results: bool = False,
) -> Found | None:
    """`found` as a retry when the request repeats an earlier one (module docstring);
    `results`: its new messages hold tool results."""
    conversation_id = found.row.id
    if found.whole and found.start < count:
        return None  # new messages after a resent history: not what was sent before
    if not request.explicit:
        row = found.row
        if row.head_request is None or row.head_request != request.value:
            return None
        if not found.whole and row.head_replied and not (request.retrying or results):
            return None
    if found.whole:  # the resent history ends where the first request's did
        if (
            request.explicit
            and await _sent_with(conn, conversation_id, request.value, window) is None
        ):
            return None
        return await _past_cut(
            conn, replace(found, start=count, branch=None, retry=True), request.value
        )
    earlier = await _sent_with(
        conn, conversation_id, request.value, window if request.explicit else None
    )
    if earlier is None or earlier.replied:
        return None  # the first stored no message of its own to answer again
    return await _past_cut(
        conn,
        replace(
            found,
            start=count,
            branch=None,
            retry=True,
            parent=earlier.chain_hash,
            parent_seq=earlier.seq,
        ),
        request.value,
    )


async def _past_cut(conn: AsyncConnection, retry: Found, key: str) -> Found:
    """`retry`, branching back to the message it answers when the head is an answer to the
    same request (`key`) that was cut (stored incomplete) right after that message: its reply
    then replaces the cut one, which was dropped as the first answer already recorded."""
    row = retry.row
    if not row.head_replied or row.head_request != key:
        return retry
    head = (
        await conn.execute(
            select(nodes.c.status, nodes.c.follows_seq).where(
                nodes.c.conversation_id == row.id, nodes.c.level == 0, nodes.c.seq == row.head_seq
            )
        )
    ).one()
    follows = row.head_seq - 1 if head.follows_seq is None else head.follows_seq
    answers = -1 if retry.parent_seq is None else retry.parent_seq
    if head.status != "incomplete" or follows != answers:
        return retry
    return replace(retry, branch=Branch(fork_seq=retry.parent_seq))


async def _sent_with(
    conn: AsyncConnection, conversation_id: int, key: str, window: timedelta | None = None
) -> AnyRow | None:
    """The last message a request with `key` stored (its reply only if it stored nothing
    else), within `window` when given."""
    query = select(
        nodes.c.seq, nodes.c.chain_hash, nodes.c.model.is_not(None).label("replied")
    ).where(
        nodes.c.conversation_id == conversation_id,
        nodes.c.level == 0,
        nodes.c.request_key == key,
    )
    if window is not None:
        query = query.where(nodes.c.created_at > func.now() - window)
    return (
        await conn.execute(query.order_by(nodes.c.model.is_not(None), nodes.c.seq.desc()).limit(1))
    ).one_or_none()
