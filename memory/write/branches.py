"""Moving a conversation's current branch, and showing its branches.

A conversation's messages are stored once each, in arrival order (`seq`); its current branch is
the messages whose `superseded_at` is NULL, and they are always one path of the message tree
in seq order (`memory.write.identity`). `move` changes which path is current: the messages
after the fork leave it (`superseded_at` set), those of an abandoned branch the client resent
come back. Nothing is deleted but the summaries that covered a message from the first one that
changed on: the next build makes them again over the current branch (`memory.build.tree`
skips superseded messages), so no prompt shows a summary of an abandoned branch and a working
context compacted past that point knows it must be rebuilt (`Moved.branched_at`). A forced
compaction ("Compact now": a final build) that a move would undo, because it is queued or
running on the old branch or the move dropped the segment it closed, is queued again, so that
what was stored before it still gets summarized.

`place_reply` says where a reply goes when other messages were stored after the turn it
answers. `runs` lists the stored messages as runs that each sit on one branch, for the admin API.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Integer, bindparam, case, delete, func, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.build import jobs, tree
from memory.db import AnyRow
from memory.schema import conversations, nodes
from memory.write.chains import ROOT_HASH


@dataclass(frozen=True)
class Moved:
    """What `move` changed."""

    branched_at: int | None
    """The first seq whose message left or rejoined the current branch (None: nothing did)."""
    tokens: int
    """Tokens the current branch gained (negative: lost)."""


_RESTORE = bindparam("restore", type_=ARRAY(Integer))
_MOVE = (
    update(nodes)
    .where(
        nodes.c.conversation_id == bindparam("conversation"),
        nodes.c.level == 0,
        nodes.c.seq > bindparam("fork"),
        # Only the messages whose state changes.
        or_(
            (nodes.c.superseded_at.is_(None)) & ~(nodes.c.seq == func.any(_RESTORE)),
            (nodes.c.superseded_at.is_not(None)) & (nodes.c.seq == func.any(_RESTORE)),
        ),
    )
    .values(
        superseded_at=case((nodes.c.seq == func.any(_RESTORE), None), else_=func.now()),
    )
    .returning(nodes.c.seq, nodes.c.token_count, nodes.c.superseded_at.is_(None).label("current"))
)


async def move(
    conn: AsyncConnection,
    *,
    conversation_id: int,
    fork_seq: int | None,
    restore: Sequence[int] = (),
) -> Moved:
    """Make the current branch its messages up to `fork_seq` (None: none of them) followed by
    the superseded messages `restore`; drop the summaries over what changed, and queue a final
    build again when one is pending or its final segment was dropped. The caller holds the
    conversation's lock and moves its head and token count.

    The turn's lock (`FOR NO KEY UPDATE`) becomes the row's update lock first, before any
    message is touched: what a build is writing (summaries, vectors: under a key-share lock,
    `memory.build.tree`) is committed before the branch moves, and nothing is written over it
    until the turn ends."""
    tenant_id = (
        await conn.execute(
            select(conversations.c.tenant_id)
            .where(conversations.c.id == conversation_id)
            .with_for_update()
        )
    ).scalar_one()
    rows = (
        await conn.execute(
            _MOVE,
            {
                "conversation": conversation_id,
                "fork": -1 if fork_seq is None else fork_seq,
                "restore": list(restore),
            },
        )
    ).all()
    if not rows:
        return Moved(branched_at=None, tokens=0)
    first = min(row.seq for row in rows)
    reasons = await conn.scalars(
        delete(nodes)
        .where(
            nodes.c.conversation_id == conversation_id, nodes.c.level > 0, nodes.c.span_end >= first
        )
        .returning(nodes.c.meta["reason"].astext)
    )
    final = tree.dedupe_key(conversation_id, final=True)
    if "final" in reasons.all() or await jobs.pending(
        conn, conversation_id=conversation_id, dedupe_key=final
    ):
        # "Compact now" asked for everything stored to be summarized: a final build that would
        # run on the old branch (it stops there: `summary_nodes.Branched`), or whose closing of
        # the open segment this undid, is queued again. A queued one stays queued, now locked
        # until commit (`jobs.deduplicated`), so that no worker starts it on the old branch.
        await tree.enqueue(conn, tenant_id=tenant_id, conversation_id=conversation_id, final=True)
    gained = sum(row.token_count if row.current else -row.token_count for row in rows)
    return Moved(branched_at=first, tokens=gained)


@dataclass(frozen=True)
class ReplyTo:
    """Where the reply to a stored turn goes: after `parent` (the chain hash and seq of the last
    message its prompt held); `request_key` tells a retry's reply from a first one; `retry`: the
    turn repeats an earlier request (`memory.write.retries`)."""

    parent: str
    parent_seq: int | None
    request_key: str | None = None
    retry: bool = False


@dataclass(frozen=True)
class Place:
    """Where a reply goes: after `after` (a chain hash and its message's seq), on the current
    branch or not; `answered` when the first answer to its request is already stored."""

    after: tuple[str, int | None]
    current: bool = True
    answered: bool = False


async def place_reply(conn: AsyncConnection, *, conv: AnyRow, reply_to: ReplyTo) -> Place:
    """Where a reply goes when the locked conversation's head moved since its turn was stored:
    nowhere when the first answer to the same request is stored after the message it answers
    (a retry's); after that message but superseded when it left the current branch meanwhile
    (it answers an abandoned branch); else after the head (requests that sent only their new
    messages, answered in the order they end)."""
    here = Place(after=(conv.head_hash or ROOT_HASH, conv.head_seq))
    on_branch = True
    if reply_to.parent_seq is not None:
        later = nodes.c.seq > reply_to.parent_seq
        if reply_to.request_key is not None:
            answered = await conn.scalar(
                select(nodes.c.id)
                .where(
                    nodes.c.conversation_id == conv.id,
                    nodes.c.level == 0,
                    nodes.c.request_key == reply_to.request_key,
                    nodes.c.model.is_not(None),
                    later,
                )
                .limit(1)
            )
            if answered is not None:
                return Place(after=here.after, answered=True)
        on_branch = bool(
            await conn.scalar(
                select(nodes.c.superseded_at.is_(None)).where(
                    nodes.c.conversation_id == conv.id,
                    nodes.c.level == 0,
                    nodes.c.seq == reply_to.parent_seq,
                )
            )
        )
    if not on_branch:
        return Place(after=(reply_to.parent, reply_to.parent_seq), current=False)
    return here


@dataclass(frozen=True)
class Run:
    """Consecutive stored messages that sit on one branch: `first_seq` follows `follows_seq`
    (-1: the root), each later one the one before it."""

    first_seq: int
    last_seq: int
    follows_seq: int
    superseded: bool


async def runs(conn: AsyncConnection, *, tenant_id: int, conversation_id: int) -> list[Run]:
    """The conversation's messages as runs, in seq order (one run: it never branched)."""
    rows = await conn.execute(
        select(nodes.c.seq, nodes.c.follows_seq, nodes.c.superseded_at.is_not(None))
        .where(
            nodes.c.tenant_id == tenant_id,
            nodes.c.conversation_id == conversation_id,
            nodes.c.level == 0,
        )
        .order_by(nodes.c.seq)
    )
    found: list[Run] = []
    for seq, follows, superseded in rows:
        previous = found[-1] if found else None
        if (
            previous is not None
            and follows is None
            and previous.last_seq == seq - 1
            and previous.superseded == superseded
        ):
            found[-1] = Run(previous.first_seq, seq, previous.follows_seq, superseded)
        else:
            found.append(Run(seq, seq, seq - 1 if follows is None else follows, superseded))
    return found
