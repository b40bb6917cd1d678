"""Where an import resumes: the part of a history its conversation already holds.

`memstrata import` (and a resumed or repeated run of it) stores a history in batches, each in
its own transaction. Run again, it must continue after what the conversation holds rather than
store it twice, also after the conversation went on (another import, a chat turn).
"""

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Text, bindparam, func, literal_column, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.schema import conversations, nodes
from memory.write import chains

# The deepest of an import's messages (their chain hashes, in order) that a conversation holds,
# on any branch: its place among them, from 1. Level 0 as a constant: the chain index is partial.
_CHAIN = bindparam("chain", type_=ARRAY(Text))
_DEEPEST_HELD = select(func.max(func.array_position(_CHAIN, nodes.c.chain_hash))).where(
    nodes.c.tenant_id == bindparam("tenant_id"),
    nodes.c.conversation_id == bindparam("conversation_id"),
    nodes.c.level == literal_column("0"),
    nodes.c.chain_hash == func.any(_CHAIN),
)


async def resume_point(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    messages: Sequence[Mapping[str, Any]],
) -> int:
    """How many leading `messages` the conversation already holds: an import that is run
    again, or resumed after a failure, continues after them instead of storing them twice.
    Where the conversation went on since (its head is none of them), the deepest of them it
    holds is found by its chain hash, which stands for every message before it."""
    hashes = chains.chain(messages)
    head = await conn.scalar(
        select(conversations.c.head_hash).where(conversations.c.id == conversation_id)
    )
    start = chains.after_head(hashes, head)
    if start is not None:
        return start
    deepest = await conn.scalar(
        _DEEPEST_HELD,
        {"tenant_id": tenant_id, "conversation_id": conversation_id, "chain": hashes},
    )
    return 0 if deepest is None else int(deepest)
