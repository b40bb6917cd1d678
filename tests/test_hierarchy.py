"""The summary tree (`memory.build.tree`) against a real Postgres, real local embeddings and the
extractive summarizer; `llm` and `auto` modes against the fake upstream server.

The big test imports a 2,000-message synthetic conversation (`devkit/synthetic.py`) with the
importer and builds it through a job `Worker`; the expected shape is computed independently:
the messages' stored embeddings are cut by `segments.split` in one pass with the same policy
(n1 closed segments), then n(k+1) = n(k) // 8. Every message must be reachable by descending
from the parentless nodes, each node checked on the way (children's parent, contiguity, spans,
method, tokens, embedding, fan-out).

Embeddings: one `LocalEmbedder` for the module, behind a memo of text → vector, so that
building the same texts again (the incremental build, the idempotence check) costs no second
inference: the vectors are the model's all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest
from sqlalchemy import func, insert, select
from sqlalchemy import text as sql
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import synthetic
from devkit.upstream import UpstreamServer
from gateway import importer
from gateway.settings import Settings
from memory.build import passages, tree
from memory.build.facts import FACT_KEYS
from memory.build.segments import SegmentMessage, SegmentPolicy, split
from memory.build.summarize import (
    ExtractiveSummarizer,
    FallbackSummarizer,
    LLMSummarizer,
    Summary,
    SummaryInput,
)
from memory.build.worker import Worker
from memory.embeddings import LocalEmbedder
from memory.errors import ProviderError
from memory.provider import Provider
from memory.schema import jobs, nodes, tenants
from memory.schema import passages as passages_table
from memory.write import identity, store, tree_nodes
from tests import own_database
from tests.inprocess import running_app

# Embedding ~3,000 texts on a shared 2-core machine takes from ~45 s (idle) to minutes (busy).
pytestmark = pytest.mark.timeout(900)

N_MESSAGES = 2000
FANOUT = 8
POLICY = SegmentPolicy()
SUMMARY_MODEL = "summary-model-test"
# Planted facts the extractive patterns must keep (names and "34 square metres"-style counts
# are not exact-string facts: a name at a sentence start, a count's unit).
EXACT_KINDS = ("ticket", "amount", "date", "reference", "flight", "percent")


class MemoEmbedder:
    """The real embedder, computing each distinct text once per module."""

    def __init__(self, inner: LocalEmbedder) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.memo: dict[str, list[float]] = {}
        self.computed = 0

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        missing = list(dict.fromkeys(t for t in texts if t not in self.memo))
        if missing:
            for text, vector in zip(missing, await self.inner.embed(missing), strict=True):
                self.memo[text] = vector
            self.computed += len(missing)
        return [self.memo[t] for t in texts]


# This module's own database: its workers run every queued job.
database_url = own_database.database_url
engine = own_database.engine


@pytest.fixture(scope="module")
async def embedder() -> MemoEmbedder:
    local = LocalEmbedder()
    await local.warmup()
    return MemoEmbedder(local)


@pytest.fixture(scope="module")
def config(embedder: MemoEmbedder) -> tree.TreeConfig:
    return tree.TreeConfig(
        embedder=embedder, summarizer=ExtractiveSummarizer("gpt-4o"), policy=POLICY, fanout=FANOUT
    )


async def new_tenant(engine: AsyncEngine, name: str | None = None) -> int:
    async with engine.begin() as conn:
        created = await conn.scalar(
            insert(tenants).values(name=name or f"test-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
    assert created is not None
    return int(created)


async def store_messages(
    engine: AsyncEngine,
    *,
    tenant_id: int,
    external_id: str,
    messages: Sequence[dict[str, Any]],
    created_at: Sequence[datetime] | None = None,
) -> int:
    """Append `messages` (their build queued, as every write queues it); the conversation's id."""
    async with engine.begin() as conn:
        found = await identity.identify(
            conn, tenant_id=tenant_id, external_id=external_id, user=None, messages=messages
        )
        stored = await store.store_new(
            conn,
            tenant_id=tenant_id,
            found=found,
            messages=messages,
            model="gpt-4o",
            created_at=created_at,
        )
    return stored.conversation.id


def worker(engine: AsyncEngine, config: tree.TreeConfig) -> Worker:
    # Jobs are global: this worker runs every queued build of the module's own database.
    return Worker(
        engine,
        {tree.JOB_KIND: tree.handler(engine, config)},
        kinds=[tree.JOB_KIND],
        listen=False,
    )


# --- independent expectations and the node-by-node walk ------------------------------------


async def expected_segments(
    engine: AsyncEngine, *, conversation_id: int, policy: SegmentPolicy = POLICY
) -> list[tuple[int, int, str]]:
    """(first seq, last seq, reason) of every closed segment, from the stored embeddings in one
    `split` pass."""
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(
                    nodes.c.seq,
                    nodes.c.role,
                    nodes.c.text,
                    nodes.c.token_count,
                    nodes.c.embedding,
                    nodes.c.tool_calls,
                    nodes.c.tool_call_id,
                )
                .where(nodes.c.conversation_id == conversation_id, nodes.c.level == 0)
                .order_by(nodes.c.seq)
            )
        ).all()
    called: dict[str, str] = {}
    messages = []
    for row in rows:
        # Messages with text are embedded; an assistant's bare tool calls have nothing to embed.
        assert (row.embedding is not None) == bool(row.text.strip()), row.seq
        names = tuple(call["function"]["name"] for call in row.tool_calls or [])
        for call in row.tool_calls or []:
            called[call["id"]] = call["function"]["name"]
        if row.role == "tool":
            names = (called[row.tool_call_id],)
        messages.append(
            SegmentMessage(
                seq=row.seq,
                role=row.role,
                text=row.text,
                token_count=row.token_count,
                embedding=None if row.embedding is None else [float(x) for x in row.embedding],
                tool_names=names,
            )
        )
    closed, _open = split(messages, policy)
    return [(s.seq_start, s.seq_end, s.reason) for s in closed]


def expected_levels(n_messages: int, n_segments: int, fanout: int = FANOUT) -> dict[int, int]:
    levels = {0: n_messages}
    count, level = n_segments, 1
    while count > 0:
        levels[level] = count
        count //= fanout
        level += 1
    return levels


async def level_counts(engine: AsyncEngine, tenant_id: int, conversation_id: int) -> dict[int, int]:
    async with engine.connect() as conn:
        return await tree_nodes.level_counts(
            conn, tenant_id=tenant_id, conversation_id=conversation_id
        )


@dataclasses.dataclass
class Walk:
    """What descending from the roots found."""

    seqs: list[int]
    summaries: list[tree_nodes.NodeRecord]
    roots: list[tree_nodes.NodeRecord]


async def walk_tree(
    engine: AsyncEngine,
    *,
    tenant_id: int,
    conversation_id: int,
    fanout: int = FANOUT,
    method: str | None = "extractive",
) -> Walk:
    """Descend from every parentless node, checking each node on the way."""
    async with engine.connect() as conn:
        messages = {
            record.id: record
            for record in await tree_nodes.list_nodes(
                conn,
                tenant_id=tenant_id,
                conversation_id=conversation_id,
                min_level=0,
                max_level=0,
            )
        }
        root_ids = list(
            await conn.scalars(
                select(nodes.c.id)
                .where(nodes.c.conversation_id == conversation_id, nodes.c.parent_id.is_(None))
                .order_by(nodes.c.level.desc(), nodes.c.seq)
            )
        )
        seqs: list[int] = []
        summaries: list[tree_nodes.NodeRecord] = []
        roots: list[tree_nodes.NodeRecord] = []

        async def fetch(node_id: int) -> tree_nodes.NodeRecord:
            if node_id in messages:
                return messages[node_id]
            return await tree_nodes.get_node(conn, tenant_id=tenant_id, node_id=node_id)

        async def descend(record: tree_nodes.NodeRecord) -> None:
            assert record.conversation_id == conversation_id
            assert record.embedded == bool(record.text.strip()), (
                f"node {record.id} (level {record.level}): text and embedding disagree"
            )
            if record.level == 0:
                assert record.children == []
                assert record.span_start == record.span_end == record.seq
                seqs.append(record.seq)
                return
            summaries.append(record)
            if method is not None:
                assert record.method == method, record
            assert record.token_count > 0 and record.text.strip(), record
            assert record.facts is not None and set(record.facts) == set(FACT_KEYS)
            assert record.children, f"summary {record.id} has no children"
            if record.level >= 2:
                assert len(record.children) == fanout, record
            assert record.meta.get("children") == len(record.children)
            children = [await fetch(child) for child in record.children]
            for child in children:
                assert child.parent_id == record.id
                assert child.level == record.level - 1
            for before, after in itertools.pairwise(children):
                assert after.span_start == before.span_end + 1, "children are not contiguous"
                assert after.seq == before.seq + 1
            assert (record.span_start, record.span_end) == (
                children[0].span_start,
                children[-1].span_end,
            ), "a summary's span is not the union of its children's"
            for child in children:
                await descend(child)

        for root_id in root_ids:
            root = await fetch(root_id)
            assert root.parent_id is None
            roots.append(root)
            await descend(root)
    return Walk(seqs=seqs, summaries=summaries, roots=roots)


def check_complete(walk: Walk, n_messages: int, fanout: int = FANOUT) -> None:
    """Every message reached exactly once; no level holds `fanout` parentless nodes; only the
    open tail of messages is parentless."""
    assert sorted(walk.seqs) == list(range(n_messages)), "a message is missing or reached twice"
    by_level: dict[int, list[tree_nodes.NodeRecord]] = {}
    for root in walk.roots:
        by_level.setdefault(root.level, []).append(root)
    for level, roots in by_level.items():
        if level >= 1:
            assert len(roots) < fanout, f"{len(roots)} parentless nodes at level {level}"
    level_one_end = max((s.span_end for s in walk.summaries if s.level == 1), default=-1)
    tail = sorted(r.seq for r in by_level.get(0, []))
    assert tail == list(range(level_one_end + 1, n_messages)), "a parentless message in the middle"


async def snapshot(engine: AsyncEngine, conversation_id: int) -> list[tuple[Any, ...]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(
                nodes.c.id,
                nodes.c.level,
                nodes.c.seq,
                nodes.c.span_start,
                nodes.c.span_end,
                nodes.c.parent_id,
                nodes.c.text,
                nodes.c.facts,
                nodes.c.method,
                nodes.c.embedding.is_(None),
                nodes.c.importance,
                nodes.c.pinned,
            )
            .where(nodes.c.conversation_id == conversation_id)
            .order_by(nodes.c.id)
        )
        return [tuple(row) for row in rows]


# --- the 2,000-message conversation -------------------------------------------------------------


@dataclasses.dataclass
class Built:
    tenant_id: int
    conversation_id: int
    conversation: synthetic.Conversation
    jobs_ran: int


@pytest.fixture(scope="module")
async def built(engine: AsyncEngine, config: tree.TreeConfig) -> Built:
    """2,000 messages imported in batches of 500 (which queues the build), then built by a
    Worker until the queue is idle."""
    tenant = await new_tenant(engine)
    conversation = synthetic.generate(N_MESSAGES, seed=2000)
    imported = await importer.import_messages(
        engine,
        tenant_id=tenant,
        external_id="big",
        messages=conversation.messages,
        created_at=conversation.created_at,
        model="gpt-4o",
        batch=500,
    )
    assert imported == N_MESSAGES
    async with engine.connect() as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant, external_id="big")
    ran = await worker(engine, config).run_until_idle()
    return Built(tenant, ref.id, conversation, ran)


async def test_import_queued_one_build_that_ran_once(engine: AsyncEngine, built: Built) -> None:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(jobs.c.kind, jobs.c.status, jobs.c.attempts, jobs.c.conversation_id).where(
                    jobs.c.tenant_id == built.tenant_id
                )
            )
        ).all()
    # Four batches each enqueue a build; while one is queued the others are deduplicated.
    assert [tuple(r) for r in rows] == [(tree.JOB_KIND, "done", 1, built.conversation_id)]
    assert built.jobs_ran >= 1


async def test_level_counts_follow_segmentation_and_fanout(
    engine: AsyncEngine, built: Built
) -> None:
    segments = await expected_segments(engine, conversation_id=built.conversation_id)
    expected = expected_levels(N_MESSAGES, len(segments))
    assert await level_counts(engine, built.tenant_id, built.conversation_id) == expected
    # A tree worth the name: several summary levels above the segments.
    assert len(expected) >= 3, expected
    # The level-1 nodes are exactly those segments, in order, with the reason each closed.
    async with engine.connect() as conn:
        level_one = await tree_nodes.list_nodes(
            conn,
            tenant_id=built.tenant_id,
            conversation_id=built.conversation_id,
            min_level=1,
            max_level=1,
        )
    assert [(n.span_start, n.span_end, n.meta["reason"]) for n in level_one] == segments
    assert [n.seq for n in level_one] == list(range(len(segments)))


async def test_every_message_is_reachable_from_the_top(engine: AsyncEngine, built: Built) -> None:
    walk = await walk_tree(engine, tenant_id=built.tenant_id, conversation_id=built.conversation_id)
    check_complete(walk, N_MESSAGES)
    counts = await level_counts(engine, built.tenant_id, built.conversation_id)
    assert len(walk.summaries) == sum(count for level, count in counts.items() if level > 0)
    assert all(s.model is None for s in walk.summaries)
    # Summaries carry the time they cover.
    for summary in walk.summaries:
        assert summary.meta["started_at"] <= summary.meta["ended_at"]
        first = built.conversation.created_at[summary.span_start]
        last = built.conversation.created_at[summary.span_end]
        assert datetime.fromisoformat(summary.meta["started_at"]) == first
        assert datetime.fromisoformat(summary.meta["ended_at"]) == last


async def test_messages_of_several_sentences_get_their_passages(
    engine: AsyncEngine, built: Built, embedder: MemoEmbedder
) -> None:
    """Each embedded message has one passage row per sentence `passages.split` finds (none for
    a one-sentence message), each holding that sentence's own vector, in the message's tenant."""
    async with engine.connect() as conn:
        messages = (
            await conn.execute(
                select(nodes.c.id, nodes.c.text).where(
                    nodes.c.conversation_id == built.conversation_id,
                    nodes.c.level == 0,
                    nodes.c.embedding.is_not(None),
                )
            )
        ).all()
        rows = (
            await conn.execute(
                select(
                    passages_table.c.node_id,
                    passages_table.c.ordinal,
                    passages_table.c.tenant_id,
                    passages_table.c.embedding,
                )
                .join(nodes, nodes.c.id == passages_table.c.node_id)
                .where(nodes.c.conversation_id == built.conversation_id)
                .order_by(passages_table.c.node_id, passages_table.c.ordinal)
            )
        ).all()
    stored: dict[int, list[Any]] = {}
    for row in rows:
        assert row.tenant_id == built.tenant_id
        stored.setdefault(row.node_id, []).append(row)
    expected = {row.id: passages.split(row.text) for row in messages}
    assert sum(1 for parts in expected.values() if parts) > 100, "expected long messages"
    assert {node: len(parts) for node, parts in expected.items() if parts} == {
        node: len(found) for node, found in stored.items()
    }
    node = next(node for node, parts in expected.items() if len(parts) >= 2)
    vectors = await embedder.embed(expected[node])
    for row, vector in zip(stored[node], vectors, strict=True):
        assert [r.ordinal for r in stored[node]] == list(range(len(vectors)))
        assert float(np.dot(np.asarray(row.embedding), np.asarray(vector))) > 0.999


async def test_no_passages_when_they_are_off(
    engine: AsyncEngine, config: tree.TreeConfig, tenant_id: int
) -> None:
    messages = synthetic.messages(60, seed=17)
    assert any(passages.split(str(m.get("content") or "")) for m in messages)
    conversation_id = await store_messages(
        engine, tenant_id=tenant_id, external_id="no-passages", messages=messages
    )
    await tree.build(
        engine,
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        config=dataclasses.replace(config, passages=False),
        final=True,
    )
    async with engine.connect() as conn:
        embedded = await conn.scalar(
            select(func.count()).where(
                nodes.c.conversation_id == conversation_id, nodes.c.embedding.is_not(None)
            )
        )
        written = await conn.scalar(
            select(func.count())
            .select_from(passages_table.join(nodes, nodes.c.id == passages_table.c.node_id))
            .where(nodes.c.conversation_id == conversation_id)
        )
    assert embedded and written == 0


async def test_a_summary_is_placed_at_its_children_centroid(
    engine: AsyncEngine, built: Built, embedder: MemoEmbedder
) -> None:
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(
                    nodes.c.id, nodes.c.parent_id, nodes.c.level, nodes.c.text, nodes.c.embedding
                ).where(nodes.c.conversation_id == built.conversation_id)
            )
        ).all()
    children: dict[int, list[Any]] = {}
    for row in rows:
        if row.parent_id is not None and row.embedding is not None:
            children.setdefault(row.parent_id, []).append(row.embedding)
    summaries = [row for row in rows if row.level > 0]
    assert summaries
    for summary in summaries:
        expected = np.mean(np.asarray(children[summary.id], dtype=np.float64), axis=0)
        expected /= np.linalg.norm(expected)
        assert np.allclose(np.asarray(summary.embedding), expected, atol=1e-6), summary.id
        # The model never read a summary: its vector cost nothing.
        assert summary.text not in embedder.memo


async def test_summaries_keep_the_ids_and_numbers_of_their_messages(
    engine: AsyncEngine, built: Built
) -> None:
    async with engine.connect() as conn:
        summaries = await tree_nodes.list_nodes(
            conn,
            tenant_id=built.tenant_id,
            conversation_id=built.conversation_id,
            min_level=1,
            max_level=2,
        )
    checked = 0
    for summary in summaries:
        assert summary.facts is not None
        kept = {v for key in ("identifiers", "numbers", "dates") for v in summary.facts[key]}
        planted = {
            fact.value
            for fact in built.conversation.facts
            if summary.span_start <= fact.index <= summary.span_end
            and fact.kind in EXACT_KINDS
            # Level 2 is checked for ticket ids and amounts, well under the fact caps.
            and (summary.level == 1 or fact.kind in ("ticket", "amount"))
        }
        missing = planted - kept
        assert not missing, f"level-{summary.level} summary {summary.id} lost {missing}"
        checked += len(planted)
    assert checked > 500


async def test_building_again_changes_nothing(
    engine: AsyncEngine, built: Built, config: tree.TreeConfig
) -> None:
    before = await snapshot(engine, built.conversation_id)
    progress = await tree.build(
        engine,
        tenant_id=built.tenant_id,
        conversation_id=built.conversation_id,
        config=config,
    )
    assert progress == tree.Progress(embedded=0, segments=0, rollups=0)
    assert await snapshot(engine, built.conversation_id) == before


async def test_incremental_build_gives_the_same_tree(
    engine: AsyncEngine, built: Built, config: tree.TreeConfig
) -> None:
    """The same 2,000 messages arriving in 10 batches, with a build after each."""
    conversation = built.conversation
    tenant = await new_tenant(engine)
    conversation_id = 0
    batch = N_MESSAGES // 10
    for start in range(0, N_MESSAGES, batch):
        conversation_id = await store_messages(
            engine,
            tenant_id=tenant,
            external_id="incremental",
            messages=conversation.messages[start : start + batch],
            created_at=conversation.created_at[start : start + batch],
        )
        await tree.build(engine, tenant_id=tenant, conversation_id=conversation_id, config=config)
    once = await level_counts(engine, built.tenant_id, built.conversation_id)
    assert await level_counts(engine, tenant, conversation_id) == once

    async def shape(tenant_id: int, conversation: int) -> list[tuple[Any, ...]]:
        async with engine.connect() as conn:
            records = await tree_nodes.list_nodes(
                conn, tenant_id=tenant_id, conversation_id=conversation
            )
        return [(r.level, r.seq, r.span_start, r.span_end, r.text, r.facts) for r in records]

    assert await shape(tenant, conversation_id) == await shape(
        built.tenant_id, built.conversation_id
    )
    check_complete(
        await walk_tree(engine, tenant_id=tenant, conversation_id=conversation_id), N_MESSAGES
    )


async def test_final_build_closes_the_open_segment(
    engine: AsyncEngine, config: tree.TreeConfig, tenant_id: int
) -> None:
    # A question never closes the segment it ends, so the last segment is open.
    messages = [
        *synthetic.messages(149, seed=11),
        {"role": "user", "content": "Can you remind me what we decided about this earlier?"},
    ]
    conversation_id = await store_messages(
        engine, tenant_id=tenant_id, external_id="final", messages=messages
    )
    await tree.build(engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config)
    segments = await expected_segments(engine, conversation_id=conversation_id)
    open_tail = 150 - (segments[-1][1] + 1)
    assert open_tail > 0
    progress = await tree.build(
        engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config, final=True
    )
    assert progress.segments == 1
    walk = await walk_tree(engine, tenant_id=tenant_id, conversation_id=conversation_id)
    check_complete(walk, 150)
    assert all(root.level > 0 for root in walk.roots), "a message is left without a summary"
    last = max((s for s in walk.summaries if s.level == 1), key=lambda s: s.seq)
    assert (last.span_end, last.meta["reason"]) == (149, "final")


async def test_a_message_is_written_once_with_its_vector_and_parent(
    engine: AsyncEngine, config: tree.TreeConfig, tenant_id: int
) -> None:
    """Every UPDATE of a row is a new row version with its own HNSW entry: a message whose
    segment closes gets its vector and its parent in one, one in its open segment its vector
    alone, and a message without text only its parent."""
    messages = [
        *synthetic.messages(120, seed=13, with_tools=True),
        {"role": "user", "content": "Can you remind me what we decided about this earlier?"},
    ]
    conversation_id = await store_messages(
        engine, tenant_id=tenant_id, external_id="written-once", messages=messages
    )
    statements = [
        "CREATE TABLE test_node_writes (node_id bigint NOT NULL)",
        "CREATE FUNCTION test_log_node_write() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN INSERT INTO test_node_writes VALUES (NEW.id); RETURN NEW; END $$",
        "CREATE TRIGGER test_node_writes AFTER UPDATE ON nodes FOR EACH ROW "
        f"WHEN (NEW.conversation_id = {conversation_id}) EXECUTE FUNCTION test_log_node_write()",
    ]
    async with engine.begin() as conn:
        for statement in statements:
            await conn.execute(sql(statement))
    try:
        await tree.build(
            engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config
        )
        async with engine.connect() as conn:
            writes: dict[int, int] = dict(
                (
                    await conn.execute(
                        sql("SELECT node_id, count(*) FROM test_node_writes GROUP BY node_id")
                    )
                ).all()
            )
            rows = (
                await conn.execute(
                    select(nodes.c.id, nodes.c.parent_id, nodes.c.embedding.is_not(None)).where(
                        nodes.c.conversation_id == conversation_id, nodes.c.level == 0
                    )
                )
            ).all()
    finally:
        async with engine.begin() as conn:
            await conn.execute(sql("DROP TRIGGER test_node_writes ON nodes"))
            await conn.execute(sql("DROP FUNCTION test_log_node_write()"))
            await conn.execute(sql("DROP TABLE test_node_writes"))
    adopted = [row.id for row in rows if row.parent_id is not None]
    assert 0 < len(adopted) < len(rows), "expected closed segments and an open tail"
    assert any(not has_vector for *_, has_vector in rows), "expected a message without text"
    for node_id, parent_id, has_vector in rows:
        assert writes.get(node_id, 0) == (1 if parent_id is not None or has_vector else 0)


# --- admin endpoints over a built conversation ---------------------------------------------


@pytest.fixture
def fresh_upstream(upstream: UpstreamServer) -> UpstreamServer:
    upstream.reset()
    return upstream


async def test_admin_import_hierarchy_and_node(
    engine: AsyncEngine, database_url: str, config: tree.TreeConfig
) -> None:
    name = f"test-{uuid.uuid4().hex}"
    tenant_id = await new_tenant(engine, name)
    other = f"test-{uuid.uuid4().hex}"
    await new_tenant(engine, other)
    conversation = synthetic.generate(120, seed=5)
    external = "admin-tree"
    scope = {"tenant": name}
    async with (
        running_app(Settings(database_url=database_url, workers=0)) as app,
        app.client() as client,
    ):
        response = await client.post(
            f"/admin/conversations/{external}/messages",
            params=scope,
            json={"messages": conversation.with_created_at()},
        )
        assert response.status_code == 201, response.text
        assert response.json() == {
            "conversation": external,
            "imported": 120,
            "skipped": 0,
            "first_seq": 0,
        }
        # The import queued the build; a worker runs it.
        listed = (await client.get("/admin/jobs", params=scope)).json()
        assert [(j["kind"], j["status"]) for j in listed["jobs"]] == [(tree.JOB_KIND, "queued")]
        await worker(engine, config).run_until_idle()
        listed = (await client.get("/admin/jobs", params=scope)).json()
        assert [(j["status"], j["attempts"]) for j in listed["jobs"]] == [("done", 1)]
        assert listed["depth"]["done"] == 1 and listed["depth"]["queued"] == 0

        response = await client.get(f"/admin/conversations/{external}/hierarchy", params=scope)
        assert response.status_code == 200, response.text
        hierarchy = response.json()
        assert hierarchy["conversation"] == external
        conversation_id = await conversation_id_of(engine, tenant_id, external)
        segments = await expected_segments(engine, conversation_id=conversation_id)
        levels = expected_levels(120, len(segments))
        assert hierarchy["levels"] == {str(level): count for level, count in levels.items()}
        summaries = hierarchy["nodes"]
        assert len(summaries) == sum(count for level, count in levels.items() if level > 0)
        by_id = {node["id"]: node for node in summaries}
        covered: list[int] = []
        for node in summaries:
            assert {"id", "level", "seq", "span", "children", "method", "facts", "text"} <= set(
                node
            )
            assert node["level"] >= 1 and node["method"] == "extractive"
            assert node["conversation"] == external
            start, end = node["span"]
            assert 0 <= start <= end < 120
            if node["level"] == 1:
                assert len(node["children"]) == end - start + 1
                covered.extend(range(start, end + 1))
            else:
                assert len(node["children"]) == FANOUT
                kids = [by_id[child] for child in node["children"]]
                assert all(kid["parent_id"] == node["id"] for kid in kids)
                assert (kids[0]["span"][0], kids[-1]["span"][1]) == (start, end)
        assert covered == list(range(segments[-1][1] + 1))
        # Highest level first, in order within a level.
        assert [(n["level"], n["seq"]) for n in summaries] == sorted(
            ((n["level"], n["seq"]) for n in summaries), key=lambda p: (-p[0], p[1])
        )

        # One summary and one message, by id.
        top = summaries[0]
        response = await client.get(f"/admin/nodes/{top['id']}", params=scope)
        assert response.status_code == 200, response.text
        assert response.json() == top
        first_segment = next(n for n in summaries if n["level"] == 1 and n["seq"] == 0)
        response = await client.get(f"/admin/nodes/{first_segment['children'][0]}", params=scope)
        message = response.json()
        assert message["level"] == 0 and message["span"] == [0, 0]
        assert message["parent_id"] == first_segment["id"]
        assert message["role"] == conversation.messages[0]["role"]
        assert message["content"] == conversation.messages[0]["content"]
        assert message["children"] == [] and message["method"] is None

        # Another tenant sees neither the node nor the conversation.
        response = await client.get(f"/admin/nodes/{top['id']}", params={"tenant": other})
        assert response.status_code == 404
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        response = await client.get(
            f"/admin/conversations/{external}/hierarchy", params={"tenant": other}
        )
        assert response.status_code == 404


async def conversation_id_of(engine: AsyncEngine, tenant_id: int, external_id: str) -> int:
    async with engine.connect() as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=external_id)
    return ref.id


# --- llm and auto modes -----------------------------------------------------------------------

TRIAGE = [
    ("user", "Priya Raman here. INV-2041 reports duplicate invoices in the export since v2.14.3."),
    ("assistant", "I looked at INV-2041: the export job retries without an idempotency key."),
    ("user", "Finance says the duplicates total $18,400 across 37 customers."),
    ("assistant", "Then INV-2041 is a P1; I linked PAY-3310 because it shows the same trace."),
    ("user", "Can we ship a fix before 2025-03-14, the month-end close?"),
    ("assistant", "Yes: add the idempotency key and a unique index on export_batches.invoice_id."),
    ("user", "Who reviews it? Marcus Okafor owns the export code."),
    ("assistant", "I asked Marcus Okafor to review; the migration runs in about 4 minutes."),
    ("user", "We also need credit notes for the $18,400 that was double-billed."),
    ("assistant", "I drafted credit notes for the 37 customers, total $18,400, pending approval."),
    ("user", "Keep the rollback plan ready in case the unique index fails to build."),
    ("assistant", "The rollback drops the index concurrently and reverts to v2.14.2."),
    ("user", "The deploy window is 2025-03-12 at 18:00 UTC."),
    ("assistant", "Scheduled the deploy of v2.14.4 for 2025-03-12 18:00 UTC."),
    ("user", "Please post a status note in the incident channel as well."),
    ("assistant", "Posted: INV-2041 fix ships 2025-03-12; refunds of $18,400 follow."),
]
# Two messages a segment, no shift: 8 level-1 summaries and one level-2 roll-up.
PAIRS = SegmentPolicy(shift_threshold=2.0, max_messages=2)
LLM_FACTS = {
    "narrative": "Priya Raman triaged INV-2041 (duplicate invoices worth $18,400).",
    "identifiers": ["INV-2041", "PAY-3310"],
    "numbers": ["$18,400", "37 customers"],
    "names": ["Priya Raman", "Marcus Okafor"],
    "dates": ["2025-03-14"],
    "decisions": ["Add an idempotency key to the export"],
    "open_questions": [],
}


def triage_messages() -> list[dict[str, Any]]:
    return [{"role": role, "content": text} for role, text in TRIAGE]


async def build_triage(
    engine: AsyncEngine, tenant_id: int, config: tree.TreeConfig
) -> tuple[int, Walk]:
    start = datetime(2025, 3, 10, 9, 0, tzinfo=UTC)
    conversation_id = await store_messages(
        engine,
        tenant_id=tenant_id,
        external_id="triage",
        messages=triage_messages(),
        created_at=[start + timedelta(minutes=3 * i) for i in range(len(TRIAGE))],
    )
    # `final`: the last pair closes too, as a forced compaction does.
    await tree.build(
        engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config, final=True
    )
    walk = await walk_tree(
        engine, tenant_id=tenant_id, conversation_id=conversation_id, method=None
    )
    check_complete(walk, len(TRIAGE))
    assert await level_counts(engine, tenant_id, conversation_id) == {0: 16, 1: 8, 2: 1}
    return conversation_id, walk


async def test_extractive_summary_keeps_ids_and_numbers(
    engine: AsyncEngine, embedder: MemoEmbedder, tenant_id: int
) -> None:
    config = tree.TreeConfig(
        embedder=embedder, summarizer=ExtractiveSummarizer("gpt-4o"), policy=PAIRS
    )
    _, walk = await build_triage(engine, tenant_id, config)
    first = next(s for s in walk.summaries if s.level == 1 and s.seq == 0)
    assert first.facts is not None
    assert "INV-2041" in first.facts["identifiers"] and "v2.14.3" in first.facts["identifiers"]
    second = next(s for s in walk.summaries if s.level == 1 and s.seq == 1)
    assert second.facts is not None and "$18,400" in second.facts["numbers"]
    top = next(s for s in walk.summaries if s.level == 2)
    assert top.facts is not None
    for identifier in ("INV-2041", "PAY-3310", "v2.14.3", "v2.14.4"):
        assert identifier in top.facts["identifiers"]
    assert "$18,400" in top.facts["numbers"]
    assert {"2025-03-14", "2025-03-12"} <= {d[:10] for d in top.facts["dates"]}
    assert all(s.method == "extractive" and s.model is None for s in walk.summaries)


async def test_llm_mode_prompt_and_parsing(
    engine: AsyncEngine,
    embedder: MemoEmbedder,
    fresh_upstream: UpstreamServer,
    tenant_id: int,
) -> None:
    fresh_upstream.set_default({"path": "/v1/chat/completions", "reply": json.dumps(LLM_FACTS)})
    provider = Provider(base_url=fresh_upstream.url, api_key="sk-summary", max_retries=0)
    async with contextlib.aclosing(provider):
        summarizer = LLMSummarizer(provider, model=SUMMARY_MODEL)
        config = tree.TreeConfig(embedder=embedder, summarizer=summarizer, policy=PAIRS)
        conversation_id, walk = await build_triage(engine, tenant_id, config)

    requests = fresh_upstream.requests("/v1/chat/completions")
    assert len(requests) == 9  # 8 segments + 1 roll-up
    prompts = []
    for request in requests:
        body = request["body"]
        assert body["model"] == SUMMARY_MODEL
        assert body["response_format"] == {"type": "json_object"}
        assert body["stream"] is False
        assert request["headers"]["authorization"] == "Bearer sk-summary"
        system, user = body["messages"]
        assert system["role"] == "system" and "JSON" in system["content"]
        assert user["role"] == "user"
        prompts.append(user["content"])

    # Each summary's request holds each child tagged with its node id, with its text.
    async with engine.connect() as conn:
        records = {
            r.id: r
            for r in await tree_nodes.list_nodes(
                conn, tenant_id=tenant_id, conversation_id=conversation_id, min_level=0
            )
        }
    for summary in walk.summaries:
        matching = [
            prompt
            for prompt in prompts
            if all(f"[#{child}]" in prompt for child in summary.children)
        ]
        assert len(matching) == 1, f"no single request for summary {summary.id}"
        for child in summary.children:
            child_text = records[child].text
            if summary.level == 1:
                role = records[child].role
                assert f"{role}: {child_text}" in matching[0]
            else:
                assert child_text in matching[0]
                assert f"summary of messages {records[child].span_start}-" in matching[0]

    for summary in walk.summaries:
        assert summary.method == "llm" and summary.model == SUMMARY_MODEL
        assert summary.text == LLM_FACTS["narrative"]
        assert summary.facts is not None
        assert summary.facts["names"] == ["Priya Raman", "Marcus Okafor"]
        assert summary.facts["decisions"] == ["Add an idempotency key to the export"]
        assert summary.facts["identifiers"][:2] == ["INV-2041", "PAY-3310"]
    # Facts the model left out but the messages state are added from the input.
    last = next(s for s in walk.summaries if s.level == 1 and s.seq == 7)
    assert last.facts is not None and "2025-03-12" in " ".join(last.facts["dates"])


async def test_auto_mode_falls_back_to_extractive_on_upstream_500(
    engine: AsyncEngine,
    embedder: MemoEmbedder,
    fresh_upstream: UpstreamServer,
    tenant_id: int,
) -> None:
    fresh_upstream.set_default({"path": "/v1/chat/completions", "status": 500})
    provider = Provider(base_url=fresh_upstream.url, api_key=None, max_retries=0)
    async with contextlib.aclosing(provider):
        llm = LLMSummarizer(provider, model="m")
        summarizer = FallbackSummarizer(llm, ExtractiveSummarizer("gpt-4o"))
        config = tree.TreeConfig(embedder=embedder, summarizer=summarizer, policy=PAIRS)
        _, walk = await build_triage(engine, tenant_id, config)
    assert len(fresh_upstream.requests("/v1/chat/completions")) >= 1, "the LLM was not tried"
    assert all(s.method == "extractive" and s.model is None for s in walk.summaries)
    top = next(s for s in walk.summaries if s.level == 2)
    assert top.facts is not None
    assert "INV-2041" in top.facts["identifiers"] and "$18,400" in top.facts["numbers"]


class Finishing:
    """A summarizer that counts the summaries `inner` finished."""

    def __init__(self, inner: LLMSummarizer) -> None:
        self.inner = inner
        self.finished = 0

    async def summarize(
        self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
    ) -> Summary:
        summary = await self.inner.summarize(items, level=level, target_tokens=target_tokens)
        self.finished += 1
        return summary


async def test_a_failed_summary_stops_the_rest_of_its_batch(
    engine: AsyncEngine,
    embedder: MemoEmbedder,
    fresh_upstream: UpstreamServer,
    tenant_id: int,
) -> None:
    """In `llm` mode a summary the upstream refuses fails the build (its job is retried): the
    other summaries of its batch, still waiting for their answers, are cancelled with it, not
    left running (and billed) for an attempt that stores none of them, beside its retry's."""
    fresh_upstream.set_default(
        {"path": "/v1/chat/completions", "delay": 1.0, "reply": json.dumps(LLM_FACTS)}
    )
    fresh_upstream.script({"path": "/v1/chat/completions", "status": 400})
    provider = Provider(base_url=fresh_upstream.url, api_key=None, max_retries=0)
    async with contextlib.aclosing(provider):
        summarizer = Finishing(LLMSummarizer(provider, model=SUMMARY_MODEL))
        config = tree.TreeConfig(embedder=embedder, summarizer=summarizer, policy=PAIRS)
        conversation_id = await store_messages(
            engine, tenant_id=tenant_id, external_id="refused", messages=triage_messages()
        )
        with pytest.raises(ProviderError, match="HTTP 400"):
            await tree.build(
                engine,
                tenant_id=tenant_id,
                conversation_id=conversation_id,
                config=config,
                final=True,
            )
        # Longer than the answers the other 7 summaries were waiting for.
        await asyncio.sleep(1.5)
        assert summarizer.finished == 0, f"{summarizer.finished} summaries ran on, unused"
    assert len(fresh_upstream.requests("/v1/chat/completions")) == 8
    assert await level_counts(engine, tenant_id, conversation_id) == {0: 16}


async def test_a_summary_postgres_cannot_hold_is_stored_escaped(
    engine: AsyncEngine,
    embedder: MemoEmbedder,
    fresh_upstream: UpstreamServer,
    tenant_id: int,
) -> None:
    """A model that copies `\\u0000` from a conversation about C strings into its JSON (or
    writes half a surrogate pair) hands back a NUL or an unpaired surrogate, which Postgres
    cannot hold: the summary is stored escaped, as a message would be, instead of failing the
    build on every attempt (the model answers the same each time) and the conversation's
    tree stopping there."""
    reply = {
        **LLM_FACTS,
        "narrative": "The buffer ends in a \x00 byte; the name was cut at \ud83d.",
        "identifiers": ["buf\x00end", "\ud83d"],
    }
    fresh_upstream.set_default({"path": "/v1/chat/completions", "reply": json.dumps(reply)})
    provider = Provider(base_url=fresh_upstream.url, api_key=None, max_retries=0)
    async with contextlib.aclosing(provider):
        config = tree.TreeConfig(
            embedder=embedder,
            summarizer=LLMSummarizer(provider, model=SUMMARY_MODEL),
            policy=PAIRS,
        )
        _, walk = await build_triage(engine, tenant_id, config)
    for summary in walk.summaries:
        assert summary.method == "llm"
        assert summary.text == "The buffer ends in a \\u0000 byte; the name was cut at \\ud83d."
        assert summary.facts is not None
        assert summary.facts["identifiers"][:2] == ["buf\\u0000end", "\\ud83d"]
