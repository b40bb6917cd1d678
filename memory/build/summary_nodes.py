"""Summary nodes written into a conversation's tree: new summaries inserted, their children
adopted (`memory.build.tree` decides what to summarize, and when).

`insert_summaries()` inserts a batch of `NewSummary` of one level in the caller's transaction:
each row with its span (its first child's start to its last child's end), the period it covers
(`created_at` is when the period ended, `meta` says when it began and ended), its text and facts
(escaped where Postgres refuses a character), its token count and its vector (the centroid of
its children's, computed by the caller), and then each child's parent, written together with
the child's own vector when the caller holds a new one (`memory.build.indexing`: one row
version, one HNSW entry).

It is idempotent: a summary that already exists (a racing build made it: the unique
`(conversation_id, level, seq)` key) is skipped, and a child that already has a parent keeps
it. A request that moves the current branch drops the summaries over what changed
(`memory.write.branches.move`) under the conversation's update lock; a summary is inserted
under a key-share lock of that row (`hold_branch`: the lock every turn takes does not wait for
it, a branch move does), after checking that none of its children left the branch or went away
meanwhile: if one did, `Branched` is raised, and the build stops there.
"""

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import cast, func, literal, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import tokens
from memory.build import indexing
from memory.build.indexing import Embedded
from memory.build.summarize import Summary, SummaryInput
from memory.db import FLOATS
from memory.schema import conversations, nodes
from memory.text import escape_unstorable

log = logging.getLogger(__name__)


class Branched(Exception):
    """Children of a summary about to be inserted left the current branch or went away."""


@dataclass(frozen=True)
class NewSummary:
    """A summary node to insert, with its children (in order)."""

    seq: int
    children: Sequence[SummaryInput]
    summary: Summary
    # The centroid of the children's vectors; None when none of them has one.
    vector: list[float] | None
    meta: dict[str, Any]
    # When each child's period began, for children that are summaries (their `created_at` is
    # when their period ended); messages begin and end at their `created_at`.
    started: Sequence[datetime | None] | None = None


async def hold_branch(conn: AsyncConnection, *, conversation_id: int) -> bool:
    """Keep the conversation's current branch from moving until the transaction ends; False
    when the conversation is gone. Every build transaction that writes nodes takes it first
    (`memory.build.tree`).

    A key-share lock of its row: the lock every turn takes (`FOR NO KEY UPDATE`:
    `memory.write.identity`) does not wait for it, a branch move's (`FOR UPDATE`:
    `memory.write.branches.move`) does. It was a share lock, which every turn waited for: with
    the worker writing summaries, 13 of 120 turns on a 10,000-message conversation waited 8-56
    ms for a summary's writes (its children's vectors go into the HNSW index) to commit."""
    alive = await conn.scalar(
        select(conversations.c.id)
        .where(conversations.c.id == conversation_id)
        .with_for_update(read=True, key_share=True)
    )
    return alive is not None


async def insert_summaries(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    level: int,
    new: Sequence[NewSummary],
    token_model: str,
    fresh: Mapping[int, Embedded] | None = None,
) -> None:
    """Insert summary nodes and adopt their children, each child's parent written together
    with its vector when `fresh` holds one (one row version, one HNSW entry).

    A summary that already exists (a racing build made it: same conversation, level and seq)
    is skipped, and a child that already has a parent keeps it. `Branched` when a child left
    the current branch or went away since it was read (see the module docstring)."""
    if not new:
        return
    # A deleted conversation is not checked: the insert fails on its foreign key.
    alive = await hold_branch(conn, conversation_id=conversation_id)
    child_ids = {child.node_id for item in new for child in item.children}
    kept = await conn.scalar(
        select(func.count()).where(nodes.c.id.in_(child_ids), nodes.c.superseded_at.is_(None))
    )
    if alive and kept != len(child_ids):
        raise Branched
    rows = []
    for item in new:
        # A model may answer a NUL or an unpaired surrogate (the `\u0000` of a conversation about
        # C strings, copied into its JSON), which Postgres refuses: stored escaped, as a
        # message is, rather than failing the build on every attempt.
        text, text_escaped = escape_unstorable(item.summary.text)
        facts, facts_escaped = escape_unstorable(item.summary.facts)
        children = item.children
        stamps = [child.created_at for child in children if child.created_at is not None]
        starts = [s for s in item.started if s is not None] if item.started is not None else stamps
        rows.append(
            {
                "tenant_id": tenant_id,
                "conversation_id": conversation_id,
                "level": level,
                "seq": item.seq,
                "span_start": children[0].seq_start,
                "span_end": children[-1].seq_end,
                "text": text,
                "facts": facts,
                "escaped": text_escaped or facts_escaped,
                "method": item.summary.method,
                "model": item.summary.model,
                "token_count": tokens.count_text(text, model=token_model),
                "embedding": (
                    None
                    if item.vector is None
                    else cast(literal(item.vector, FLOATS), nodes.c.embedding.type)
                ),
                "meta": {
                    **item.meta,
                    "children": len(children),
                    **_period(starts or stamps, stamps),
                },
                # The end of the period it covers (children always have one in practice).
                "created_at": max(stamps) if stamps else func.now(),
            }
        )
    inserted: dict[int, int] = dict(
        (
            await conn.execute(
                pg_insert(nodes)
                .values(rows)
                .on_conflict_do_nothing(constraint="uq_nodes_conversation_level_seq")
                .returning(nodes.c.seq, nodes.c.id)
            )
        ).all()
    )
    if len(inserted) < len(new):
        log.info(
            "%d summaries already built",
            len(new) - len(inserted),
            extra={"conversation_id": conversation_id},
        )
    adopted = [
        (child.node_id, inserted[item.seq])
        for item in new
        if item.seq in inserted
        for child in item.children
    ]
    if not adopted:
        return
    fresh = fresh or {}
    await indexing.write(
        conn,
        [(child, fresh.get(child), parent) for child, parent in adopted],
        tenant_id=tenant_id,
    )


def _period(starts: Sequence[datetime], ends: Sequence[datetime]) -> dict[str, str]:
    if not starts or not ends:
        return {}
    return {"started_at": min(starts).isoformat(), "ended_at": max(ends).isoformat()}
