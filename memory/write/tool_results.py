"""Tool results that continue the head: results must follow their call.

A client may resend the messages before a tool call with the call's results but without the
call itself (the Vercel AI SDK's `conversation` option resends the step's question so, and
every earlier step's results without their calls). Matched by their chain, those messages left
the stored path right before the call: the question was stored again between the call and its
results, an order chat completions refuse. `for_the_head` finds such results of the head's
calls (`memory.write.identity` asks it once it has placed a history) and has them continue the
head; what precedes them is the stored exchange, not new messages.
"""

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.write import chains
from memory.write.placement import Found

_BEFORE_HEAD = text(
    "SELECT seq, chain_hash, role, tool_calls FROM nodes WHERE conversation_id = :conversation_id "
    "AND level = 0 AND superseded_at IS NULL AND seq <= :head_seq ORDER BY seq DESC LIMIT :n"
)


async def for_the_head(
    conn: AsyncConnection, found: Found, messages: Sequence[Mapping[str, Any]]
) -> Found:
    """`found`, unless the new messages end with results of the head's tool calls that the
    history sends after the messages before that call but without it (the Vercel AI SDK's
    `conversation` option resends the step's question so, and every earlier step's results
    without their calls): results must follow their call, so they continue the head, and what
    precedes them is the stored exchange, not new messages."""
    row = found.row
    run = _last_results(messages, found.start)
    if run is None or row.head_hash is None or found.system_prompt:
        return found
    if run and messages[run - 1].get("role") == "assistant":
        return found  # its own call: a history in order
    if found.branch is None and found.start == run:
        return found  # the results alone, after the head
    if found.branch is not None and (found.start != run or found.branch.restore):
        return found
    # Each resent message may come without the call before it: read twice as many, and one.
    limit = 2 * (len(messages) - found.start) + 2
    rows = list(
        await conn.execute(
            _BEFORE_HEAD, {"conversation_id": row.id, "head_seq": row.head_seq, "n": limit}
        )
    )[::-1]
    head = rows[-1] if rows else None
    if head is None or head.chain_hash != row.head_hash:
        return found
    calls = {call.get("id") for call in (head.tool_calls or [])}
    first = next(
        (i for i in range(run, len(messages)) if messages[i].get("tool_call_id") in calls), None
    )
    if first is None:
        return found
    before = rows[:-1]
    index = _resent_start(messages[found.start : first], before, whole=len(rows) < limit)
    if index is None:
        return found
    if found.branch is not None:
        # Forked right before the head, or before the calls the history left out: no branch.
        while index and before[index - 1].role == "assistant" and before[index - 1].tool_calls:
            index -= 1
        if found.parent_seq != (before[index - 1].seq if index else None):
            return found
    # Not `whole`: the history lacks the call, so the prompt is read from what is stored.
    return replace(
        found, start=first, parent=row.head_hash, parent_seq=row.head_seq, branch=None, whole=False
    )


def _last_results(messages: Sequence[Mapping[str, Any]], start: int) -> int | None:
    """Where the last run of tool results from `start` on begins; None when there is none."""
    results = [i for i in range(start, len(messages)) if messages[i].get("role") == "tool"]
    if not results:
        return None
    run = results[-1]
    while run > start and messages[run - 1].get("role") == "tool":
        run -= 1
    return run


def _resent_start(
    resent: Sequence[Mapping[str, Any]], before: Sequence[Any], *, whole: bool
) -> int | None:
    """Where in `before` (the stored messages before the head) the messages `resent` stand for
    begin, each the next stored one but for assistant messages with tool calls (left out with
    the calls of earlier steps); `len(before)` for none, None when they are not stored so.
    `whole`: `before` starts at the conversation's first message."""
    index = len(before)
    for message in reversed(resent):
        while True:
            index -= 1
            if index < 0:
                return None
            parent = before[index - 1].chain_hash if index else chains.ROOT_HASH
            if (index or whole) and chains.chain_hash(parent, message) == before[index].chain_hash:
                break
            if not (before[index].role == "assistant" and before[index].tool_calls):
                return None
    return index
