"""A worker's LISTEN connection (`memory.build.worker`) outlives the loss of its backend.

Its Postgres backend is ended from outside (`pg_terminate_backend`, as a restarted proxy or a
failover does): the worker says so at WARNING, reconnects, and a job queued afterwards is
still picked up at once, by the notice rather than by the (here hour-long) poll.
"""

import asyncio
import logging
import time

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.build import jobs
from memory.build.worker import Worker


async def listeners(engine: AsyncEngine, worker: Worker) -> list[int]:
    """The backend pids of LISTEN connections on this database: `worker`'s (one, once it
    listens), the only worker of this module."""
    async with engine.connect() as conn:
        pids = await conn.scalars(
            text(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'memstrata-listen'"
            )
        )
        return list(pids)


async def until(check: object, *, within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_terminated_listen_connection_is_reported_and_replaced(
    engine: AsyncEngine, tenant_id: int, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    handled: list[int] = []

    async def handle(job: jobs.Job) -> None:
        handled.append(job.id)

    stop = asyncio.Event()
    # Woken by notices only: a poll an hour apart would never pick the job up in time.
    worker = Worker(engine, {kind: handle}, kinds=[kind], poll_interval=3600)
    with caplog.at_level(logging.WARNING, logger="memory.build.worker"):
        running = asyncio.create_task(worker.run(stop))
        try:
            await until(lambda: _listening(engine, worker), within=10, what="the LISTEN")
            (first,) = await listeners(engine, worker)
            async with engine.connect() as conn:
                assert await conn.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
            await until(lambda: _replaced(engine, worker, first), within=10, what="a new LISTEN")
            assert "lost its LISTEN connection" in caplog.text
            started = time.monotonic()
            async with engine.begin() as conn:
                job_id = await jobs.enqueue(
                    conn, kind=kind, tenant_id=tenant_id, conversation_id=None
                )
            await until(lambda: _handled(handled, job_id), within=5, what="the job")
            assert time.monotonic() - started < 5
        finally:
            stop.set()
            await asyncio.wait_for(running, 10)
    assert not running.exception()


async def _listening(engine: AsyncEngine, worker: Worker) -> bool:
    return len(await listeners(engine, worker)) == 1


async def _replaced(engine: AsyncEngine, worker: Worker, first: int) -> bool:
    pids = await listeners(engine, worker)
    return len(pids) == 1 and pids[0] != first


async def _handled(handled: list[int], job_id: int | None) -> bool:
    return job_id in handled
