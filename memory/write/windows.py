"""A history that is a window onto its conversation: the client sent only its latest turns.

Clients trim what they resend to fit a model's window: the system prompt and the last N
messages (LangChain's `trim_messages`, a chat app's "keep the last 20"). Chain hashes
(`memory.write.chains`) name a message by the whole path before it, so a trimmed history
shares no stored path past its system prompt, and its last assistant message, the gateway's
own reply, made it look like a client that rewrote its messages (`memory.write.rewritten`):
each turn branched from the opening, superseding the whole conversation (and the summaries
over it) to store the window again. Ten turns in a window of six stored 56 messages, and the
current branch held only the last window.

A window is told apart by what it shares with the current branch: its turns (the messages
after its system prompt) begin with the branch's last messages, in order, up to its head (a
user message, a tool call or a tool result among them, unless the client named the
conversation: `_ties`); what follows the head is new. A window that ends with the message
before the head resends the head's request: a retry, or its answer regenerated.
`place` says where its new messages go, checking each place the head could sit by the chain
hashes the window's turns would have, had they followed the branch message before them. A
window is the client's whole view of the conversation (`Found.whole`): while the conversation
fits the budget, it goes upstream as the client sent it; past the budget, the prompt comes
from memory.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import tokens
from memory.db import AnyRow
from memory.schema import nodes
from memory.text import escape_unstorable
from memory.write import chains, rewritten, system_prompts

MAX_WINDOW: Final = 1000
"""Turns of a window compared with the branch at most: its start is within them."""

EDITS: Final = 24
"""Messages before the head a window may leave the branch at, at most: a question rewritten a
few exchanges back, or an agent's question after several rounds of parallel tool calls (each
round a call message, its results and, last, the answer: at 8, editing the question of two
rounds of two calls started a new conversation)."""

# A reply the gateway recorded, of one of the texts given, current among the branch's latest
# messages (by seq, a bound that branches make loose: `place` checks).
_NEAR_HEAD = text(
    rewritten.LATEST_WITH_HEAD.format(
        head="""EXISTS (
            SELECT 1 FROM nodes p
            WHERE p.conversation_id = h.conversation_id AND p.level = 0
              AND p.seq > h.seq - :reach AND p.seq <= h.seq AND p.superseded_at IS NULL
              AND p.role = 'assistant' AND p.model IS NOT NULL
              AND p.text = ANY(CAST(:texts AS text[])))"""
    )
)


@dataclass(frozen=True)
class Window:
    """Where a window's new messages go: from `start` on, after the head, or, for a window that
    leaves the branch before its head, after `fork` (the chain hash and seq of the last message
    it shares with the branch), where it branches: it resends the head's request (a retry, or
    its answer regenerated), or rewrote a message after the shared part (an edit)."""

    start: int
    fork: tuple[str, int] | None = None


async def place(
    conn: AsyncConnection, row: AnyRow, messages: Sequence[Mapping[str, Any]], *, named: bool
) -> Window | None:
    """Where `messages` go when it is a window onto the current branch of the locked
    conversation `row` (module docstring); None when it is not one. `named`: the client named
    the conversation, so a window may share the head alone with it (its last reply, then what
    is new); without a name, a user message or a tool exchange shared too tells it from a chat
    that merely ends alike ("Sure!")."""
    if row.head_hash is None or row.head_seq is None:
        return None
    opening = system_prompts.opening(messages)
    turns = messages[opening:][:MAX_WINDOW]
    if len(turns) < 2:  # one message: new after the head, or a retry (`memory.write.retries`)
        return None
    # The branch's last messages, newest first, as far back as the window could reach.
    tail = (
        await conn.execute(
            select(nodes.c.chain_hash, nodes.c.seq, nodes.c.model.is_not(None).label("replied"))
            .where(
                nodes.c.conversation_id == row.id,
                nodes.c.level == 0,
                nodes.c.superseded_at.is_(None),
                nodes.c.seq <= row.head_seq,
            )
            .order_by(nodes.c.seq.desc())
            .limit(len(turns) + 2 + EDITS)
        )
    ).all()
    hashes = [*(found.chain_hash for found in tail), chains.ROOT_HASH]

    def reaches(overlap: int, last: int) -> bool:
        """Whether the first `overlap` turns are the branch's messages up to `tail[last]`."""
        shared = turns[:overlap]
        return (
            overlap + last < len(hashes)
            and (named or any(_ties(message) for message in shared))
            and chains.chain_hash(hashes[last + 1], shared[-1]) == hashes[last]
            and chains.chain(shared, hashes[overlap + last])[-1] == hashes[last]
        )

    # The latest place first: a window ends with what is new.
    for end in reversed(range(len(turns))):
        if reaches(end + 1, 0):
            return Window(start=opening + end + 1)
    if len(tail) > 1 and reaches(len(turns), 1):
        return Window(start=len(messages), fork=(tail[1].chain_hash, tail[1].seq))
    # Left before the head: where what it shares holds a reply the gateway recorded (proof the
    # client saw this conversation, not a chat or a few-shot prompt that opens alike). A window
    # that holds the head went on past it: a client that rewrote its own earlier messages
    # (`memory.write.rewritten`), not an edit.
    if len(tail) > 1 and any(chains.chain_hash(hashes[1], turn) == hashes[0] for turn in turns):
        return None
    for last in range(1, min(len(tail), EDITS + 1)):
        for end in reversed(range(len(turns))):
            recorded = any(found.replied for found in tail[last : last + end + 1])
            if recorded and reaches(end + 1, last):
                return Window(start=opening + end + 1, fork=(tail[last].chain_hash, tail[last].seq))
    return None


def _ties(message: Mapping[str, Any]) -> bool:
    """Whether a message the window shares with the branch ties it to the conversation without
    a name: a user message, or a tool call or its result (by the call's id, which an upstream
    makes unique); an assistant's text alone may end chats that share nothing else."""
    return message.get("role") in ("user", "tool") or (
        message.get("role") == "assistant" and bool(message.get("tool_calls"))
    )


async def candidates(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    user: str | None,
    messages: Sequence[Mapping[str, Any]],
) -> list[int]:
    """The ids of the user's latest conversations, newest first, whose latest messages hold a
    reply the gateway recorded that the history holds too (by its text): those it may be a
    window onto that leaves the branch before its head (`place` says; such a window must share
    such a reply). A window that resends the head's request or rewrote a message holds nothing
    of the head, so the gateway's last reply (`memory.write.rewritten`) does not find it; a
    few-shot prompt, whose assistant messages the client wrote, finds nothing here."""
    opening = system_prompts.opening(messages)
    turns = messages[opening:][:MAX_WINDOW]
    said = [
        tokens.message_text(escape_unstorable(dict(message))[0])
        for message in turns
        if message.get("role") == "assistant"
    ]
    if len(turns) < 2 or not said:  # not a window (`place`)
        return []
    return await rewritten.latest_with_head(
        conn,
        _NEAR_HEAD,
        tenant_id=tenant_id,
        user=user,
        reach=4 * (len(turns) + 2 + EDITS),
        texts=said,
    )
