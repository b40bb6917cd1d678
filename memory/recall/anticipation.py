"""Anticipatory recall (Cognitive Workspace): the next turn's likely recall, prepared after each
reply, before the turn comes.

`prepare()` runs in the background after a reply to a prompt built from the working context
(`memory.write.appends.CONTEXT_JOB`): it embeds the latest exchange (the last user message and
what followed it) and retrieves the messages it calls for, outside the working context's
verbatim turns, by hybrid retrieval; it stores their ids, the exchange's vector and the seq of
its last message beside the working context (`working_contexts.recall_*`).

At request time `usable()` decides whether those candidates stand in for retrieval: they must
have been prepared from the messages just before the turn's new ones (anything stored since, or
a rebuilt context, makes them stale) and the new message must be about what the exchange was
about (cosine similarity of their vectors of at least `COVERS`). Otherwise the turn retrieves as
it would have without them. The request path never waits for `prepare()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import numpy as np
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from memory import tokens
from memory.db import transaction
from memory.embeddings import Embedder
from memory.errors import ProviderError
from memory.recall import fusion, retrieval
from memory.recall.recall_note import related_conversations, search_legs
from memory.recall.working_context import State, load
from memory.schema import conversations, working_contexts
from memory.write import chains

__all__ = ["CANDIDATES", "COVERS", "fresh", "prepare", "usable"]

COVERS: Final = 0.3
"""Cosine similarity between the new message and the exchange the candidates were prepared for
at which the candidates cover it (all-MiniLM-L6-v2: paraphrases and follow-ups on one subject
score above, a change of subject below)."""
CANDIDATES: Final = 200
"""Candidates kept: several times what a note holds."""
EXCHANGE_CHARS: Final = 2000

_EXCHANGE = text(
    "SELECT seq, role, content FROM nodes WHERE tenant_id = :tenant_id "
    "AND conversation_id = :conversation_id AND level = 0 AND seq < :end "
    "AND superseded_at IS NULL AND NOT system_prompt ORDER BY seq DESC LIMIT 8"
)


def fresh(state: State, *, first_seq: int) -> bool:
    """Whether candidates were prepared from the exchange just before a turn whose new messages
    start at `first_seq` (anything stored since makes them stale)."""
    return (
        state.recall_vector is not None
        and bool(state.recall_ids)
        and state.recall_after == first_seq - 1
    )


def usable(state: State, *, first_seq: int, vector: Sequence[float] | None) -> bool:
    """Whether the candidates prepared for `state` cover a turn whose new messages start at
    `first_seq` and whose query embeds to `vector` (see the module docstring)."""
    if vector is None or state.recall_vector is None or not fresh(state, first_seq=first_seq):
        return False
    a = np.asarray(vector, dtype=np.float32)
    b = np.asarray(state.recall_vector, dtype=np.float32)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return norms > 0 and float(a @ b) / norms >= COVERS


async def prepare(
    engine: AsyncEngine,
    embedder: Embedder,
    *,
    tenant_id: int,
    conversation_id: int,
    cross_conversation: bool,
    abandoned: bool = False,
) -> bool:
    """Prepare the next turn's candidates of a conversation with a working context; True if
    stored (False: no context, nothing new since the last preparation, or the embedder failed).
    Idempotent."""
    async with transaction(engine) as conn:
        state = await load(conn, tenant_id=tenant_id, conversation_id=conversation_id)
        if state is None:
            return False
        row = (
            await conn.execute(
                select(conversations.c.next_seq, conversations.c.user_id).where(
                    conversations.c.id == conversation_id
                )
            )
        ).one()
        after = int(row.next_seq) - 1
        if state.recall_after == after:
            return False
        exchange = list(
            await conn.execute(
                _EXCHANGE,
                {"tenant_id": tenant_id, "conversation_id": conversation_id, "end": after + 1},
            )
        )
        related = (
            await related_conversations(
                conn, tenant_id=tenant_id, conversation_id=conversation_id, user=row.user_id
            )
            if cross_conversation
            else []
        )
    query = _query(exchange)
    if not query:
        return False
    try:
        [vector] = await embedder.embed([query])
    except ProviderError:
        return False
    scope = [conversation_id, *related]
    async with transaction(engine) as conn:
        exclude = (conversation_id, state.verbatim_from)
        legs = await search_legs(
            conn,
            tenant_id=tenant_id,
            conversation_ids=scope,
            query=query,
            vector=vector,
            exclude=exclude,
            newest=after,
            abandoned=abandoned,
            pool=retrieval.CANDIDATES,
        )
        scores = fusion.fuse(
            legs,
            which=retrieval.route(query),
            newest={conversation_id: after},
            primary=conversation_id,
            exclude_from=exclude,
        )
        hits = await retrieval.load(
            conn, tenant_id=tenant_id, scores=scores, limit=CANDIDATES, abandoned=abandoned
        )
        await conn.execute(
            update(working_contexts)
            .where(working_contexts.c.conversation_id == conversation_id)
            .values(
                recall_after=after,
                recall_vector=vector,
                recall_ids=[hit.node_id for hit in hits],
            )
        )
    return True


def _query(rows: Sequence[object]) -> str:
    """The latest exchange's text, newest last: the last user message and what followed it."""
    kept: list[str] = []
    for row in rows:  # newest first
        if getattr(row, "role", None) in chains.SYSTEM_ROLES:
            break
        body = tokens.message_text({"content": getattr(row, "content", None)})
        if body:
            kept.append(body)
        if getattr(row, "role", None) == "user":
            break
    return "\n".join(reversed(kept))[-EXCHANGE_CHARS:]
