"""Recording a reply: in one statement while the conversation is as its turn left it.

Every chat request records its reply, and a non-stream answer waits for it. A reply usually
goes right after the message its turn's prompt ended with (`ReplyTo`), still the head:
`memory.write.appends.at_head` then stores it, counts the request and queues the build and the
next turn's preparation in one statement. When the head moved meanwhile (a retry's reply, a
concurrent turn, a branch moved), `store.append` records it in the same transaction, placing
it as it always has (`memory.write.branches.place_reply`).
"""

from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from memory.write import appends, store
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
) -> None:
    """Store `reply`, the answer `model` gave to the turn `reply_to` stored, and count what its
    request cost (`request`), as `store.append` would, in the caller's transaction."""
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
            return
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
