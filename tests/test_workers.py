"""Real `memstrata worker` processes sharing one database.

Two workers build the trees of 12 conversations (60 messages each) whose messages keep
arriving while they run: every job runs exactly once, no summary is made twice, and every tree
is complete and consistent. A worker killed with SIGKILL in the middle of a job: its lease
runs out, another worker reclaims the job and finishes the tree, without duplicates.

Workers claim jobs of every tenant, so assertions look at this module's tenants only; other
tests' leftover jobs may be run too, which is harmless. Every worker process is stopped when
its test ends (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import synthetic
from devkit.gateway import GatewayProcess, WorkerProcess
from devkit.service import Service
from devkit.upstream import UpstreamServer
from gateway import importer, worker_process
from gateway.settings import Settings
from memory.build.segments import SegmentPolicy
from memory.schema import jobs, nodes
from memory.write import store
from tests import own_database
from tests.test_hierarchy import (
    check_complete,
    expected_levels,
    expected_segments,
    level_counts,
    walk_tree,
)

# This module's own database (its workers run every queued job).
database_url = own_database.database_url
engine = own_database.engine

# Real embeddings in real processes: ~30 s on an idle 2-core machine, minutes on a busy one.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    """Worker processes a test starts; all stopped when it ends."""
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.stop()


async def job_rows(engine: AsyncEngine, tenant_id: int) -> list[Any]:
    async with engine.connect() as conn:
        return list(
            (
                await conn.execute(
                    select(
                        jobs.c.id,
                        jobs.c.conversation_id,
                        jobs.c.status,
                        jobs.c.attempts,
                        jobs.c.max_attempts,
                        jobs.c.locked_by,
                        jobs.c.last_error,
                    )
                    .where(jobs.c.tenant_id == tenant_id)
                    .order_by(jobs.c.id)
                )
            ).all()
        )


async def wait_for(condition: Any, *, within: float, what: str, workers: Sequence[Service]) -> Any:
    """Poll the async `condition` until it returns something truthy, for `within` seconds,
    while every one of `workers` (or `serve` processes) keeps running."""
    deadline = time.monotonic() + within
    while True:
        value = await condition()
        if value:
            return value
        for worker in workers:
            assert worker.running, f"{worker.name} exited:\n{worker.logs()}"
        if time.monotonic() > deadline:
            logs = "\n".join(worker.logs()[-3000:] for worker in workers)
            pytest.fail(f"timed out waiting for {what}\n{logs}")
        await asyncio.sleep(0.2)


async def listening(engine: AsyncEngine, workers: list[WorkerProcess]) -> bool:
    """Whether every one of `workers` says it runs, and as many LISTEN connections are open.

    The count alone could be met by another process's listener on this database."""
    if not all(f":{worker.pid}:" in worker.logs() for worker in workers):
        return False
    async with engine.connect() as conn:
        count = await conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'memstrata-listen'"
            )
        )
    return int(count or 0) >= len(workers)


async def check_no_duplicates(engine: AsyncEngine, tenant_id: int) -> None:
    """No two summaries of a conversation share a level and span or a level and seq, and at
    each level the spans are disjoint (no message has two ancestors at one level)."""
    async with engine.connect() as conn:
        for key in ((nodes.c.span_start, nodes.c.span_end), (nodes.c.seq,)):
            duplicates = (
                await conn.execute(
                    select(nodes.c.conversation_id, nodes.c.level, *key, func.count())
                    .where(nodes.c.tenant_id == tenant_id, nodes.c.level > 0)
                    .group_by(nodes.c.conversation_id, nodes.c.level, *key)
                    .having(func.count() > 1)
                )
            ).all()
            assert duplicates == [], f"duplicate summaries: {duplicates}"
        spans = (
            await conn.execute(
                select(nodes.c.conversation_id, nodes.c.level, nodes.c.span_start, nodes.c.span_end)
                .where(nodes.c.tenant_id == tenant_id)
                .order_by(nodes.c.conversation_id, nodes.c.level, nodes.c.span_start)
            )
        ).all()
    for before, after in itertools.pairwise(spans):
        if (before.conversation_id, before.level) == (after.conversation_id, after.level):
            assert after.span_start > before.span_end, f"overlapping spans {before} {after}"


async def check_tree(
    engine: AsyncEngine,
    tenant_id: int,
    conversation_id: int,
    n_messages: int,
    method: str,
    policy: SegmentPolicy,
) -> None:
    walk = await walk_tree(
        engine, tenant_id=tenant_id, conversation_id=conversation_id, method=method
    )
    check_complete(walk, n_messages)
    segments = await expected_segments(engine, conversation_id=conversation_id, policy=policy)
    assert await level_counts(engine, tenant_id, conversation_id) == expected_levels(
        n_messages, len(segments)
    )


CONVERSATIONS = 12
MESSAGES = 60
BATCH = 30
# Small segments, closed by the token cap (a topic shift needs more tokens than the cap
# allows): a dozen or more level-1 summaries per conversation, and roll-ups above them.
TOKEN_CAP = 128
POLICY = SegmentPolicy(token_cap=TOKEN_CAP)
# Smaller still for the killed worker: two batches of segment summaries, so that it can be
# killed between them.
KILLED_TOKEN_CAP = 96
KILLED_POLICY = SegmentPolicy(token_cap=KILLED_TOKEN_CAP)


async def test_two_workers_run_every_job_once(
    engine: AsyncEngine,
    database_url: str,
    tenant_id: int,
    workers: list[WorkerProcess],
    paced_upstream: UpstreamServer,
) -> None:
    settings = {
        "summary_mode": "llm",
        "summary_model": "slow-model",
        "upstream_base_url": paced_upstream.url,
        "job_lease_seconds": 10,
        "segment_token_cap": TOKEN_CAP,
    }
    workers.extend(WorkerProcess(database_url, **settings) for _ in range(2))
    # Both listening before any job exists: on a busy machine one process may start seconds
    # after the other, which would then do every job alone.
    await wait_for(
        functools.partial(listening, engine, workers),
        within=120,
        what="both workers listening",
        workers=workers,
    )
    # Messages keep arriving while the workers run: a batch that lands while its
    # conversation's build is running queues another build behind it.
    conversations = [synthetic.generate(MESSAGES, seed=100 + i) for i in range(CONVERSATIONS)]
    for start in range(0, MESSAGES, BATCH):
        for number, conversation in enumerate(conversations):
            await importer.import_messages(
                engine,
                tenant_id=tenant_id,
                external_id=f"conversation-{number}",
                messages=conversation.messages[: start + BATCH],
                created_at=conversation.created_at[: start + BATCH],
                model="gpt-4o",
                batch=BATCH,
            )
        await asyncio.sleep(0.5)

    async def all_done() -> list[Any] | None:
        rows = await job_rows(engine, tenant_id)
        return rows if rows and all(row.status == "done" for row in rows) else None

    rows = await wait_for(all_done, within=360, what="every job done", workers=workers)
    for row in rows:
        assert row.attempts == 1, f"job {row.id} ran {row.attempts} times"
        assert row.last_error is None
        assert any(worker.owns(row.locked_by) for worker in workers), row.locked_by
    assert len({row.conversation_id for row in rows}) == CONVERSATIONS
    assert len(rows) >= CONVERSATIONS
    # Both processes took part.
    for worker in workers:
        assert any(worker.owns(row.locked_by) for row in rows), (
            f"worker {worker.pid} idle:\n{worker.logs()[-3000:]}"
        )
        # Every summary was an upstream call; at INFO they are not logged one line each.
        assert "HTTP Request:" not in worker.logs()

    await check_no_duplicates(engine, tenant_id)
    for number in range(CONVERSATIONS):
        async with engine.connect() as conn:
            ref = await store.find_conversation(
                conn, tenant_id=tenant_id, external_id=f"conversation-{number}"
            )
        await check_tree(engine, tenant_id, ref.id, MESSAGES, "llm", POLICY)


def summary_taking(seconds: float) -> dict[str, Any]:
    """The fake upstream's behaviour for a summary that takes `seconds`."""
    reply = {
        "narrative": "A slow summary.",
        "identifiers": [],
        "numbers": [],
        "names": [],
        "dates": [],
        "decisions": [],
        "open_questions": [],
    }
    return {"path": "/v1/chat/completions", "delay": seconds, "reply": json.dumps(reply)}


@contextlib.contextmanager
def summaries_taking(seconds: float) -> Iterator[UpstreamServer]:
    """An upstream whose every summary takes `seconds`."""
    with UpstreamServer() as server:
        server.set_default(summary_taking(seconds))
        yield server


@pytest.fixture
def paced_upstream() -> Iterator[UpstreamServer]:
    """Summaries that take 0.2 s each: builds stay queued while conversations are imported, so
    that two workers both have jobs to take. With instant ones, a busy machine may import slower
    than one worker builds, and that worker takes every job (it wins each NOTIFY's race)."""
    with summaries_taking(0.2) as server:
        yield server


@pytest.fixture
def slow_upstream() -> Iterator[UpstreamServer]:
    """Summaries that take a second each."""
    with summaries_taking(1) as server:
        yield server


def slow_settings(upstream: UpstreamServer, *, lease_seconds: float) -> dict[str, Any]:
    """Workers whose jobs take a while (slow LLM summaries of small segments)."""
    return {
        "summary_mode": "llm",
        "summary_model": "slow-model",
        "upstream_base_url": upstream.url,
        "job_lease_seconds": lease_seconds,
        "segment_token_cap": KILLED_TOKEN_CAP,
    }


async def import_one(
    engine: AsyncEngine, tenant_id: int, name: str, *, seed: int, size: int = MESSAGES
) -> int:
    """A synthetic conversation of `size` messages imported (its build queued); its id."""
    conversation = synthetic.generate(size, seed=seed)
    await importer.import_messages(
        engine,
        tenant_id=tenant_id,
        external_id=name,
        messages=conversation.messages,
        created_at=conversation.created_at,
        model="gpt-4o",
        batch=size,
    )
    async with engine.connect() as conn:
        return (await store.find_conversation(conn, tenant_id=tenant_id, external_id=name)).id


async def test_killed_worker_job_is_reclaimed_and_finished(
    engine: AsyncEngine,
    database_url: str,
    tenant_id: int,
    workers: list[WorkerProcess],
    slow_upstream: UpstreamServer,
) -> None:
    settings = slow_settings(slow_upstream, lease_seconds=3)
    conversation_id = await import_one(engine, tenant_id, "killed", seed=7)
    (job,) = await job_rows(engine, tenant_id)

    first = WorkerProcess(database_url, **settings)
    workers.append(first)

    async def mid_job() -> bool:
        rows = await job_rows(engine, tenant_id)
        counts = await level_counts(engine, tenant_id, conversation_id)
        return bool(
            rows[0].status == "running"
            and first.owns(rows[0].locked_by)
            and counts.get(1, 0) > 0
            and counts.get(2, 0) == 0
        )

    # Killed in the middle: segment summaries made, roll-ups (a slow request away) not yet.
    await wait_for(mid_job, within=120, what="the job to be half done", workers=[first])
    first.kill()
    partial = await level_counts(engine, tenant_id, conversation_id)
    assert partial.get(2, 0) == 0
    assert (await job_rows(engine, tenant_id))[0].status == "running"

    second = WorkerProcess(database_url, **settings)
    workers.append(second)

    async def done() -> Any:
        rows = await job_rows(engine, tenant_id)
        return rows[0] if rows[0].status == "done" else None

    finished = await wait_for(done, within=180, what="the reclaimed job", workers=[second])
    assert finished.id == job.id
    assert finished.attempts == 2
    assert second.owns(finished.locked_by)
    assert finished.last_error is None

    await check_no_duplicates(engine, tenant_id)
    await check_tree(engine, tenant_id, conversation_id, MESSAGES, "llm", KILLED_POLICY)
    final = await level_counts(engine, tenant_id, conversation_id)
    assert final[2] > 0, "the second worker did not finish the build"
    assert final[1] >= partial[1]
    async with engine.connect() as conn:
        models = set(
            await conn.scalars(
                select(nodes.c.model).where(
                    nodes.c.conversation_id == conversation_id, nodes.c.level > 0
                )
            )
        )
    assert models == {"slow-model"}


async def test_a_job_that_kills_its_workers_is_dead_lettered_at_max_attempts(
    engine: AsyncEngine,
    database_url: str,
    tenant_id: int,
    workers: list[WorkerProcess],
    slow_upstream: UpstreamServer,
) -> None:
    """A crash loop: every worker that takes the job is SIGKILLed while it runs it. After the
    job's `max_attempts` claims it is dead-lettered, not run a sixth time, and no summary of
    the attempts is stored twice."""
    settings = slow_settings(slow_upstream, lease_seconds=2)
    await import_one(engine, tenant_id, "crash-loop", seed=11)
    (job,) = await job_rows(engine, tenant_id)
    for attempt in range(1, job.max_attempts + 1):
        worker = WorkerProcess(database_url, **settings)
        workers.append(worker)

        async def running(worker: WorkerProcess = worker, attempt: int = attempt) -> bool:
            (row,) = await job_rows(engine, tenant_id)
            return bool(
                row.status == "running" and worker.owns(row.locked_by) and row.attempts == attempt
            )

        await wait_for(running, within=120, what=f"attempt {attempt}", workers=[worker])
        worker.kill()

    survivor = WorkerProcess(database_url, **settings)
    workers.append(survivor)

    async def buried() -> Any:
        (row,) = await job_rows(engine, tenant_id)
        return row if row.status == "dead" else None

    dead = await wait_for(buried, within=60, what="the dead letter", workers=[survivor])
    assert dead.id == job.id and dead.attempts == job.max_attempts
    assert "worker was lost" in dead.last_error
    await check_no_duplicates(engine, tenant_id)


def child_pids(pid: int) -> set[int]:
    """The processes `pid` started (`serve`'s: its worker process and multiprocessing's
    resource tracker); none once it is gone."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(child) for child in text.split()}


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[16])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its entry waits to be reaped


async def test_serve_runs_its_jobs_in_a_child_process_that_leaves_with_it(
    engine: AsyncEngine, database_url: str, tenant_id: int, upstream: UpstreamServer
) -> None:
    """`serve`'s background jobs run in a process of their own (off the event loop that
    answers requests, at a lower CPU priority), which builds the trees and is gone once
    `serve` is, even SIGKILLed."""
    gateway = GatewayProcess(
        database_url=database_url, upstream_url=upstream.url, workers=1, worker_nice=7
    )
    try:
        deadline = time.monotonic() + 60
        while not (children := child_pids(gateway.pid)):
            assert time.monotonic() < deadline, "no worker process was started"
            await asyncio.sleep(0.2)
        conversation = synthetic.generate(20, seed=3)
        await importer.import_messages(
            engine,
            tenant_id=tenant_id,
            external_id="child-process",
            messages=conversation.messages,
            created_at=conversation.created_at,
            model="gpt-4o",
            batch=20,
        )

        async def built() -> Any:
            rows = await job_rows(engine, tenant_id)
            return rows if rows and all(row.status == "done" for row in rows) else None

        (job,) = await wait_for(built, within=120, what="the child's build", workers=[])
        worker = int(job.locked_by.split(":")[1])
        assert worker in children
        assert _nice(worker) == min(19, _nice(gateway.pid) + 7)  # MEMSTRATA_WORKER_NICE
    finally:
        gateway.process.kill()
        gateway.process.wait(timeout=10)
        gateway.stop()
    deadline = time.monotonic() + 30
    while any(_alive(child) for child in children):
        assert time.monotonic() < deadline, "the worker process outlived serve"
        await asyncio.sleep(0.2)


async def test_serve_starts_another_worker_process_when_its_child_dies(
    engine: AsyncEngine, database_url: str, tenant_id: int, upstream: UpstreamServer
) -> None:
    """A worker process that dies (OOM-killed, crashed) is replaced: serve's jobs do not stop
    being run until serve itself is restarted."""
    settings = Settings(
        database_url=database_url, upstream_base_url=upstream.url, workers=1, worker_nice=0
    )
    async with worker_process.running(settings, database_url):
        (child,) = [p for p in multiprocessing.active_children() if p.name == "memstrata-worker"]
        os.kill(child.pid or 0, signal.SIGKILL)
        await asyncio.to_thread(child.join, 10)
        conversation = synthetic.generate(6, seed=5)
        await importer.import_messages(
            engine,
            tenant_id=tenant_id,
            external_id="orphaned-jobs",
            messages=conversation.messages,
            created_at=conversation.created_at,
            model="gpt-4o",
            batch=6,
        )

        async def built() -> Any:
            rows = await job_rows(engine, tenant_id)
            return rows if rows and all(row.status == "done" for row in rows) else None

        (job,) = await wait_for(built, within=90, what="a new child's build", workers=[])
        assert int(job.locked_by.split(":")[1]) != child.pid


async def _built_by(engine: AsyncEngine, tenant_id: int, name: str, *, seed: int) -> int:
    """The pid of the worker process that built a conversation `name` imported now: one that
    runs jobs is up, its stop watch too (started before anything else). Its thread count says
    nothing: its imports start threads of their own."""
    conversation_id = await import_one(engine, tenant_id, name, seed=seed, size=6)

    async def built() -> Any:
        rows = await job_rows(engine, tenant_id)
        return [r for r in rows if r.conversation_id == conversation_id and r.status == "done"]

    (job,) = await wait_for(built, within=120, what=f"the build of {name}", workers=[])
    return int(job.locked_by.split(":")[1])


@pytest.mark.parametrize(
    "signals",
    [(signal.SIGTERM,), (signal.SIGKILL,), (signal.SIGTERM, signal.SIGKILL)],
    ids=["sigterm", "sigkill", "sigterm-then-sigkill"],
)
async def test_serve_and_a_replaced_worker_process_stop(
    engine: AsyncEngine,
    database_url: str,
    tenant_id: int,
    upstream: UpstreamServer,
    signals: tuple[signal.Signals, ...],
) -> None:
    """After its worker process died and was replaced, `serve` still stops on SIGTERM, and its
    new worker process still leaves once `serve` is gone, even SIGKILLed while stopping. The
    children once shared one stop event (a multiprocessing Event): setting it waited, for
    ever, for the dead child that had been waiting on it to wake, and held the event's lock
    meanwhile, on which the new child's watch of its parent then blocked. Every rolling restart
    after a worker crash waited for SIGKILL, which left the new child behind, an orphan with
    its database connection."""
    gateway = GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=1,
        worker_nice=0,
        worker_grace_seconds=1,
    )
    children: set[int] = set()
    try:
        first = await _built_by(engine, tenant_id, "first", seed=17)
        assert first in child_pids(gateway.pid)
        os.kill(first, signal.SIGKILL)
        assert await _built_by(engine, tenant_id, "second", seed=19) in child_pids(gateway.pid)
        children = child_pids(gateway.pid)  # the new worker process and the resource tracker
        # Grace 1 s + the stop margin 5 s + 5 s for a child that does not leave: 11 s at most.
        deadline = time.monotonic() + 15
        for number, sig in enumerate(signals):
            if number:
                await asyncio.sleep(1)  # while `serve` stops (or hangs)
            gateway.process.send_signal(sig)
        while gateway.running or any(_alive(child) for child in children):
            if time.monotonic() > deadline:
                left = [child for child in children if _alive(child)]
                pytest.fail(
                    f"15 s after {signals[0].name}: serve running: {gateway.running},"
                    f" its children alive: {left}\n{gateway.logs()[-3000:]}"
                )
            await asyncio.sleep(0.2)
        # Told to stop, the new child left; it was not terminated at the end of its grace.
        assert "did not stop within" not in gateway.logs(), gateway.logs()[-3000:]
    finally:
        gateway.process.kill()
        gateway.stop()
        for child in children:  # an orphan a failure left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


async def test_ctrl_c_lets_serve_s_worker_process_finish_its_job(
    engine: AsyncEngine, database_url: str, tenant_id: int
) -> None:
    """Ctrl-C in a terminal signals every process of its foreground group, `serve` and its
    worker process alike. `serve` stops and tells its worker process to, which finishes the
    job in hand first: the signal itself must not interrupt the worker process, which left
    the job running until its lease ran out (one of its attempts burnt: five Ctrl-Cs and it is
    a dead letter) and printed a KeyboardInterrupt traceback."""
    with summaries_taking(0.5) as upstream:
        gateway = GatewayProcess(
            database_url=database_url,
            upstream_url=upstream.url,
            workers=1,
            worker_nice=0,
            summary_mode="llm",
            summary_model="slow-model",
            segment_token_cap=KILLED_TOKEN_CAP,
        )
        try:
            deadline = time.monotonic() + 60
            while not child_pids(gateway.pid):
                assert time.monotonic() < deadline, "no worker process was started"
                await asyncio.sleep(0.2)
            await import_one(engine, tenant_id, "interrupted", seed=13)

            async def running() -> bool:
                rows = await job_rows(engine, tenant_id)
                return bool(rows and rows[0].status == "running")

            await wait_for(running, within=120, what="the child's build", workers=[])
            # What the terminal does: the signal to every process of the group.
            for pid in (gateway.pid, *child_pids(gateway.pid)):
                os.kill(pid, signal.SIGINT)
            await asyncio.to_thread(gateway.process.wait, 60)
        finally:
            gateway.stop()
    logs = gateway.logs()
    (job,) = await job_rows(engine, tenant_id)
    assert (job.status, job.attempts, job.last_error) == ("done", 1, None), logs[-3000:]
    assert "KeyboardInterrupt" not in logs, logs[-3000:]
    assert "exited with code" not in logs, logs[-3000:]
