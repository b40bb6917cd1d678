"""An upstream outage loses no background work (`memory.errors.ProviderUnavailable`).

With `MEMSTRATA_SUMMARY_MODE=llm`, the fake upstream answers every summary request 503 (with a
429 and a dropped connection among them) for 20 s, longer than the five attempts with
exponential backoff from 1 s that used to dead-letter a job (7.5-15 s), then recovers: every
build finishes, with LLM summaries, and no job is dead. A fault that is no outage (a 400) still
spends the job's attempts and ends in the dead letter. (`auto` mode needs none of this: it
falls back to the extractive summarizer, `memory.build.summarize.FallbackSummarizer`.)

A request the upstream fails by itself while it answers others (a summary it always answers
500) is no outage: its job is charged its attempts and ends dead instead of holding back its
conversation for ever (`memory.build.upstream`). Only an answer of the upstream ends a worker's
outage backoff: jobs that get through without calling it (cutting segments, local embeddings)
do not bring deferred jobs back at once.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import synthetic
from devkit.upstream import UpstreamServer
from gateway import background, importer
from memory.build import backlog, jobs, tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import make_summarizer
from memory.build.worker import Worker
from memory.embeddings import make_embedder
from memory.errors import ProviderError, ProviderUnavailable
from memory.provider import Provider
from memory.schema import jobs as jobs_table
from memory.schema import nodes
from tests import own_database
from tests.test_jobs import put, row

# This module's own database (its workers run every queued job).
database_url = own_database.database_url
engine = own_database.engine

pytestmark = pytest.mark.timeout(300)

OUTAGE_SECONDS = 20.0
CONVERSATIONS = 3
MESSAGES = 24
CHAT = "/v1/chat/completions"


@pytest.fixture
async def provider(upstream: UpstreamServer, fresh_upstream: None) -> AsyncIterator[Provider]:
    # No retries of the SDK's own: every failure reaches the job at once.
    client = Provider(base_url=upstream.url, api_key=None, max_retries=0, timeout=10)
    yield client
    await client.aclose()


async def job_rows(engine: AsyncEngine, tenant_id: int) -> list[Any]:
    async with engine.connect() as conn:
        query = select(jobs_table).where(jobs_table.c.tenant_id == tenant_id)
        return list((await conn.execute(query.order_by(jobs_table.c.id))).all())


async def settled(
    engine: AsyncEngine, tenant_id: int, *, within: float, until: Callable[[list[str]], bool]
) -> None:
    """Wait until the statuses of the tenant's jobs, oldest first, meet `until`."""
    deadline = time.monotonic() + within
    while not until(statuses := [row.status for row in await job_rows(engine, tenant_id)]):
        assert time.monotonic() < deadline, f"jobs not settled in {within}s: {statuses}"
        await asyncio.sleep(0.1)


async def import_conversation(
    engine: AsyncEngine, tenant_id: int, name: str, *, seed: int, mark: str = ""
) -> None:
    """Store a synthetic conversation of `MESSAGES` messages (each ending with `mark`), which
    queues its build."""
    conversation = synthetic.generate(MESSAGES, seed=seed)
    await importer.import_messages(
        engine,
        tenant_id=tenant_id,
        external_id=name,
        messages=[{**m, "content": f"{m['content']} {mark}"} for m in conversation.messages],
        created_at=conversation.created_at,
        model="gpt-4o",
        batch=MESSAGES,
    )


def llm_trees(provider: Provider) -> tree.TreeConfig:
    """Builds that embed and summarize (`MEMSTRATA_SUMMARY_MODE=llm`) with the upstream."""
    return tree.TreeConfig(
        embedder=make_embedder(provider="upstream", upstream=provider, model="embed"),
        summarizer=make_summarizer("llm", provider=provider, model="outage-model"),
        policy=SegmentPolicy(token_cap=96),
        fanout=4,
    )


async def test_summary_jobs_wait_out_an_upstream_outage_and_build_every_tree(
    engine: AsyncEngine, tenant_id: int, upstream: UpstreamServer, provider: Provider
) -> None:
    chat = CHAT
    upstream.set_default({"path": chat, "status": 503})
    upstream.script({"path": chat, "status": 429}, {"path": chat, "cut_after": 0})
    for n in range(CONVERSATIONS):
        await import_conversation(engine, tenant_id, f"outage-{n}", seed=40 + n)
    # The queue's default backoff (from 1 s); an outage's waits capped at 2 s, so that the
    # builds resume soon after it.
    worker = Worker(
        engine,
        {tree.JOB_KIND: tree.handler(engine, llm_trees(provider))},
        kinds=[tree.JOB_KIND],
        concurrency=2,
        poll_interval=0.2,
        outage_backoff_cap=2,
    )
    async with background.running(worker):
        await asyncio.sleep(OUTAGE_SECONDS)
        failed = len(upstream.requests(chat))
        upstream.set_default({})
        recovered = time.monotonic()

        def built(statuses: list[str]) -> bool:
            assert "dead" not in statuses, statuses
            return set(statuses) == {"done"}

        await settled(engine, tenant_id, within=60, until=built)
        caught_up = time.monotonic() - recovered

    rows = await job_rows(engine, tenant_id)
    assert len(rows) == CONVERSATIONS
    assert failed > 3 * CONVERSATIONS, "the outage was not met"
    # Every attempt the outage ended was given back: each build ran on its first attempt.
    assert [(row.status, row.attempts) for row in rows] == [("done", 1)] * CONVERSATIONS
    assert caught_up < 15
    async with engine.connect() as conn:
        made: dict[int, int] = dict(
            (
                await conn.execute(
                    select(nodes.c.conversation_id, func.count())
                    .where(
                        nodes.c.tenant_id == tenant_id,
                        nodes.c.level >= 1,
                        nodes.c.method == "llm",
                    )
                    .group_by(nodes.c.conversation_id)
                )
            ).all()
        )
    assert len(made) == CONVERSATIONS and all(count >= 2 for count in made.values()), made


async def test_a_refused_request_still_spends_attempts_but_an_outage_does_not(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    outages = 0

    async def down_ten_times(job: jobs.Job) -> None:
        nonlocal outages
        if job.payload["fault"] == "outage" and outages < 10:
            outages += 1
            raise ProviderUnavailable("summary upstream answered HTTP 503", endpoint="chat")
        if job.payload["fault"] == "refusal":
            raise ProviderError("summary upstream answered HTTP 400 (invalid_request_error)")

    for fault in ("outage", "refusal"):
        await put(engine, kind=kind, tenant_id=tenant_id, payload={"fault": fault}, max_attempts=3)
    worker = Worker(
        engine,
        {kind: down_ten_times},
        kinds=[kind],
        poll_interval=0.05,
        backoff_base=0.01,
        outage_backoff_cap=0.05,
    )
    async with background.running(worker):
        await settled(engine, tenant_id, within=30, until=lambda s: set(s) == {"done", "dead"})
    outage, refusal = await job_rows(engine, tenant_id)
    assert (outage.status, outage.attempts, outages) == ("done", 1, 10)
    assert "HTTP 503" in outage.last_error
    assert (refusal.status, refusal.attempts) == ("dead", 3)
    assert "HTTP 400" in refusal.last_error


async def test_a_summary_the_upstream_always_fails_is_charged_while_it_answers_others(
    engine: AsyncEngine,
    tenant_id: int,
    upstream: UpstreamServer,
    provider: Provider,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every summary request of one conversation gets a 500; the others' are answered.
    poison = "Zq7poisoned"
    upstream.set_default({"path": CHAT, "status": 500, "match": poison})
    await import_conversation(engine, tenant_id, "poisoned", seed=60, mark=poison)
    worker = Worker(
        engine,
        {tree.JOB_KIND: tree.handler(engine, llm_trees(provider))},
        kinds=[tree.JOB_KIND],
        poll_interval=0.05,
        backoff_base=0.05,
        outage_backoff_cap=0.2,
    )
    caplog.set_level(logging.WARNING, logger="memory.build.worker")
    async with background.running(worker):
        # Other conversations keep coming, and get their summaries.
        deadline = time.monotonic() + 30
        fed = 0
        while (await job_rows(engine, tenant_id))[0].status != "dead":
            assert time.monotonic() < deadline, "the poisoned build is not dead after 30s"
            fed += 1
            await import_conversation(engine, tenant_id, f"healthy-{fed}", seed=60 + fed)
            await asyncio.sleep(0.3)
        await settled(engine, tenant_id, within=30, until=lambda s: s == ["dead"] + ["done"] * fed)

    poisoned = (await job_rows(engine, tenant_id))[0]
    # Its first failure was free (the upstream might have been down); each later one came after
    # other summaries were answered, and was charged.
    assert (poisoned.attempts, poisoned.max_attempts) == (5, 5)
    assert "summary upstream answered HTTP 500" in poisoned.last_error
    charged = [r for r in caplog.records if "charged although" in r.getMessage()]
    assert len(charged) == 5 and all(r.levelno == logging.WARNING for r in charged), charged
    assert f"job {poisoned.id} (conversation) failed on attempt 5 of 5" in charged[-1].getMessage()
    # Downstream: no summary past the poisoned segment (here: none at all); the dead build is in
    # the admin backlog and can be retried.
    async with engine.connect() as conn:
        summaries = await conn.scalar(
            select(func.count()).where(
                nodes.c.conversation_id == poisoned.conversation_id, nodes.c.level >= 1
            )
        )
        dead = await backlog.list_jobs(conn, status="dead", tenant_id=tenant_id)
    assert summaries == 0
    assert [job.id for job in dead] == [poisoned.id]
    async with engine.begin() as conn:
        assert await jobs.retry(conn, job_id=poisoned.id, tenant_id=tenant_id)


async def test_only_an_answer_of_the_upstream_ends_an_outage_backoff(
    engine: AsyncEngine, tenant_id: int, upstream: UpstreamServer, provider: Provider, kind: str
) -> None:
    calling, local = kind, f"{kind}-local"

    async def call_upstream(job: jobs.Job) -> None:
        hello = [{"role": "user", "content": "hello"}]
        await provider.post("chat", {"model": "m", "messages": hello}, what="summary")

    async def stay_local(job: jobs.Job) -> None:
        """A job that gets through without the upstream (cutting segments, local embedding)."""

    worker = Worker(engine, {calling: call_upstream, local: stay_local}, kinds=[calling, local])

    async def deferrals(job_id: int, rounds: int) -> list[float]:
        """The waits the worker chose for `job_id` in `rounds` rounds, each running it (it is
        made due at once: a clock moved forward) and then a job that does not call upstream."""
        waits = []
        for _ in range(rounds):
            async with engine.begin() as conn:
                made_due = update(jobs_table).where(jobs_table.c.id == job_id)
                await conn.execute(made_due.values(run_after=func.now()))
            await put(engine, kind=local, tenant_id=tenant_id)
            assert await worker.run_until_idle() == 2
            deferred = await row(engine, job_id)
            assert (deferred.status, deferred.attempts) == ("queued", 0)
            waits.append((deferred.run_after - deferred.updated_at).total_seconds())
        return waits

    upstream.set_default({"path": CHAT, "status": 503})
    down = await put(engine, kind=calling, tenant_id=tenant_id)
    waits = await deferrals(down, 5)
    # The outage's backoff from 1 s, doubling (equal jitter: between half and all of it),
    # although a job got through between each two failures.
    assert all(2**n / 2 <= wait <= 2**n for n, wait in enumerate(waits)), waits

    upstream.set_default({})  # back: a job's request is answered, which ends the outage
    async with engine.begin() as conn:
        await conn.execute(
            update(jobs_table).where(jobs_table.c.id == down).values(run_after=func.now())
        )
    assert await worker.run_until_idle() == 1
    assert (await row(engine, down)).status == "done"
    upstream.set_default({"path": CHAT, "status": 503})
    [wait] = await deferrals(await put(engine, kind=calling, tenant_id=tenant_id), 1)
    assert 0.5 <= wait <= 1


@pytest.mark.parametrize(
    ("behaviour", "passing"),
    [
        ({"status": 503}, True),
        ({"status": 500}, True),
        ({"status": 429}, True),
        ({"status": 408}, True),
        ({"status": 409}, True),  # a lock timeout, retried by the SDK too
        ({"cut_after": 0}, True),
        ({"status": 400}, False),
        ({"status": 401}, False),
        ({"status": 404}, False),
    ],
)
async def test_an_upstream_that_is_down_or_busy_is_told_apart_from_a_refusal(
    upstream: UpstreamServer, provider: Provider, behaviour: dict[str, Any], passing: bool
) -> None:
    upstream.script(behaviour)
    with pytest.raises(ProviderError) as raised:
        hello = [{"role": "user", "content": "hello"}]
        await provider.post("chat", {"model": "m", "messages": hello}, what="summary")
    assert isinstance(raised.value, ProviderUnavailable) is passing
