"""A history whose own messages the client rewrote, found by the gateway's reply it continues.

Chain hashes (`memory.write.chains`) name a message by the whole path before it, so a client
that changes a message it sent earlier leaves the stored path there. Two common ways of sending
retrieved context do so on every turn:

* a context message (system or user) inserted right before the newest question, and left out
  of the history the next turn sends;
* the newest question sent with the context written into it, and kept without it.

Every turn's history then left the stored path at its first such message. Without a
conversation id, a history that leaves before any reply the gateway recorded is not taken for
a branch (a new chat may open like an old one), so each turn started a new conversation holding
the whole history again; with one, the whole history was appended after the head as new
messages, each turn, all on the current branch.

What such a history keeps is the gateway's own last reply: its last assistant message is the
conversation's head, a reply the gateway recorded (`continues_head`). That is proof the client
saw this conversation, as a recorded reply on the shared path is: the history branches from
the last message it shares with it (`memory.write.identity`), so the current branch is again
exactly what the client sent. Without a conversation id, the user's latest conversations are
the ones tried (`candidates`), as many as for a changed system prompt
(`system_prompts.CANDIDATES`), and only one whose first message is the history's is taken: a
short reply ("Sure!") may end chats that share nothing else. The same candidates serve a
history trimmed to its latest turns (`memory.write.windows`), whose last assistant message may
be a tool call without text: that one is found by its calls' ids, and taken only as a window.
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.db import AnyRow
from memory.text import escape_unstorable
from memory.write import chains
from memory.write.system_prompts import CANDIDATES

_HEAD = """
    h.conversation_id = c.id AND h.level = 0 AND h.seq = c.head_seq AND h.superseded_at IS NULL
"""
# A recorded reply's content as it is stored: a JSON string (escaped where Postgres cannot
# hold the text, as `memory.write.appends.node_row` stores it); or its tool calls, named by
# their ids (`:calls`, `[{"id": ...}]`), which an upstream makes unique.
_REPLY_IS = """
    h.role = 'assistant' AND h.model IS NOT NULL
    AND (h.content = CAST(:reply AS jsonb) OR h.tool_calls @> CAST(:calls AS jsonb))
"""
_CONTINUES = text(
    "SELECT EXISTS (SELECT 1 FROM conversations c"
    f" JOIN nodes h ON {_HEAD} AND {_REPLY_IS} WHERE c.id = :id)"
)
LATEST_WITH_HEAD = f"""
SELECT c.id
FROM (SELECT id, head_seq, updated_at FROM conversations
      WHERE tenant_id = :tenant_id AND user_id IS NOT DISTINCT FROM :user
        AND head_seq IS NOT NULL
      ORDER BY updated_at DESC LIMIT :limit) AS c
JOIN nodes h ON {_HEAD} AND ({{head}})
ORDER BY c.updated_at DESC
"""
"""The ids of the user's latest conversations (`CANDIDATES` of them, newest first) whose head
message, `h`, meets the condition put in for `{head}`."""
_LATEST = text(LATEST_WITH_HEAD.format(head=_REPLY_IS))


def last_reply(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The JSON of the history's last assistant message's text, as a recorded reply's content
    is stored; None when it has no assistant message or that one has no text (a tool call)."""
    said = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    content = None if said is None else chains.canonical_content(said.get("content"))
    if not isinstance(content, str) or not content:
        return None
    stored, _ = escape_unstorable(content)
    return json.dumps(stored)


def _head_of(messages: Sequence[Mapping[str, Any]], *, calls: bool) -> dict[str, Any] | None:
    """`_REPLY_IS`'s parameters for the history's last assistant message: its text and, with
    `calls`, the ids of its tool calls; None when neither is there."""
    reply = last_reply(messages)
    said = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    ids = [
        call["id"]
        for call in (said.get("tool_calls") or [] if calls and said is not None else [])
        if isinstance(call, Mapping) and isinstance(call.get("id"), str) and call["id"]
    ]
    if reply is None and not ids:
        return None
    return {"reply": reply, "calls": json.dumps([{"id": id_} for id_ in ids]) if ids else None}


async def continues_head(
    conn: AsyncConnection,
    row: AnyRow,
    messages: Sequence[Mapping[str, Any]],
    *,
    calls: bool = False,
) -> bool:
    """Whether the history's last assistant message is the head of the conversation `row`, a
    reply the gateway recorded: by its text, or with `calls` by its tool calls' ids too."""
    head = _head_of(messages, calls=calls)
    if head is None or row.head_seq is None:
        return False
    return bool(await conn.scalar(_CONTINUES, {"id": row.id, **head}))


async def candidates(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
) -> list[int]:
    """The ids of the user's latest conversations (`CANDIDATES`, newest first) whose head is
    a reply the gateway recorded and the history's last assistant message (by its text, or by
    its tool calls' ids: an agent's window that ends in a tool exchange,
    `memory.write.windows`)."""
    head = _head_of(messages, calls=True)
    if head is None:
        return []
    return await latest_with_head(conn, _LATEST, tenant_id=tenant_id, user=user, **head)


async def latest_with_head(
    conn: AsyncConnection, query: TextClause, *, tenant_id: int, user: str | None, **params: Any
) -> list[int]:
    """The conversation ids `query`, a `LATEST_WITH_HEAD`, finds with `params`."""
    rows = await conn.execute(
        query, {"tenant_id": tenant_id, "user": user, "limit": CANDIDATES, **params}
    )
    return [row.id for row in rows]
