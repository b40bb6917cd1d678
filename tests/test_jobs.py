"""The durable job queue (`memory.build.jobs`) against a real Postgres.

Jobs are global to the database (workers serve every tenant), so each test uses a job kind of
its own and claims only that kind: leftovers of other tests are never seen.
"""

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import delete, insert, make_url, select, text, update
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory.build import backlog, jobs, outcomes
from memory.build.backoff import backoff_seconds
from memory.build.worker import Worker, _listen_dsn
from memory.db import connect
from memory.errors import InvalidInput, NotFound
from memory.schema import conversations, tenants
from memory.schema import jobs as jobs_table


async def new_conversation(engine: AsyncEngine, tenant_id: int) -> int:
    async with engine.begin() as conn:
        created = await conn.scalar(
            insert(conversations)
            .values(tenant_id=tenant_id, external_id=f"c-{uuid.uuid4().hex}")
            .returning(conversations.c.id)
        )
    assert created is not None
    return int(created)


async def new_tenant(engine: AsyncEngine) -> int:
    async with engine.begin() as conn:
        created = await conn.scalar(
            insert(tenants).values(name=f"test-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
    assert created is not None
    return int(created)


async def put(
    engine: AsyncEngine,
    *,
    kind: str,
    tenant_id: int,
    conversation_id: int | None = None,
    **options: Any,
) -> int:
    """Enqueue one job and commit; its id."""
    async with engine.begin() as conn:
        job_id = await jobs.enqueue(
            conn, kind=kind, tenant_id=tenant_id, conversation_id=conversation_id, **options
        )
    assert job_id is not None
    return job_id


async def row(engine: AsyncEngine, job_id: int) -> Any:
    async with engine.connect() as conn:
        return (
            await conn.execute(
                select(
                    jobs_table,
                    (jobs_table.c.run_after - text("now()")).label("run_in"),
                ).where(jobs_table.c.id == job_id)
            )
        ).one_or_none()


async def take(
    engine: AsyncEngine, kind: str, *, worker: str = "w", lease: float = 30
) -> jobs.Job | None:
    return await jobs.claim(engine, worker_id=worker, lease_seconds=lease, kinds=[kind])


async def eligible(engine: AsyncEngine, kind: str) -> list[int]:
    """The ids `claim` would consider now, oldest first."""
    candidate = jobs_table.alias("candidate")
    async with engine.connect() as conn:
        listed = await conn.scalars(
            select(candidate.c.id)
            .where(jobs._eligible(candidate), candidate.c.kind == kind)
            .order_by(candidate.c.id)
        )
        return list(listed)


async def eventually(check: Callable[[], Awaitable[bool]], *, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# --- enqueue ---------------------------------------------------------------------------------


async def test_enqueue_rolls_back_with_its_transaction(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    async with engine.connect() as conn:
        transaction = await conn.begin()
        job_id = await jobs.enqueue(conn, kind=kind, tenant_id=tenant_id, conversation_id=None)
        assert job_id is not None
        await transaction.rollback()
    assert await row(engine, job_id) is None
    assert await take(engine, kind) is None

    committed = await put(engine, kind=kind, tenant_id=tenant_id, payload={"n": 1})
    stored = await row(engine, committed)
    assert (stored.status, stored.attempts, stored.payload) == ("queued", 0, {"n": 1})


async def test_enqueue_refuses_bad_arguments(engine: AsyncEngine, tenant_id: int) -> None:
    async with engine.begin() as conn:
        for bad in ({"kind": ""}, {"max_attempts": 0}, {"delay_seconds": -1}):
            arguments: dict[str, Any] = {"kind": "k", **bad}
            with pytest.raises(InvalidInput):
                await jobs.enqueue(conn, tenant_id=tenant_id, conversation_id=None, **arguments)


async def test_dedupe_while_queued_but_not_once_running(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    key = f"{kind}:work"
    first = await put(engine, kind=kind, tenant_id=tenant_id, dedupe_key=key)
    async with engine.begin() as conn:
        again = await jobs.enqueue(
            conn, kind=kind, tenant_id=tenant_id, conversation_id=None, dedupe_key=key
        )
    assert again is None

    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == first
    # The running job may already have read its input: new work must queue behind it.
    second = await put(engine, kind=kind, tenant_id=tenant_id, dedupe_key=key)
    assert second != first
    async with engine.begin() as conn:
        assert (
            await jobs.enqueue(
                conn, kind=kind, tenant_id=tenant_id, conversation_id=None, dedupe_key=key
            )
            is None
        )


async def test_new_work_deduplicated_into_a_queued_job_holds_it_until_it_commits(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """An enqueue that finds its job already queued adds its work to that job: the job must not
    start before the enqueuer's transaction commits, or it would run without the data that
    transaction wrote, and nothing else would be queued for that data."""
    conversation = await new_conversation(engine, tenant_id)
    key = f"{kind}:build"
    queued = await put(
        engine, kind=kind, tenant_id=tenant_id, conversation_id=conversation, dedupe_key=key
    )
    async with engine.connect() as conn:
        transaction = await conn.begin()
        # (The enqueuer's data, written in this transaction, not committed yet.)
        deduplicated = await jobs.enqueue(
            conn, kind=kind, tenant_id=tenant_id, conversation_id=conversation, dedupe_key=key
        )
        assert deduplicated is None
        assert await take(engine, kind) is None
        await transaction.commit()
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == queued


async def test_delayed_job_waits(engine: AsyncEngine, tenant_id: int, kind: str) -> None:
    job_id = await put(engine, kind=kind, tenant_id=tenant_id, delay_seconds=0.3)
    assert await take(engine, kind) is None
    await asyncio.sleep(0.35)
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == job_id


# --- claim: order and concurrency --------------------------------------------------------------


async def test_claim_order_and_per_conversation_order(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    conv_a = await new_conversation(engine, tenant_id)
    conv_b = await new_conversation(engine, tenant_id)
    a1 = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv_a)
    a2 = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv_a)
    b1 = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv_b)
    loose = await put(engine, kind=kind, tenant_id=tenant_id)

    first = await take(engine, kind)
    assert first is not None and (first.id, first.attempts, first.locked_by) == (a1, 1, "w")
    # a2 must wait for a1; b1 and the job without a conversation need not.
    assert [j.id for j in [await take(engine, kind), await take(engine, kind)] if j] == [b1, loose]
    assert await take(engine, kind) is None

    await outcomes.complete(engine, job=first)
    second = await take(engine, kind)
    assert second is not None and second.id == a2


async def test_failed_job_holds_back_its_conversation_until_dead(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    conv = await new_conversation(engine, tenant_id)
    first = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv, max_attempts=2)
    after = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv)

    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == first
    await outcomes.fail(engine, job=claimed, error="boom", backoff_base=0.2)
    # Waiting out its backoff, the failed job still goes before the next one.
    assert await take(engine, kind) is None
    await asyncio.sleep(0.25)
    claimed = await take(engine, kind)
    assert claimed is not None and (claimed.id, claimed.attempts) == (first, 2)

    await outcomes.fail(engine, job=claimed, error="boom again")
    assert (await row(engine, first)).status == "dead"
    # A dead job no longer holds the conversation back.
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == after


async def test_an_older_job_committed_late_waits_for_the_running_one(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """Ids are taken at insert, visibility comes at commit: a smaller id can appear later."""
    conv = await new_conversation(engine, tenant_id)
    async with engine.connect() as slow:
        transaction = await slow.begin()
        older = await jobs.enqueue(slow, kind=kind, tenant_id=tenant_id, conversation_id=conv)
        newer = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv)
        running = await take(engine, kind)
        assert running is not None and running.id == newer
        await transaction.commit()
    assert older is not None and older < newer
    # One job of a conversation at a time, even out of order.
    assert await take(engine, kind) is None
    await outcomes.complete(engine, job=running)
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == older


async def test_claims_of_one_conversation_take_turns(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """A claimer deciding about a conversation (holding its advisory lock) makes others skip it."""
    conv_a = await new_conversation(engine, tenant_id)
    conv_b = await new_conversation(engine, tenant_id)
    a1 = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv_a)
    b1 = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv_b)
    async with engine.connect() as other:
        transaction = await other.begin()
        await other.execute(
            text("SELECT pg_advisory_xact_lock(:namespace, :key)"),
            {"namespace": jobs._LOCK_NAMESPACE, "key": conv_a},
        )
        claimed = await take(engine, kind)
        assert claimed is not None and claimed.id == b1
        assert await take(engine, kind) is None
        await transaction.rollback()
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == a1


async def test_a_claim_in_progress_keeps_others_off_its_conversation(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """The window the advisory lock closes: two claims of one conversation, both uncommitted.

    `older` commits late, after `newer`. Claimer 1 takes `newer` (it cannot see `older`) and
    has not committed yet. Claimer 2 now sees `older` queued and `newer` still queued (claimer
    1's update is invisible to it), so by its snapshot `older` is eligible; only the lock held
    by claimer 1 keeps it from running `older` beside `newer`.
    """
    conv = await new_conversation(engine, tenant_id)
    async with engine.connect() as slow, engine.connect() as claimer_1:
        late = await slow.begin()
        older = await jobs.enqueue(slow, kind=kind, tenant_id=tenant_id, conversation_id=conv)
        newer = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv)

        claim_1 = await claimer_1.begin()
        assert await jobs._lock_conversation(claimer_1, conv)
        taken = await jobs._take(claimer_1, job_id=newer, worker_id="claimer-1", lease_seconds=30)
        assert taken is not None and older is not None and older < newer

        await late.commit()
        assert await eligible(engine, kind) == [older]  # claimer 2's view
        assert await take(engine, kind, worker="claimer-2") is None
        await claim_1.commit()
    # Now everyone sees `newer` running: `older` waits for it.
    assert await take(engine, kind, worker="claimer-2") is None
    assert (await row(engine, older)).status == "queued"


async def test_a_stale_decision_is_rechecked_under_the_lock(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """The race a one-statement claim would lose.

    Claimer 2 lists `newer` as eligible while `older` is not yet committed. Then `older` commits
    and claimer 1 takes it. When claimer 2 gets the conversation's lock it must not take `newer`
    on the strength of its stale listing: its re-check, in a fresh snapshot, sees `older` running.
    """
    conv = await new_conversation(engine, tenant_id)
    async with engine.connect() as slow:
        transaction = await slow.begin()
        older = await jobs.enqueue(slow, kind=kind, tenant_id=tenant_id, conversation_id=conv)
        newer = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv)

        assert await eligible(engine, kind) == [newer]  # claimer 2's (soon stale) view

        await transaction.commit()
    claimed = await take(engine, kind, worker="claimer-1")
    assert claimed is not None and claimed.id == older

    async with engine.begin() as conn:
        assert await jobs._lock_conversation(conn, conv)
        stale = await jobs._take(conn, job_id=newer, worker_id="claimer-2", lease_seconds=30)
    assert stale is None
    assert (await row(engine, newer)).status == "queued"


async def test_concurrent_claimers_take_each_job_once(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    convs = [await new_conversation(engine, tenant_id) for _ in range(10)]
    expected: dict[int, list[int]] = defaultdict(list)
    async with engine.begin() as conn:
        for n in range(200):
            conv = convs[n % 10]
            job_id = await jobs.enqueue(conn, kind=kind, tenant_id=tenant_id, conversation_id=conv)
            assert job_id is not None
            expected[conv].append(job_id)

    seen: list[int] = []
    order: dict[int, list[int]] = defaultdict(list)
    in_flight: set[int] = set()
    overlaps: list[int] = []

    async def claimer(n: int) -> None:
        while (job := await take(engine, kind, worker=f"claimer-{n}")) is not None:
            assert job.conversation_id is not None
            if job.conversation_id in in_flight:
                overlaps.append(job.id)
            in_flight.add(job.conversation_id)
            seen.append(job.id)
            order[job.conversation_id].append(job.id)
            await asyncio.sleep(random.uniform(0, 0.002))
            in_flight.discard(job.conversation_id)
            await outcomes.complete(engine, job=job)

    # A claimer stops at the first None; rounds repeat until nothing is left (a None can come
    # while the only eligible jobs are being taken by others).
    while len(seen) < 200:
        before = len(seen)
        await asyncio.gather(*(claimer(n) for n in range(8)))
        assert len(seen) > before
    assert sorted(seen) == sorted(i for ids in expected.values() for i in ids)
    assert len(set(seen)) == len(seen) == 200
    assert overlaps == []
    assert dict(order) == dict(expected)


async def test_two_workers_run_every_job_once_in_conversation_order(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    convs = [await new_conversation(engine, tenant_id) for _ in range(10)]
    expected: dict[int | None, list[int]] = defaultdict(list)
    async with engine.begin() as conn:
        for n in range(220):
            # Every eleventh job belongs to no conversation: those are unordered.
            conv = None if n % 11 == 10 else convs[n % 10]
            job_id = await jobs.enqueue(
                conn, kind=kind, tenant_id=tenant_id, conversation_id=conv, payload={"n": n}
            )
            assert job_id is not None
            expected[conv].append(job_id)
    total = sum(len(ids) for ids in expected.values())

    ran: list[int] = []
    order: dict[int | None, list[int]] = defaultdict(list)
    in_flight: set[int] = set()
    overlaps: list[int] = []
    workers_used: set[str] = set()
    stop = asyncio.Event()

    async def handle(job: jobs.Job) -> None:
        conv = job.conversation_id
        if conv is not None:
            if conv in in_flight:
                overlaps.append(job.id)
            in_flight.add(conv)
        await asyncio.sleep(random.uniform(0, 0.003))
        ran.append(job.id)
        order[conv].append(job.id)
        workers_used.add(job.locked_by)
        if conv is not None:
            in_flight.discard(conv)
        if len(ran) >= total:
            stop.set()

    workers = [
        Worker(
            engine,
            {kind: handle},
            kinds=[kind],
            worker_id=f"worker-{n}",
            concurrency=4,
            lease_seconds=10,
            poll_interval=0.05,
        )
        for n in range(2)
    ]
    await asyncio.wait_for(asyncio.gather(*(w.run(stop) for w in workers)), timeout=60)

    assert len(ran) == len(set(ran)) == total
    assert overlaps == []
    for conv, ids in expected.items():
        if conv is not None:
            assert order[conv] == ids
    assert sorted(order[None]) == expected[None]
    assert workers_used == {"worker-0", "worker-1"}
    async with engine.connect() as conn:
        counts = await backlog.depth(conn, tenant_id=tenant_id)
    assert counts == {"queued": 0, "running": 0, "done": total, "dead": 0, "failures": 0}


# --- leases ------------------------------------------------------------------------------------


async def test_an_expired_lease_is_reclaimed(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    conv = await new_conversation(engine, tenant_id)
    first = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv)
    await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv)

    dead_worker = await take(engine, kind, worker="dies", lease=0.1)
    assert dead_worker is not None and dead_worker.id == first
    assert await take(engine, kind, worker="lives") is None
    await asyncio.sleep(0.15)

    # The expired job is reclaimed before its conversation's next job is started.
    assert await eligible(engine, kind) == [first]
    reclaimed = await take(engine, kind, worker="lives")
    assert reclaimed is not None
    assert (reclaimed.id, reclaimed.attempts, reclaimed.locked_by) == (first, 2, "lives")
    assert await take(engine, kind, worker="third") is None

    # The worker presumed dead cannot touch the job any more.
    assert not await outcomes.extend_lease(engine, job=dead_worker, lease_seconds=30)
    await outcomes.complete(engine, job=dead_worker)
    await outcomes.fail(engine, job=dead_worker, error="late")
    stored = await row(engine, first)
    assert (stored.status, stored.locked_by, stored.last_error) == ("running", "lives", None)

    await outcomes.complete(engine, job=reclaimed)
    stored = await row(engine, first)
    assert stored.status == "done" and stored.finished_at is not None


async def test_a_job_whose_worker_keeps_dying_is_dead_lettered_at_max_attempts(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """A worker killed mid-job never calls `fail`: the lease runs out, and the next claim
    must not run the job an extra time once it has had its `max_attempts`."""
    conv = await new_conversation(engine, tenant_id)
    doomed = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv, max_attempts=3)
    after = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv)
    for attempt in (1, 2, 3):
        claimed = await take(engine, kind, worker=f"killed-{attempt}", lease=0.05)
        assert claimed is not None and (claimed.id, claimed.attempts) == (doomed, attempt)
        await asyncio.sleep(0.1)  # the worker dies: no complete, no fail
    # The next claim buries it and moves on to the conversation's next job.
    claimed = await take(engine, kind, worker="survivor")
    assert claimed is not None and claimed.id == after
    stored = await row(engine, doomed)
    assert (stored.status, stored.attempts) == ("dead", 3)
    assert "worker was lost" in stored.last_error and stored.finished_at is not None
    async with engine.begin() as conn:  # a dead letter, retryable like any other
        assert await jobs.retry(conn, job_id=doomed, tenant_id=tenant_id)
    assert (await row(engine, doomed)).status == "queued"


async def test_a_claim_is_told_apart_from_an_earlier_claim_by_the_same_worker(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """Two loops of one Worker share its id: the attempt number tells their claims apart."""
    job_id = await put(engine, kind=kind, tenant_id=tenant_id)
    stale = await take(engine, kind, worker="same", lease=0.1)
    await asyncio.sleep(0.15)
    current = await take(engine, kind, worker="same")
    assert stale is not None and current is not None and current.attempts == 2
    assert not await outcomes.extend_lease(engine, job=stale, lease_seconds=30)
    await outcomes.complete(engine, job=stale)
    assert (await row(engine, job_id)).status == "running"
    await outcomes.complete(engine, job=current)
    assert (await row(engine, job_id)).status == "done"


async def test_extend_lease_keeps_the_job(engine: AsyncEngine, tenant_id: int, kind: str) -> None:
    await put(engine, kind=kind, tenant_id=tenant_id)
    claimed = await take(engine, kind, worker="a", lease=0.2)
    assert claimed is not None
    assert await outcomes.extend_lease(engine, job=claimed, lease_seconds=30)
    await asyncio.sleep(0.25)
    assert await take(engine, kind, worker="b") is None


async def test_worker_keeps_the_lease_of_a_long_job(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    job_id = await put(engine, kind=kind, tenant_id=tenant_id)
    runs: list[str] = []

    async def slow(job: jobs.Job) -> None:
        runs.append(job.locked_by)
        await asyncio.sleep(0.8)  # well past the 0.3 s lease

    owner = Worker(engine, {kind: slow}, kinds=[kind], worker_id="owner", lease_seconds=0.3)
    owned = asyncio.create_task(owner.run_until_idle())
    await eventually(lambda: asyncio.sleep(0, bool(runs)))
    # A rival polling all along never finds the job's lease expired.
    stop = asyncio.Event()
    rival = Worker(
        engine, {kind: slow}, kinds=[kind], worker_id="rival", poll_interval=0.05, listen=False
    )
    rival_run = asyncio.create_task(rival.run(stop))
    try:
        assert await asyncio.wait_for(owned, 5) == 1
    finally:
        stop.set()
        await rival_run
    stored = await row(engine, job_id)
    assert (stored.status, stored.attempts) == ("done", 1)
    assert runs == ["owner"]


async def test_a_worker_that_lost_its_lease_abandons_the_job(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    job_id = await put(engine, kind=kind, tenant_id=tenant_id)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def hang(job: jobs.Job) -> None:
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    worker = Worker(engine, {kind: hang}, kinds=[kind], worker_id="slow", lease_seconds=0.3)
    running = asyncio.create_task(worker.run_until_idle())
    await asyncio.wait_for(started.wait(), 5)
    # Another worker takes over, as if this one's lease had run out (e.g. it was paused).
    async with engine.begin() as conn:
        await conn.execute(
            update(jobs_table)
            .where(jobs_table.c.id == job_id)
            .values(lease_until=text("now() - interval '1 second'"))
        )
    other = await take(engine, kind, worker="other")
    assert other is not None and other.id == job_id
    assert await asyncio.wait_for(running, 5) == 1
    assert cancelled.is_set()
    stored = await row(engine, job_id)
    assert (stored.status, stored.locked_by, stored.last_error) == ("running", "other", None)


async def test_a_worker_outlasts_a_pool_with_no_free_connection(
    database_url: str, engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """Every connection of the worker's pool busy past the pool's timeout (a `serve` whose
    worker shares the requests' engine, under load) is a storage fault like a lost database:
    the worker keeps polling and runs the job once a connection is free."""
    small = connect(database_url, pool_size=1, pool_timeout=0.1)
    handled = asyncio.Event()

    async def handle(job: jobs.Job) -> None:
        handled.set()

    stop = asyncio.Event()
    worker = Worker(small, {kind: handle}, kinds=[kind], poll_interval=0.05, listen=False)
    try:
        held = [await small.connect() for _ in range(2)]  # the pool and its overflow
        running = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(0.5)  # claims that found no free connection
        assert not running.done()
        for conn in held:
            await conn.close()
        await put(engine, kind=kind, tenant_id=tenant_id)
        await asyncio.wait_for(handled.wait(), 5)
        stop.set()
        await asyncio.wait_for(running, 5)
    finally:
        stop.set()
        await small.dispose()


async def test_a_worker_that_cannot_claim_warns_once_per_outage(
    database_url: str,
    engine: AsyncEngine,
    tenant_id: int,
    kind: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that cannot reach the database warns when it starts failing, as its LISTEN
    connection does, not at every poll: a minute's outage was 60 warnings per job loop."""
    small = connect(database_url, pool_size=1, pool_timeout=0.05)
    handled = asyncio.Event()

    async def handle(job: jobs.Job) -> None:
        handled.set()

    stop = asyncio.Event()
    worker = Worker(small, {kind: handle}, kinds=[kind], poll_interval=0.02, listen=False)
    running = asyncio.create_task(worker.run(stop))

    def warnings() -> int:
        return sum("cannot claim jobs" in r.getMessage() for r in caplog.records)

    try:
        with caplog.at_level(logging.WARNING, logger="memory.build.worker"):
            for outage in (1, 2):
                held: list[AsyncConnection] = []
                while len(held) < 2:  # the pool and its overflow, once the worker lets go
                    with contextlib.suppress(PoolTimeout):
                        held.append(await small.connect())
                await asyncio.sleep(0.5)  # claims that found no connection, every ~0.07 s
                for conn in held:
                    await conn.close()
                await put(engine, kind=kind, tenant_id=tenant_id)
                await asyncio.wait_for(handled.wait(), 5)
                handled.clear()
                assert warnings() == outage  # once per outage
    finally:
        stop.set()
        await asyncio.wait_for(running, 5)
        await small.dispose()


async def test_a_busy_pool_does_not_give_up_the_lease_of_a_running_job(
    database_url: str, engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    """A lease extension that finds no free connection is tried again at the next third of
    the lease, like one that finds no database: the job is not let go while it runs, so no
    other worker runs it a second time beside it."""
    small = connect(database_url, pool_size=1, pool_timeout=0.1)
    job_id = await put(engine, kind=kind, tenant_id=tenant_id)
    runs: list[str] = []

    async def long(job: jobs.Job) -> None:
        runs.append(job.locked_by)
        # Every connection busy when the first extension (at 0.5 s) asks for one.
        held = [await small.connect() for _ in range(2)]
        await asyncio.sleep(0.7)
        for conn in held:
            await conn.close()
        await asyncio.sleep(2.3)  # then on, well past the 1.5 s lease

    async def quick(job: jobs.Job) -> None:
        runs.append(job.locked_by)

    owner = Worker(small, {kind: long}, kinds=[kind], worker_id="owner", lease_seconds=1.5)
    stop = asyncio.Event()
    rival = Worker(
        engine, {kind: quick}, kinds=[kind], worker_id="rival", poll_interval=0.05, listen=False
    )
    try:
        owned = asyncio.create_task(owner.run_until_idle())
        await eventually(lambda: asyncio.sleep(0, bool(runs)))
        rival_run = asyncio.create_task(rival.run(stop))
        assert await asyncio.wait_for(owned, 10) == 1
        stop.set()
        await asyncio.wait_for(rival_run, 5)
    finally:
        stop.set()
        await small.dispose()
    stored = await row(engine, job_id)
    assert runs == ["owner"]
    assert (stored.status, stored.attempts) == ("done", 1)


# --- failures, dead letters, retry ---------------------------------------------------------------


def test_backoff_grows_exponentially_with_jitter_and_a_cap() -> None:
    for attempts in range(1, 15):
        full = min(300.0, 2.0 ** (attempts - 1))
        for _ in range(20):
            assert full / 2 <= backoff_seconds(attempts) <= full
    assert 150 <= backoff_seconds(10**6) <= 300
    assert 0.05 <= backoff_seconds(1, base=0.1) <= 0.1


async def test_failure_requeues_with_backoff(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    job_id = await put(engine, kind=kind, tenant_id=tenant_id)
    claimed = await take(engine, kind)
    assert claimed is not None
    await outcomes.fail(engine, job=claimed, error="RuntimeError: upstream 503")
    stored = await row(engine, job_id)
    assert (stored.status, stored.attempts) == ("queued", 1)
    assert stored.last_error == "RuntimeError: upstream 503"
    assert stored.lease_until is None and stored.finished_at is None
    assert 0.4 < stored.run_in.total_seconds() <= 1.0  # 1 s base, half to full jitter
    assert await take(engine, kind) is None

    # Second failure: twice the wait.
    async with engine.begin() as conn:
        await conn.execute(
            update(jobs_table).where(jobs_table.c.id == job_id).values(run_after=text("now()"))
        )
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.attempts == 2
    await outcomes.fail(engine, job=claimed, error="again")
    stored = await row(engine, job_id)
    assert (stored.status, stored.attempts) == ("queued", 2)
    assert 0.9 < stored.run_in.total_seconds() <= 2.0


async def test_worker_retries_until_success(engine: AsyncEngine, tenant_id: int, kind: str) -> None:
    job_id = await put(engine, kind=kind, tenant_id=tenant_id)
    calls: list[int] = []
    stop = asyncio.Event()

    async def flaky(job: jobs.Job) -> None:
        calls.append(job.attempts)
        if len(calls) < 3:
            raise ConnectionError("provider unavailable")
        stop.set()

    worker = Worker(
        engine, {kind: flaky}, kinds=[kind], poll_interval=0.02, backoff_base=0.02, listen=False
    )
    await asyncio.wait_for(worker.run(stop), 10)
    assert calls == [1, 2, 3]
    stored = await row(engine, job_id)
    assert (stored.status, stored.attempts) == ("done", 3)
    async with engine.connect() as conn:
        assert (await backlog.depth(conn, tenant_id=tenant_id))["failures"] == 0


async def test_dead_letter_after_max_attempts_is_visible_and_retryable(
    engine: AsyncEngine, tenant_id: int, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    conv = await new_conversation(engine, tenant_id)
    job_id = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=conv, max_attempts=2)
    calls: list[int] = []

    async def broken(job: jobs.Job) -> None:
        calls.append(job.attempts)
        raise ValueError("cannot summarize 'my secret diary entry'")

    worker = Worker(engine, {kind: broken}, kinds=[kind], backoff_base=0.01)
    with caplog.at_level(logging.INFO, logger="memory.build.jobs"):
        ran = await worker.run_until_idle()
        await asyncio.sleep(0.03)  # the backoff of the first failure
        ran += await worker.run_until_idle()
    assert ran == 2 and calls == [1, 2]
    # The worker's log names the job, never what the job was about.
    assert caplog.records
    assert all("secret" not in record.getMessage() for record in caplog.records)
    assert any(str(job_id) in record.getMessage() for record in caplog.records)

    async with engine.connect() as conn:
        counts = await backlog.depth(conn, tenant_id=tenant_id)
        listed = await backlog.list_jobs(conn, status="dead", tenant_id=tenant_id)
    assert counts == {"queued": 0, "running": 0, "done": 0, "dead": 1, "failures": 1}
    assert [(j.id, j.kind, j.attempts, j.max_attempts, j.conversation_id) for j in listed] == [
        (job_id, kind, 2, 2, conv)
    ]
    assert listed[0].last_error == "ValueError: cannot summarize 'my secret diary entry'"

    # Revived: queued to run now, attempts reset; the error stays until it succeeds.
    async with engine.begin() as conn:
        assert await jobs.retry(conn, job_id=job_id, tenant_id=tenant_id)
    stored = await row(engine, job_id)
    assert (stored.status, stored.attempts, stored.locked_by) == ("queued", 0, None)
    assert stored.run_in.total_seconds() <= 0

    async def fixed(job: jobs.Job) -> None:
        pass

    assert await Worker(engine, {kind: fixed}, kinds=[kind]).run_until_idle() == 1
    async with engine.connect() as conn:
        counts = await backlog.depth(conn, tenant_id=tenant_id)
    assert counts == {"queued": 0, "running": 0, "done": 1, "dead": 0, "failures": 0}


async def test_retry_refuses_running_and_missing_jobs(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    job_id = await put(engine, kind=kind, tenant_id=tenant_id)
    claimed = await take(engine, kind)
    assert claimed is not None
    async with engine.begin() as conn:
        assert not await jobs.retry(conn, job_id=job_id, tenant_id=tenant_id)
        with pytest.raises(NotFound):
            await jobs.retry(conn, job_id=2**62, tenant_id=tenant_id)
        with pytest.raises(NotFound):
            await jobs.retry(conn, job_id=2**62)
    assert (await row(engine, job_id)).status == "running"


async def test_unknown_kind_is_failed_with_a_clear_error(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    job_id = await put(engine, kind=kind, tenant_id=tenant_id, max_attempts=1)

    async def other(job: jobs.Job) -> None:
        raise AssertionError("not this handler")

    worker = Worker(engine, {"something-else": other}, kinds=[kind], worker_id="w1")
    assert await worker.run_until_idle() == 1
    stored = await row(engine, job_id)
    assert stored.status == "dead"
    assert stored.last_error == (
        f"no handler for job kind {kind!r} on worker w1 (it handles: something-else)"
    )


async def test_a_failure_superseded_by_a_queued_duplicate_closes(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    key = f"{kind}:work"
    first = await put(engine, kind=kind, tenant_id=tenant_id, dedupe_key=key)
    claimed = await take(engine, kind)
    assert claimed is not None
    second = await put(engine, kind=kind, tenant_id=tenant_id, dedupe_key=key)
    # Only one job per key may be queued: the queued one will do the work.
    await outcomes.fail(engine, job=claimed, error="boom")
    stored = await row(engine, first)
    assert (stored.status, stored.last_error) == ("done", "boom")
    assert (await row(engine, second)).status == "queued"

    # Likewise a dead job with a queued duplicate is not revived beside it.
    third_key = f"{kind}:other"
    dead = await put(engine, kind=kind, tenant_id=tenant_id, dedupe_key=third_key, max_attempts=1)
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == second
    await outcomes.complete(engine, job=claimed)
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == dead
    await outcomes.fail(engine, job=claimed, error="boom")
    await put(engine, kind=kind, tenant_id=tenant_id, dedupe_key=third_key)
    async with engine.begin() as conn:
        assert not await jobs.retry(conn, job_id=dead)
        # The savepoint kept the caller's transaction usable.
        assert await conn.scalar(select(1)) == 1
    assert (await row(engine, dead)).status == "dead"


async def test_retry_and_listing_are_tenant_scoped(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    other_tenant = await new_tenant(engine)
    mine = await put(engine, kind=kind, tenant_id=tenant_id, max_attempts=1)
    theirs = await put(engine, kind=kind, tenant_id=other_tenant)
    claimed = await take(engine, kind)
    assert claimed is not None and claimed.id == mine
    await outcomes.fail(engine, job=claimed, error="boom")

    async with engine.begin() as conn:
        with pytest.raises(NotFound):
            await jobs.retry(conn, job_id=mine, tenant_id=other_tenant)
        assert [j.id for j in await backlog.list_jobs(conn, status=None, tenant_id=tenant_id)] == [
            mine
        ]
        assert [
            j.id for j in await backlog.list_jobs(conn, status=None, tenant_id=other_tenant)
        ] == [theirs]
        assert await backlog.list_jobs(conn, status="dead", tenant_id=other_tenant) == []
        everyone = await backlog.list_jobs(conn, status=None, tenant_id=None, limit=1000)
        assert {mine, theirs} <= {j.id for j in everyone}
        assert (await backlog.depth(conn, tenant_id=other_tenant))["queued"] == 1
        assert (await backlog.depth(conn, tenant_id=other_tenant))["dead"] == 0
        with pytest.raises(InvalidInput):
            await backlog.list_jobs(conn, status="bogus", tenant_id=tenant_id)
        with pytest.raises(InvalidInput):
            await backlog.list_jobs(conn, status=None, tenant_id=tenant_id, limit=0)
        assert await jobs.retry(conn, job_id=mine, tenant_id=tenant_id)


# --- the worker loop ---------------------------------------------------------------------------


async def test_stop_finishes_the_current_job_then_returns(
    engine: AsyncEngine, tenant_id: int, kind: str
) -> None:
    first = await put(engine, kind=kind, tenant_id=tenant_id)
    second = await put(engine, kind=kind, tenant_id=tenant_id)
    stop = asyncio.Event()
    finished: list[int] = []

    async def handle(job: jobs.Job) -> None:
        stop.set()
        await asyncio.sleep(0.1)
        finished.append(job.id)

    worker = Worker(engine, {kind: handle}, kinds=[kind], poll_interval=0.05)
    await asyncio.wait_for(worker.run(stop), 5)
    assert finished == [first]
    assert (await row(engine, first)).status == "done"
    assert (await row(engine, second)).status == "queued"


async def test_a_job_deleted_with_its_conversation_is_not_said_to_be_reclaimed(
    engine: AsyncEngine, tenant_id: int, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A conversation deleted while its jobs run takes them with it: the log says so, rather
    than that another worker took them over (which sends an operator looking for two workers
    running one job)."""
    finished = await new_conversation(engine, tenant_id)
    running = await new_conversation(engine, tenant_id)
    first = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=finished)
    second = await put(engine, kind=kind, tenant_id=tenant_id, conversation_id=running)

    async def delete_its_conversation(job: jobs.Job) -> None:
        async with engine.begin() as conn:
            await conn.execute(
                delete(conversations).where(conversations.c.id == job.conversation_id)
            )
        if job.id == second:
            await asyncio.sleep(30)  # until the lease keeper finds the job gone

    worker = Worker(engine, {kind: delete_its_conversation}, kinds=[kind], lease_seconds=0.3)
    with caplog.at_level(logging.INFO, logger="memory.build"):
        assert await asyncio.wait_for(worker.run_until_idle(), 10) == 2
    assert "another worker" not in caplog.text
    assert f"job {first} ({kind}) was deleted" in caplog.text
    assert f"job {second} ({kind}) was deleted" in caplog.text


def test_the_listen_connection_uses_the_engine_url_as_asyncpg_understands_it() -> None:
    url = make_url(
        "postgresql+asyncpg://u:p%40ss@db:5433/app?ssl=require&prepared_statement_cache_size=0"
    )
    assert _listen_dsn(url) == "postgresql://u:p%40ss@db:5433/app?sslmode=require"


async def test_notify_wakes_an_idle_worker(engine: AsyncEngine, tenant_id: int, kind: str) -> None:
    handled = asyncio.Event()

    async def handle(job: jobs.Job) -> None:
        handled.set()

    stop = asyncio.Event()
    # A poll interval far beyond the test's patience: only the notice can wake it.
    worker = Worker(engine, {kind: handle}, kinds=[kind], poll_interval=60)
    running = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.sleep(0.3)  # let it go idle and start listening
        started = time.monotonic()
        await put(engine, kind=kind, tenant_id=tenant_id)
        await asyncio.wait_for(handled.wait(), 5)
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        await asyncio.wait_for(running, 5)
