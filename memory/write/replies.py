"""Recording a reply: in one statement while the conversation is as its turn left it.

Every chat request records its reply, and a non-stream answer waits for it. A reply usually
goes right after the message its turn's prompt ended with (`ReplyTo`), still the head:
`memory.write.appends.at_head` then stores it, counts the request and queues the build and the
next turn's preparation in one statement. When the head moved meanwhile (a retry's reply, a
concurrent turn, a branch moved), `store.append` records it in the same transaction, placing
it as it always has (`memory.write.branches.place_reply`).

A retry's reply is the answer its client got; the first answer to the same request was lost on
its way (the reason for the retry). So when the first answer is recorded, still the head, and
the retry's differs from it (a model answers anew), the first leaves the current branch (kept,
as a refused turn's messages do: `memory.write.refusals`) and the retry's takes its place;
memory then holds what the client shows. The same answer again is not stored.
"""

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.schema import conversations, nodes
from memory.write import appends, chains, refusals, store
from memory.write.branches import ReplyTo


async def record(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    reply: Mapping[str, Any],
    model: str,
    status: str,
    request: appends.RequestStats,
    reply_to: ReplyTo | None,
) -> int | None:
    """Store `reply`, the answer `model` gave to the turn `reply_to` stored, and count what its
    request cost (`request`), as `store.append` would, in the caller's transaction. The seq of
    the first answer a retry's reply took the place of (module docstring), if it did."""
    replaced = None
    if reply_to is not None and reply_to.retry:
        replaced = await _replace_first(
            conn, tenant_id=tenant_id, conversation_id=conversation_id, reply=reply, retry=reply_to
        )
    if reply_to is not None and reply_to.parent_seq is not None:
        stored = await appends.at_head(
            conn,
            tenant_id=tenant_id,
            conversation_id=conversation_id,
            message=reply,
            after=(reply_to.parent, reply_to.parent_seq),
            model=model,
            status=status,
            request_key=reply_to.request_key,
            replied_by=model,
            request=request,
        )
        if stored is not None:
            return replaced
    await store.append(
        conn,
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        messages=[reply],
        model=model,
        status=status,
        request=request,
        reply_to=reply_to,
    )
    return replaced


async def _replace_first(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    reply: Mapping[str, Any],
    retry: ReplyTo,
) -> int | None:
    """Take the first answer to `retry`'s request off the current branch when it is the head,
    right after the message the retry answers, and not `reply` (by chain hash): its seq; else
    None, changing nothing."""
    head = (
        await conn.execute(
            select(
                conversations.c.head_hash,
                nodes.c.seq,
                nodes.c.follows_seq,
                nodes.c.chain_hash,
                nodes.c.request_key,
                nodes.c.model,
            )
            .join(nodes, nodes.c.conversation_id == conversations.c.id)
            .where(
                conversations.c.id == conversation_id,
                conversations.c.tenant_id == tenant_id,
                nodes.c.level == 0,
                nodes.c.seq == conversations.c.head_seq,
            )
        )
    ).one_or_none()
    if (
        head is None
        or retry.parent_seq is None
        or head.model is None
        or head.request_key != retry.request_key
        or (head.seq - 1 if head.follows_seq is None else head.follows_seq) != retry.parent_seq
        or head.chain_hash == chains.chain_hash(retry.parent, reply)
    ):
        return None
    withdrawn = await refusals.withdraw(
        conn,
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        first_seq=head.seq,
        head=ReplyTo(parent=head.head_hash, parent_seq=head.seq),
    )
    return head.seq if withdrawn else None
