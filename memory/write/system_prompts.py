"""How a history's system prompt is told apart from its turns, so that the conversation is
found whatever the client does with it.

**Repeated** (`repeated`). A client that sends only its new messages usually repeats its system
prompt each time: it is stored once, skipped when it is the conversation's newest stored one.

**Replaced** (`placement.Found.system_prompt`). Such a client's system prompt that differs (the
time in it, new `instructions` with `previous_response_id`) is the conversation's system prompt
now, not a turn: it is stored marked (`nodes.system_prompt`), and no prompt carries it among
the history's turns (`store.history`, the working context's verbatim turns). The prompt leads
with the request's own system prompt, or, for a request without one, with the latest stored
(`store.latest_system_prompt`). Before, each was a turn, and every later prompt carried them all.
A system message within a resent history stays a turn.

**Changed** (`start_after`). Chain hashes (`memory.write.chains`) chain the system prompt in,
so a client that puts the time or the user's settings in its system prompt, and resends the
whole history each turn, matched no stored message: every turn started a new conversation
holding the whole history again (with a conversation id, the whole history was appended again
as new messages). Such a history is recognised by its turns alone: its messages after its
leading system ones, chained after the conversation's own system prompt (`Candidate.parent`,
the chain hash of its last leading system message, or the root), hold the conversation's head.
Without a conversation id, only the tenant's `CANDIDATES` latest conversations of the same
`user` are tried, and only those holding a reply the gateway recorded (proof the client saw
them: a new chat that merely opens like an old one is not taken for one). The changed system
prompt is not stored as a message (the prompt leads with the request's own), so the next turn
is recognised alike.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.write import chains

CANDIDATES: Final = 8
"""How many of a user's latest conversations a history without a conversation id is tried
against."""


# The chain hash a conversation's turns follow: its current branch's last leading system
# message's, else the root ('').
_PARENT = """
COALESCE((
    SELECT s.chain_hash FROM nodes s
    WHERE s.conversation_id = c.id AND s.level = 0 AND s.superseded_at IS NULL
      AND s.role IN ('system', 'developer')
      AND NOT EXISTS (
          SELECT 1 FROM nodes t
          WHERE t.conversation_id = c.id AND t.level = 0 AND t.superseded_at IS NULL
            AND t.seq < s.seq AND t.role NOT IN ('system', 'developer'))
    ORDER BY s.seq DESC LIMIT 1), '')
"""
_OF_ONE = text(f"SELECT {_PARENT} AS parent FROM conversations c WHERE c.id = :id")
_LATEST = text(
    f"""
SELECT c.id, c.head_hash, {_PARENT} AS parent
FROM conversations c
WHERE c.tenant_id = :tenant_id AND c.user_id IS NOT DISTINCT FROM :user
  AND c.head_hash IS NOT NULL
  AND EXISTS (
      SELECT 1 FROM nodes r
      WHERE r.conversation_id = c.id AND r.level = 0 AND r.superseded_at IS NULL
        AND r.model IS NOT NULL)
ORDER BY c.updated_at DESC
LIMIT :limit
"""
)


@dataclass(frozen=True)
class Candidate:
    """A conversation a history may continue under another system prompt."""

    conversation_id: int
    head_hash: str
    parent: str


def repeated(system_hash: str | None, messages: Sequence[Mapping[str, Any]]) -> int:
    """How many of `messages` to skip as a repeated system prompt: 1 when the first is the
    conversation's newest stored system prompt (`system_hash`), else 0."""
    if system_hash is None or not messages:
        return 0
    first = messages[0]
    if first.get("role") not in chains.SYSTEM_ROLES:
        return 0
    return 1 if chains.content_hash(first.get("content")) == system_hash else 0


def opening(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many system (or developer) messages the history starts with."""
    return next(
        (i for i, message in enumerate(messages) if message.get("role") not in chains.SYSTEM_ROLES),
        len(messages),
    )


def start_after(
    messages: Sequence[Mapping[str, Any]], hashes: Sequence[str], *, parent: str, head: str
) -> int | None:
    """Where `messages`' new messages start when their turns, chained after `parent`, hold
    `head`; None when they do not, or when their own system prompt is that one (`hashes`, the
    history's own chain, then holds the head already if it holds it at all)."""
    first = opening(messages)
    if first == 0 or first == len(messages) or hashes[first - 1] == parent:
        return None
    found = chains.after_head(chains.chain(messages[first:], parent), head)
    return None if found is None else first + found


def resends(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the history may be a resent one: it holds an assistant message after its
    system prompt, which it has (a client sending only new messages holds none)."""
    first = opening(messages)
    return first > 0 and any(m.get("role") == "assistant" for m in messages[first:])


async def parent_of(conn: AsyncConnection, conversation_id: int) -> str:
    """The chain hash the conversation's turns follow (`Candidate.parent`)."""
    return str(await conn.scalar(_OF_ONE, {"id": conversation_id}))


async def candidates(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
) -> list[Candidate]:
    """The conversations a history without a conversation id may continue under another
    system prompt: none unless it holds an assistant message after its system prompt."""
    if not resends(messages):
        return []
    rows = await conn.execute(_LATEST, {"tenant_id": tenant_id, "user": user, "limit": CANDIDATES})
    return [Candidate(row.id, row.head_hash, row.parent) for row in rows]
