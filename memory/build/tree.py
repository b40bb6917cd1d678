"""The summary tree of a conversation, built in the background (SPEC §5).

`build()` brings one conversation up to date, in steps that each commit their own progress:

1. embed the messages after the last closed segment, a chunk of `embed_batch` at a time,
   scoring each one's importance and pinning milestones on the way (and embedding its passages,
   `memory.build.passages`, written with its vector: `memory.build.indexing`), and cut them into
   segments (`memory.build.segments`, fed chunk by chunk); each closed segment gets a level-1
   summary node, and its messages get their vector, importance and parent in one UPDATE each, so the
   HNSW index takes one entry per message rather than one for the vector and another for the
   parent. Messages of the still-open segment are written with their vector at the end (they
   gain a parent in a later build). A message without text (an assistant's bare tool calls)
   has nothing to embed and keeps no vector. Messages stored after the step read its work are
   left to the next build, so where segments close never depends on timing. Messages that left
   the conversation's current branch (`memory.write.branches`) are embedded, so that they stay
   searchable, but belong to no segment;
2. roll up: while some level k has `fanout` consecutive nodes without a parent, summarize them
   into one level-k+1 node; there is no depth limit;
3. embed any node that still has text but no vector (a summary none of whose children has one).

A summary's vector is the unit centroid of its children's vectors (`embeddings.centroid`),
computed when the summary is inserted: the embedding model never reads summary text, which
costs ~13x a message's embedding for a 256-token summary. The centroid places a summary among
the messages it covers, which is what retrieval searches it for. A summary none of whose
children has a vector (every child without text) is embedded from its own text, if it has any.

Every step reads its work from the database (what follows the last segment, what lacks a
parent, what lacks an embedding), so a build interrupted anywhere, by a crash or a lost lease,
is finished by the next one (vectors computed but not yet written are computed again), and a
repeated build changes nothing. Summaries never replace anything: messages stay as they are
and gain a parent. Builds of one conversation are serialized by the job queue (one job per
conversation runs at a time); the unique `(conversation_id, level, seq)` key makes a racing
duplicate insert a no-op all the same. A request that moves the current branch drops the
summaries over what changed (`memory.write.branches.move`) under the conversation's update lock;
summaries are inserted (`memory.build.summary_nodes`) after checking that none of their children
left the branch or went away meanwhile: if one did, the build stops there, and the build that
request queued starts again from what is left (a final one too, when a final build was pending
or the move dropped the segment it closed). Every transaction of a build that writes nodes
takes the conversation's key-share lock first (`summary_nodes.hold_branch`), as a move takes
the update lock before it touches a message, so that neither holds a row the other waits for:
the vectors of the newest messages (those an edit drops), written in seq order while a move's
UPDATE locked the same messages in the order its plan read them (by chain hash), deadlocked,
and Postgres failed the request.
"""

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import cast, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory.build import indexing, jobs, summary_nodes
from memory.build.indexing import Embedded
from memory.build.jobs import Job
from memory.build.segments import SegmentMessage, SegmentPolicy, split
from memory.build.summarize import Summarizer, Summary, SummaryInput
from memory.db import FLOATS, AnyRow, transaction
from memory.embeddings import Embedder, Vector, centroid
from memory.schema import nodes

log = logging.getLogger(__name__)

JOB_KIND = "conversation"
"""The job that runs `build` for one conversation."""


@dataclass(frozen=True)
class TreeConfig:
    """What a build needs: injected backends and the shape of the tree."""

    embedder: Embedder
    summarizer: Summarizer
    policy: SegmentPolicy = field(default_factory=SegmentPolicy)
    fanout: int = 8
    summary_tokens: int = 256
    token_model: str = "gpt-4o"
    embed_batch: int = 256
    # Segments summarized at once: bounds LLM concurrency and the size of one transaction.
    summary_batch: int = 16
    # Embed each message's sentences too (`memory.build.passages`): ~1.5x the embedding work.
    passages: bool = True


@dataclass
class Progress:
    """What one build did."""

    embedded: int = 0
    segments: int = 0
    rollups: int = 0


async def enqueue(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, final: bool = False
) -> None:
    """Queue a build of the conversation in the caller's transaction (deduplicated).

    `final` also closes the open segment at the end (a forced compaction)."""
    await jobs.enqueue(
        conn,
        kind=JOB_KIND,
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        payload={"final": True} if final else None,
        dedupe_key=dedupe_key(conversation_id, final=final),
    )


def dedupe_key(conversation_id: int, *, final: bool = False) -> str:
    """The key that keeps one build of the conversation queued at a time (one final one)."""
    return f"{JOB_KIND}:{conversation_id}:{'final' if final else 'build'}"


async def summary_counts(conn: AsyncConnection) -> dict[tuple[int, str], int]:
    """Summaries of every tenant by (level, method); `unknown` for a summary without one."""
    rows = await conn.execute(
        select(nodes.c.level, func.coalesce(nodes.c.method, "unknown"), func.count())
        .where(nodes.c.level >= 1)
        .group_by(nodes.c.level, nodes.c.method)
    )
    return {(int(level), str(method)): int(n) for level, method, n in rows}


def handler(engine: AsyncEngine, config: TreeConfig) -> jobs.Handler:
    """The job handler for `JOB_KIND`."""

    async def handle(job: Job) -> None:
        if job.tenant_id is None or job.conversation_id is None:
            raise ValueError(f"job {job.id} names no conversation")
        await build(
            engine,
            tenant_id=job.tenant_id,
            conversation_id=job.conversation_id,
            config=config,
            final=bool(job.payload.get("final")),
        )

    return handle


async def build(
    engine: AsyncEngine,
    *,
    tenant_id: int,
    conversation_id: int,
    config: TreeConfig,
    final: bool = False,
) -> Progress:
    """Bring the conversation's embeddings, segments and roll-ups up to date."""
    progress = Progress()
    scope = {"tenant_id": tenant_id, "conversation_id": conversation_id}
    try:
        embedded, progress.segments = await _segment(engine, config=config, final=final, **scope)
        progress.embedded += embedded
        progress.rollups += await _roll_up(engine, config=config, **scope)
    except summary_nodes.Branched:
        log.info("the conversation branched during its build", extra=scope)
        return progress
    # Summaries that got no centroid (none of their children has a vector): rare, and cheap
    # to look for through the partial index of unembedded nodes.
    progress.embedded += await _embed_pending(engine, config=config, **scope)
    return progress


# -- 1. messages: embeddings and segments -------------------------------------------------

_EMBEDDING = cast(nodes.c.embedding, FLOATS).label("embedding")


async def _segment(
    engine: AsyncEngine,
    *,
    tenant_id: int,
    conversation_id: int,
    config: TreeConfig,
    final: bool,
) -> tuple[int, int]:
    """Embed and cut the messages after the last closed segment: (embedded, segments)."""
    async with transaction(engine) as conn:
        last = (
            await conn.execute(
                select(func.max(nodes.c.seq), func.max(nodes.c.span_end)).where(
                    nodes.c.conversation_id == conversation_id, nodes.c.level == 1
                )
            )
        ).one()
        rows = (
            await conn.execute(
                select(
                    nodes.c.id,
                    nodes.c.level,
                    nodes.c.seq,
                    nodes.c.role,
                    nodes.c.text,
                    nodes.c.token_count,
                    _EMBEDDING,
                    nodes.c.tool_calls,
                    nodes.c.tool_call_id,
                    nodes.c.created_at,
                    nodes.c.superseded_at,
                )
                .where(
                    nodes.c.tenant_id == tenant_id,
                    nodes.c.conversation_id == conversation_id,
                    nodes.c.level == 0,
                    nodes.c.seq > (last[1] if last[1] is not None else -1),
                )
                .order_by(nodes.c.seq)
            )
        ).all()
    by_seq = {row.seq: row for row in rows}
    next_seq = 0 if last[0] is None else last[0] + 1
    # Vectors not yet written, by node id: written with the parent, or at the end.
    fresh: dict[int, Embedded] = {}
    called: dict[str, str] = {}
    remainder: list[SegmentMessage] = []
    made = 0
    for start in range(0, len(rows), config.embed_batch):
        chunk = rows[start : start + config.embed_batch]
        fresh.update(
            await indexing.embed(
                config.embedder,
                passages=config.passages,
                rows=[row for row in chunk if _pending(row)],
            )
        )
        current = [row for row in chunk if row.superseded_at is None]
        closed, remainder = split(
            [*remainder, *_segment_messages(current, fresh, called)],
            config.policy,
            final=final and start + config.embed_batch >= len(rows),
        )
        for first in range(0, len(closed), config.summary_batch):
            batch = closed[first : first + config.summary_batch]
            groups = [
                [_message_input(by_seq[m.seq]) for m in segment.messages] for segment in batch
            ]
            summaries = await _summarize_all(config, groups, level=1)
            async with transaction(engine) as conn:
                await summary_nodes.insert_summaries(
                    conn,
                    tenant_id=tenant_id,
                    conversation_id=conversation_id,
                    level=1,
                    new=[
                        summary_nodes.NewSummary(
                            seq=next_seq + made + offset,
                            children=groups[offset],
                            summary=summary,
                            vector=_centroid([m.embedding for m in segment.messages]),
                            meta={"reason": segment.reason},
                        )
                        for offset, (segment, summary) in enumerate(
                            zip(batch, summaries, strict=True)
                        )
                    ],
                    token_model=config.token_model,
                    fresh=fresh,
                )
            for segment in batch:
                for message in segment.messages:
                    fresh.pop(by_seq[message.seq].id, None)
            made += len(batch)
    if fresh:
        async with transaction(engine) as conn:
            await summary_nodes.hold_branch(conn, conversation_id=conversation_id)
            await indexing.write(
                conn,
                [(node, item, None) for node, item in fresh.items()],
                tenant_id=tenant_id,
            )
    embedded = sum(1 for row in rows if _pending(row))
    return embedded, made


def _pending(row: AnyRow) -> bool:
    return row.embedding is None and indexing.has_text(row.text)


def _segment_messages(
    rows: Sequence[AnyRow], fresh: Mapping[int, Embedded], called: dict[str, str]
) -> list[SegmentMessage]:
    """`rows` as segmentation sees them; `called` maps the tool calls seen so far to names."""
    messages = []
    for row in rows:
        names = tuple(
            str((call.get("function") or {}).get("name", "")) for call in row.tool_calls or []
        )
        for call, name in zip(row.tool_calls or [], names, strict=True):
            called[str(call.get("id"))] = name
        if row.role == "tool" and row.tool_call_id in called:
            names = (called[row.tool_call_id],)
        messages.append(
            SegmentMessage(
                seq=row.seq,
                role=row.role,
                text=row.text,
                token_count=row.token_count,
                embedding=fresh[row.id].vector if row.id in fresh else row.embedding,
                tool_names=names,
            )
        )
    return messages


def _message_input(row: AnyRow) -> SummaryInput:
    return SummaryInput(
        node_id=row.id,
        level=0,
        role=row.role,
        text=row.text,
        facts=None,
        created_at=row.created_at,
        seq_start=row.seq,
        seq_end=row.seq,
    )


# -- 2. roll-ups -------------------------------------------------------------------------------


async def _roll_up(
    engine: AsyncEngine, *, tenant_id: int, conversation_id: int, config: TreeConfig
) -> int:
    made = 0
    level = 1
    while True:
        async with transaction(engine) as conn:
            orphans = (
                await conn.execute(
                    select(
                        nodes.c.id,
                        nodes.c.level,
                        nodes.c.text,
                        nodes.c.facts,
                        nodes.c.created_at,
                        nodes.c.span_start,
                        nodes.c.span_end,
                        nodes.c.meta,
                        _EMBEDDING,
                    )
                    .where(
                        nodes.c.conversation_id == conversation_id,
                        nodes.c.level == level,
                        nodes.c.parent_id.is_(None),
                    )
                    .order_by(nodes.c.seq)
                )
            ).all()
            above = await conn.scalar(
                select(func.max(nodes.c.seq)).where(
                    nodes.c.conversation_id == conversation_id, nodes.c.level == level + 1
                )
            )
        full = len(orphans) // config.fanout
        if full == 0:
            if above is None:
                return made
            level += 1
            continue
        groups = [
            [_summary_input(row) for row in orphans[i * config.fanout : (i + 1) * config.fanout]]
            for i in range(full)
        ]
        # A summary's created_at is when its period ended; when it began is in its meta.
        started = {row.id: _started_at(row) for row in orphans}
        vectors = {row.id: row.embedding for row in orphans}
        next_seq = 0 if above is None else above + 1
        for start in range(0, full, config.summary_batch):
            batch = groups[start : start + config.summary_batch]
            summaries = await _summarize_all(config, batch, level=level + 1)
            async with transaction(engine) as conn:
                await summary_nodes.insert_summaries(
                    conn,
                    tenant_id=tenant_id,
                    conversation_id=conversation_id,
                    level=level + 1,
                    new=[
                        summary_nodes.NewSummary(
                            seq=next_seq + start + offset,
                            children=children,
                            summary=summary,
                            vector=_centroid([vectors[child.node_id] for child in children]),
                            meta={},
                            started=[started[child.node_id] for child in children],
                        )
                        for offset, (children, summary) in enumerate(
                            zip(batch, summaries, strict=True)
                        )
                    ],
                    token_model=config.token_model,
                )
        made += full
        level += 1


def _started_at(row: AnyRow) -> datetime | None:
    value = (row.meta or {}).get("started_at")
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    created_at: datetime | None = row.created_at
    return created_at


def _summary_input(row: AnyRow) -> SummaryInput:
    return SummaryInput(
        node_id=row.id,
        level=row.level,
        role=None,
        text=row.text,
        facts=row.facts,
        created_at=row.created_at,
        seq_start=row.span_start,
        seq_end=row.span_end,
    )


# -- 3. what still lacks a vector ---------------------------------------------------------


async def _embed_pending(
    engine: AsyncEngine, *, tenant_id: int, conversation_id: int, config: TreeConfig
) -> int:
    done = 0
    while True:
        async with transaction(engine) as conn:
            rows = (
                await conn.execute(
                    select(nodes.c.id, nodes.c.level, nodes.c.role, nodes.c.text)
                    .where(
                        nodes.c.tenant_id == tenant_id,
                        nodes.c.conversation_id == conversation_id,
                        nodes.c.embedding.is_(None),
                        indexing.HAS_TEXT,
                    )
                    .order_by(nodes.c.id)
                    .limit(config.embed_batch)
                )
            ).all()
        if not rows:
            return done
        embedded = await indexing.embed(config.embedder, passages=config.passages, rows=rows)
        async with transaction(engine) as conn:
            await summary_nodes.hold_branch(conn, conversation_id=conversation_id)
            await indexing.write(
                conn,
                [(node, item, None) for node, item in embedded.items()],
                tenant_id=tenant_id,
            )
        done += len(rows)


# -- shared ------------------------------------------------------------------------------------


async def _summarize_all(
    config: TreeConfig, groups: Sequence[Sequence[SummaryInput]], *, level: int
) -> list[Summary]:
    summaries = [
        asyncio.ensure_future(
            config.summarizer.summarize(group, level=level, target_tokens=config.summary_tokens)
        )
        for group in groups
    ]
    try:
        return list(await asyncio.gather(*summaries))
    except Exception:
        # One failure fails the build and its job is retried: the rest of the batch (LLM
        # requests, each billed) must not run on for an attempt that will store none of them.
        for summary in summaries:
            summary.cancel()
        await asyncio.gather(*summaries, return_exceptions=True)
        raise


def _centroid(vectors: Sequence[Vector | None]) -> list[float] | None:
    present = [vector for vector in vectors if vector is not None]
    return centroid(present) if present else None
