"""Branches below the HTTP edge (`memory.write.branches`): what moving the current branch does
to the summary tree, and what recall may read, against a real Postgres, real local
embeddings and the extractive summarizer."""

import asyncio
import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.build import summary_nodes, tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer, Summary, SummaryInput
from memory.build.worker import Worker
from memory.embeddings import LocalEmbedder
from memory.recall import retrieval
from memory.schema import nodes
from memory.write import appends, identity, store

MODEL = "gpt-4o"
# Segments of two messages, so that a short conversation has a tree.
PAIRS = SegmentPolicy(shift_threshold=2.0, max_messages=2)
# Segments that only a final build closes (in conversations that say no "done").
OPEN = SegmentPolicy(shift_threshold=2.0)

Message = dict[str, Any]


@pytest.fixture(scope="module")
async def config() -> tree.TreeConfig:
    embedder = LocalEmbedder()
    await embedder.warmup()
    return tree.TreeConfig(embedder=embedder, summarizer=ExtractiveSummarizer(MODEL), policy=PAIRS)


async def turn(
    engine: AsyncEngine, tenant_id: int, external_id: str, sent: list[Message], answer: str
) -> store.Appended:
    """One request: `sent` stored as the gateway stores a request, then its reply recorded."""
    async with engine.begin() as conn:
        found = await identity.identify(
            conn, tenant_id=tenant_id, external_id=external_id, user=None, messages=sent
        )
        stored = await store.store_new(
            conn, tenant_id=tenant_id, found=found, messages=sent, model=MODEL
        )
        await store.append(
            conn,
            tenant_id=tenant_id,
            conversation_id=stored.conversation.id,
            messages=[{"role": "assistant", "content": answer}],
            model=MODEL,
            request=appends.RequestStats(sent=0, full=0),
            reply_to=stored.reply_to,
        )
    return stored


async def level_one(engine: AsyncEngine, conversation_id: int) -> list[tuple[int, int]]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(nodes.c.span_start, nodes.c.span_end)
            .where(nodes.c.conversation_id == conversation_id, nodes.c.level == 1)
            .order_by(nodes.c.seq)
        )
        return [(row.span_start, row.span_end) for row in rows]


async def test_a_branch_drops_the_summaries_over_it_and_the_rebuild_skips_the_abandoned(
    engine: AsyncEngine, tenant_id: int, config: tree.TreeConfig
) -> None:
    external_id = f"branch-tree-{uuid.uuid4().hex}"
    topics = ["volcano basalt", "glacier moraine", "coral atoll", "desert erg"]
    history: list[Message] = []
    for index, topic in enumerate(topics):
        history.append({"role": "user", "content": f"Tell me about the {topic}."})
        stored = await turn(engine, tenant_id, external_id, history, f"The {topic} answer {index}.")
        history.append({"role": "assistant", "content": f"The {topic} answer {index}."})
    conversation_id = stored.conversation.id
    await tree.build(
        engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config, final=True
    )
    assert await level_one(engine, conversation_id) == [(0, 1), (2, 3), (4, 5), (6, 7)]

    # The client edits the third question: messages 4-7 leave the branch.
    edited = [*history[:4], {"role": "user", "content": "Tell me about the tundra permafrost."}]
    branched = await turn(engine, tenant_id, external_id, edited, "The tundra answer.")
    assert (branched.first_seq, branched.branched_at) == (8, 4)
    assert await level_one(engine, conversation_id) == [(0, 1), (2, 3)]
    edited.append({"role": "assistant", "content": "The tundra answer."})
    edited.append({"role": "user", "content": "And the steppe grassland?"})
    await turn(engine, tenant_id, external_id, edited, "The steppe answer.")
    await tree.build(
        engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config, final=True
    )

    assert await level_one(engine, conversation_id) == [(0, 1), (2, 3), (8, 9), (10, 11)]
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(
                    nodes.c.seq, nodes.c.parent_id, nodes.c.superseded_at, nodes.c.embedding
                ).where(nodes.c.conversation_id == conversation_id, nodes.c.level == 0)
            )
        ).all()
    abandoned = {row.seq for row in rows if row.superseded_at is not None}
    assert abandoned == {4, 5, 6, 7}
    assert all(row.parent_id is None for row in rows if row.seq in abandoned)
    assert all(row.parent_id is not None for row in rows if row.seq not in abandoned)
    # Abandoned messages stay searchable: they are embedded all the same.
    assert all(row.embedding is not None for row in rows)
    async with engine.begin() as conn:
        history_now = await store.history(
            conn, tenant_id=tenant_id, conversation_id=conversation_id, before_seq=100
        )
    assert [m["content"] for m in history_now] == [m["content"] for m in edited] + [
        "The steppe answer."
    ]


async def test_recall_reads_abandoned_branches_only_when_asked(
    engine: AsyncEngine, tenant_id: int, config: tree.TreeConfig
) -> None:
    external_id = f"branch-recall-{uuid.uuid4().hex}"
    opening = [{"role": "user", "content": "Name a mineral."}]
    first = await turn(engine, tenant_id, external_id, opening, "Zanzibarite, a rare mineral.")
    await turn(engine, tenant_id, external_id, opening, "Quartz, a common mineral.")  # regenerated
    conversation_id = first.conversation.id
    await tree.build(engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config)
    [vector] = await config.embedder.embed(["zanzibarite"])

    async def found(abandoned: bool) -> list[str]:
        async with engine.begin() as conn:
            hits = await retrieval.search(
                conn,
                tenant_id=tenant_id,
                conversation_ids=[conversation_id],
                query="zanzibarite",
                query_vector=vector,
                abandoned=abandoned,
            )
        return [hit.text for hit in hits]

    assert "Zanzibarite, a rare mineral." not in await found(False)
    assert "Zanzibarite, a rare mineral." in await found(True)


async def test_a_summary_being_written_holds_up_a_branch_move_and_no_other_turn(
    engine: AsyncEngine, tenant_id: int
) -> None:
    external_id = f"branch-lock-{uuid.uuid4().hex}"
    history: list[Message] = [{"role": "user", "content": "Tell me about the fjord."}]
    stored = await turn(engine, tenant_id, external_id, history, "The fjord answer.")
    history.append({"role": "assistant", "content": "The fjord answer."})
    async with engine.connect() as writer:
        # What the build holds while it writes a summary and its children's vectors.
        transaction = await writer.begin()
        assert await summary_nodes.hold_branch(writer, conversation_id=stored.conversation.id)
        history.append({"role": "user", "content": "And the delta?"})
        # A turn that extends the branch does not wait for it: it would never end here.
        extended = await asyncio.wait_for(
            turn(engine, tenant_id, external_id, history, "The delta answer."), timeout=30
        )
        assert extended.branched_at is None
        # A turn that moves the branch (the last question edited) waits for the commit.
        edited = [*history[:2], {"role": "user", "content": "And the estuary?"}]
        moving = asyncio.ensure_future(
            turn(engine, tenant_id, external_id, edited, "The estuary answer.")
        )
        await asyncio.sleep(0.5)
        assert not moving.done()
        await transaction.commit()
    moved = await asyncio.wait_for(moving, timeout=30)
    assert moved.branched_at == extended.first_seq


@pytest.mark.parametrize("edited", ["before it ran", "while it ran", "after it ran"])
async def test_an_edit_does_not_undo_compact_now(
    engine: AsyncEngine, tenant_id: int, config: tree.TreeConfig, edited: str
) -> None:
    """Compact now (a final build, queued as `POST /admin/conversations/{id}/compact` queues it)
    and an edit of the last question: once the workers are idle, every message of the current
    branch stored before the press is summarized. The edit drops the summary over what it
    changed, not the request to close the open segment."""
    external_id = f"branch-compact-{uuid.uuid4().hex}"
    history: list[Message] = []
    for index, topic in enumerate(["volcano basalt", "glacier moraine", "coral atoll"]):
        history.append({"role": "user", "content": f"Tell me about the {topic}."})
        stored = await turn(engine, tenant_id, external_id, history, f"The {topic} answer {index}.")
        history.append({"role": "assistant", "content": f"The {topic} answer {index}."})
    conversation_id = stored.conversation.id
    # The third question edited: messages 4-5 leave the branch, 0-3 stay on it.
    edit = [*history[:4], {"role": "user", "content": "Tell me about the tundra permafrost."}]
    extractive = config.summarizer
    editing = edited == "while it ran"

    class EditingSummarizer:
        """Edits the question while the final build summarizes the open segment."""

        async def summarize(
            self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
        ) -> Summary:
            nonlocal editing
            if editing:
                editing = False
                await turn(engine, tenant_id, external_id, edit, "The tundra answer.")
            return await extractive.summarize(items, level=level, target_tokens=target_tokens)

    builds = dataclasses.replace(config, summarizer=EditingSummarizer(), policy=OPEN)
    worker = Worker(
        engine, {tree.JOB_KIND: tree.handler(engine, builds)}, kinds=[tree.JOB_KIND], listen=False
    )

    async def idle() -> None:
        await worker.run_until_idle(conversations=[conversation_id])

    await idle()
    assert await level_one(engine, conversation_id) == []
    async with engine.begin() as conn:
        await tree.enqueue(conn, tenant_id=tenant_id, conversation_id=conversation_id, final=True)
    if edited == "after it ran":
        await idle()
        assert await level_one(engine, conversation_id) == [(0, 5)]
    if edited != "while it ran":
        await turn(engine, tenant_id, external_id, edit, "The tundra answer.")
    await idle()

    assert not editing
    async with engine.connect() as conn:
        unsummarized = (
            await conn.scalars(
                select(nodes.c.seq)
                .where(
                    nodes.c.conversation_id == conversation_id,
                    nodes.c.level == 0,
                    nodes.c.seq <= 5,
                    nodes.c.superseded_at.is_(None),
                    nodes.c.parent_id.is_(None),
                )
                .order_by(nodes.c.seq)
            )
        ).all()
    assert unsummarized == []
