"""A turn the upstream refused: its messages leave the conversation's current branch.

The gateway stores a turn before it goes upstream, so that a fault there loses nothing. But an
upstream that refuses the request as invalid (an image it cannot read, a content part it does
not take, a prompt too long for the model) would refuse every later prompt that repeats it. A
client that sends only its new messages (`X-Memstrata-Conversation`, the Responses API's
`conversation`) cannot leave the refused message out: its next turn follows the head. So such
a turn is withdrawn, as if the client had edited it away (`memory.write.branches.move`): its
messages stay stored, off the current branch, and the head goes back to where the turn hung.

`withdraw` does that only while the turn's messages are still the head: once another request
stored after them, or answered them, they are part of a history that went on.
"""

from sqlalchemy import ColumnElement, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.schema import conversations, nodes
from memory.write import appends, branches
from memory.write.branches import ReplyTo


async def withdraw(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    first_seq: int,
    head: ReplyTo,
) -> bool:
    """Take the messages a turn stored from seq `first_seq` on (`head`: where its reply would
    go, after the last of them) off the current branch, in the caller's transaction; False,
    changing nothing, when they are no longer the conversation's head."""
    conv = (
        await conn.execute(
            select(conversations.c.head_hash, conversations.c.head_seq)
            .where(conversations.c.id == conversation_id, conversations.c.tenant_id == tenant_id)
            .with_for_update(key_share=True)
        )
    ).one_or_none()
    if conv is None or (conv.head_hash, conv.head_seq) != (head.parent, head.parent_seq):
        return False
    first = (
        await conn.execute(select(nodes.c.follows_seq).where(*_message(conversation_id, first_seq)))
    ).one_or_none()
    if first is None:
        return False
    # The turn hung after its first message's parent: the message before it, unless it
    # followed another (an edit), or none (-1: the conversation's first turn).
    parent_seq = first_seq - 1 if first.follows_seq is None else first.follows_seq
    moved = await branches.move(conn, conversation_id=conversation_id, fork_seq=first_seq - 1)
    if parent_seq < 0:  # no message left on the branch: the head of a new conversation
        await conn.execute(
            update(conversations)
            .where(conversations.c.id == conversation_id)
            .values(
                head_hash=None,
                head_seq=None,
                token_count=conversations.c.token_count + moved.tokens,
                updated_at=func.now(),
            )
        )
        return True
    parent_hash = (
        await conn.execute(select(nodes.c.chain_hash).where(*_message(conversation_id, parent_seq)))
    ).scalar_one()
    await conn.execute(
        appends.MOVE_HEAD,
        {
            "conversation": conversation_id,
            **appends.head_values(stored=0, added=moved.tokens, head=(parent_hash, parent_seq)),
        },
    )
    return True


def _message(conversation_id: int, seq: int) -> tuple[ColumnElement[bool], ...]:
    """The conditions that name the message `seq` of a conversation."""
    return nodes.c.conversation_id == conversation_id, nodes.c.level == 0, nodes.c.seq == seq
