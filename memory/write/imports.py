"""Where an import resumes: the part of a history its conversation already holds.

`memstrata import` (and a resumed or repeated run of it) stores a history in batches, each in
its own transaction. Run again, it must continue after what the conversation holds rather than
store it twice, also after the conversation went on (another import, a chat turn), and also
when the history was imported into a conversation that held messages before it: its messages
then follow those, and their chain hashes are not the history's own from the root. Such a
history is found after the stored message its first message follows (at most `STARTS` places,
the latest first): the longest leading run of its messages that the conversation holds in a
row, wherever it starts, is not stored again.
"""

from collections.abc import Mapping, Sequence
from typing import Any, Final

from sqlalchemy import LargeBinary, Text, bindparam, func, literal_column, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.schema import conversations, nodes
from memory.write import chains

STARTS: Final = 8
"""How many places a history imported after other messages is looked for at."""

# The deepest of an import's messages (their chain hashes, in order) that a conversation holds,
# on any branch: its place among them, from 1. Level 0 as a constant: the chain index is partial.
_CHAIN = bindparam("chain", type_=ARRAY(Text))
_DEEPEST_HELD = select(func.max(func.array_position(_CHAIN, nodes.c.chain_hash))).where(
    nodes.c.tenant_id == bindparam("tenant_id"),
    nodes.c.conversation_id == bindparam("conversation_id"),
    nodes.c.level == literal_column("0"),
    nodes.c.chain_hash == func.any(_CHAIN),
)
# The chain hashes of the stored messages that a message of canonical form `canonical` follows:
# its chain hash is sha256 over its parent's, a newline and that form (`chains.chain_hash`).
_PARENTS = text(
    """
SELECT p.chain_hash FROM nodes n
JOIN nodes p ON p.conversation_id = n.conversation_id AND p.level = 0
  AND p.seq = COALESCE(n.follows_seq, n.seq - 1)
WHERE n.tenant_id = :tenant_id AND n.conversation_id = :conversation_id AND n.level = 0
  AND n.role = :role
  AND n.chain_hash
    = encode(sha256(convert_to(p.chain_hash || E'\\n', 'UTF8') || :canonical), 'hex')
ORDER BY n.seq DESC
LIMIT :limit
"""
).bindparams(bindparam("canonical", type_=LargeBinary))


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
    holds is found by its chain hash, which stands for every message before it: chained from
    the root, or after a stored message (see the module docstring)."""
    hashes = chains.chain(messages)
    head = await conn.scalar(
        select(conversations.c.head_hash).where(conversations.c.id == conversation_id)
    )
    start = chains.after_head(hashes, head)
    if start is not None:
        return start
    held = await _deepest(conn, tenant_id=tenant_id, conversation_id=conversation_id, chain=hashes)
    if held or not messages:
        return held
    first = messages[0]
    parents = await conn.scalars(
        _PARENTS,
        {
            "tenant_id": tenant_id,
            "conversation_id": conversation_id,
            "role": first.get("role"),
            "canonical": chains.canonical_json(chains.canonical(first)),
            "limit": STARTS,
        },
    )
    for parent in parents.all():
        chained = chains.chain(messages, parent)
        found = await _deepest(
            conn, tenant_id=tenant_id, conversation_id=conversation_id, chain=chained
        )
        held = max(held, found)
    return held


async def _deepest(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, chain: list[str]
) -> int:
    deepest = await conn.scalar(
        _DEEPEST_HELD,
        {"tenant_id": tenant_id, "conversation_id": conversation_id, "chain": chain},
    )
    return 0 if deepest is None else int(deepest)
