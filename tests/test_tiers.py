"""Lifecycle tiers (`memory.tiers`, `memory.build.sweeper`, `memory.recall.tiered`) against a real
Postgres: lazy promotion on access, demotion by the sweeper, the hot boost, the warm-first search
over a large scope, and accesses counted off the request path."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway import background
from gateway.settings import Settings
from memory import tiers
from memory.build import sweeper, tree
from memory.build.summarize import ExtractiveSummarizer
from memory.build.worker import Worker
from memory.embeddings import Embedder, LocalEmbedder
from memory.recall import retrieval
from memory.write import store
from tests.inprocess import App, running_app
from tests.stored import MODEL, HashEmbedder, built_conversation


async def conversation(
    engine: AsyncEngine, tenant_id: int, texts: Sequence[str], *, embedder: Embedder | None = None
) -> tuple[int, str, list[int]]:
    config = tree.TreeConfig(
        embedder=embedder or HashEmbedder(), summarizer=ExtractiveSummarizer(MODEL)
    )
    return await built_conversation(engine, tenant_id, texts, config=config, replies=False)


async def tier_of(engine: AsyncEngine, node_ids: Sequence[int]) -> list[str]:
    async with engine.connect() as conn:
        rows = dict(
            (
                await conn.execute(
                    text("SELECT node_id, tier FROM node_access WHERE node_id = ANY(:ids)"),
                    {"ids": list(node_ids)},
                )
            ).all()
        )
    return [rows.get(node, "cold") for node in node_ids]


async def access(engine: AsyncEngine, tenant_id: int, node_ids: Sequence[int]) -> None:
    async with engine.begin() as conn:
        await tiers.record(conn, tenant_id=tenant_id, accessed=Counter(node_ids))


async def age(engine: AsyncEngine, node_ids: Sequence[int], by: timedelta) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE node_access SET last_access = last_access - CAST(:by AS interval), "
                "window_start = window_start - CAST(:by AS interval) WHERE node_id = ANY(:ids)"
            ),
            {"by": by, "ids": list(node_ids)},
        )


async def test_promotion_is_lazy_on_access(engine: AsyncEngine, tenant_id: int) -> None:
    _, _, ids = await conversation(engine, tenant_id, ["one", "two", "three"])
    assert await tier_of(engine, ids) == ["cold", "cold", "cold"]
    await access(engine, tenant_id, [ids[0], ids[1]])
    assert await tier_of(engine, ids) == ["warm", "warm", "cold"]
    await access(engine, tenant_id, [ids[0]])
    await access(engine, tenant_id, [ids[0]])
    assert await tier_of(engine, ids) == ["hot", "warm", "cold"]
    # Accesses older than the window no longer count: the window restarts.
    await age(engine, [ids[1]], tiers.WINDOW + timedelta(hours=1))
    await access(engine, tenant_id, [ids[1], ids[1]])
    assert await tier_of(engine, ids) == ["hot", "warm", "cold"]


async def test_another_tenants_nodes_are_not_counted(engine: AsyncEngine, tenant_id: int) -> None:
    _, _, ids = await conversation(engine, tenant_id, ["mine"])
    async with engine.begin() as conn:
        other = int(
            await conn.scalar(
                text("INSERT INTO tenants (name) VALUES (:n) RETURNING id"),
                {"n": f"test-{uuid.uuid4().hex}"},
            )
        )
    await access(engine, other, ids)
    assert await tier_of(engine, ids) == ["cold"]


async def test_the_sweeper_demotes_hot_then_warm(engine: AsyncEngine, tenant_id: int) -> None:
    _, _, ids = await conversation(engine, tenant_id, ["a", "b", "c"])
    await access(engine, tenant_id, [ids[0]] * 3 + [ids[1]] * 3 + [ids[2]])
    assert await tier_of(engine, ids) == ["hot", "hot", "warm"]
    await age(engine, [ids[0]], tiers.HOT_IDLE + timedelta(minutes=1))
    await age(engine, [ids[2]], tiers.WINDOW + timedelta(minutes=1))
    # The sweep runs as a job, which queues the next one.
    await sweeper.schedule(engine)
    worker = Worker(
        engine, {sweeper.JOB_KIND: sweeper.handler(engine, every=3600)}, kinds=[sweeper.JOB_KIND]
    )
    assert await worker.run_until_idle() >= 1
    assert await tier_of(engine, ids) == ["warm", "hot", "cold"]
    async with engine.connect() as conn:
        queued = await conn.scalar(
            text("SELECT count(*) FROM jobs WHERE kind = :k AND status = 'queued'"),
            {"k": sweeper.JOB_KIND},
        )
    assert queued == 1  # the next sweep, an hour away
    # Nothing is deleted: the cold message is still there, and still found.
    async with engine.connect() as conn:
        node = await store.get_node(conn, tenant_id=tenant_id, node_id=ids[2])
    assert node.text == "c"


async def test_a_hot_node_is_raised_above_an_equal_one(engine: AsyncEngine, tenant_id: int) -> None:
    conversation_id, _, ids = await conversation(engine, tenant_id, ["first", "second"])
    scores = {(conversation_id, 0, 0): 1.0, (conversation_id, 0, 1): 1.0}
    async with engine.connect() as conn:
        before = await retrieval.load(conn, tenant_id=tenant_id, scores=scores, limit=2)
    assert [hit.node_id for hit in before] == [ids[1], ids[0]]  # ties: the newer first
    await access(engine, tenant_id, [ids[0]] * tiers.HOT_ACCESSES)
    async with engine.connect() as conn:
        after = await retrieval.load(conn, tenant_id=tenant_id, scores=scores, limit=2)
    assert [hit.node_id for hit in after] == [ids[0], ids[1]]
    assert after[0].score == pytest.approx(tiers.HOT_BOOST)


FACTS = [
    "The dentist appointment is on Tuesday at nine.",
    "Our wifi password is hidden under the router.",
    "The garage door opener needs a new battery.",
    "The escrow reference is ZQX-88412-B, keep it for the bank.",
    "Grandma's lasagna gets a pinch of nutmeg in the bechamel.",
    "The cat's vaccination is due in April.",
]


async def test_warm_first_and_a_cold_fact_is_still_found(
    engine: AsyncEngine, tenant_id: int
) -> None:
    embedder = LocalEmbedder()
    conversation_id, _, ids = await conversation(engine, tenant_id, FACTS, embedder=embedder)
    # The dentist and the lasagna have been used lately; the rest of the history is cold.
    await access(engine, tenant_id, [ids[0], ids[4]])

    async def search(query: str, limit: int) -> list[int]:
        [vector] = await embedder.embed([query])
        async with engine.connect() as conn:
            hits = await retrieval.search(
                conn,
                tenant_id=tenant_id,
                conversation_ids=[conversation_id],
                query=query,
                query_vector=vector,
                limit=limit,
                tiered_from=1,  # this small history counts as large
            )
        return [hit.node_id for hit in hits]

    # A question a warm message answers: answered from the warm tier alone.
    assert await search("When is my dentist appointment on Tuesday?", 1) == [ids[0]]
    # Questions only cold messages answer: the warm tier comes up short, cold is searched.
    assert ids[3] in await search("What is the escrow reference for the bank?", 3)
    assert ids[5] in await search("When is the cat's vaccination due?", 3)


# -- accesses counted through the gateway ----------------------------------------------------------


@pytest.fixture(scope="module")
async def app(database_url: str) -> AsyncIterator[App]:
    async with running_app(Settings(_env_file=None, database_url=database_url, workers=0)) as up:
        yield up


async def test_search_results_are_accesses_recorded_in_the_background(
    app: App, engine: AsyncEngine
) -> None:
    name = f"tiers-{uuid.uuid4().hex[:10]}"
    async with app.client() as admin:
        created = await admin.post("/admin/tenants", json={"name": name})
        tenant_id = int(created.json()["id"])
        _, external_id, ids = await conversation(
            engine, tenant_id, FACTS, embedder=app.state.embedder
        )
        found = await admin.get(
            "/admin/search",
            params={"tenant": name, "q": "escrow reference", "conversation": external_id},
        )
        assert found.status_code == 200
        returned = [hit["node_id"] for hit in found.json()["data"]]
        assert ids[3] in returned
        # Counted in memory only, until the recorder flushes.
        assert await tier_of(engine, [ids[3]]) == ["cold"]
        await background.flush(engine, app.state.accesses)
        assert await tier_of(engine, [ids[3]]) == ["warm"]
        stats = await admin.get(f"/admin/conversations/{external_id}", params={"tenant": name})
        assert stats.json()["tiers"]["warm"] == len(returned)
        # A dry run counts nothing.
        await admin.post(
            f"/admin/conversations/{external_id}/context",
            params={"tenant": name},
            json={"query": "escrow reference", "budget": 300},
        )
        assert len(app.state.accesses) == 0


def test_tool_results_name_the_nodes_they_return() -> None:
    assert tiers.ids_in("[#12] message 3 ...\n[#7] level-1 summary [#x]") == [12, 7]
    pending = tiers.Accesses()
    pending.add(1, [5, 5, 6])
    pending.add(2, [])
    assert len(pending) == 2
    assert pending.take() == {1: Counter({5: 2, 6: 1})}
    assert len(pending) == 0
