"""Done jobs are deleted once older than `MEMSTRATA_JOB_RETENTION_SECONDS`.

Every turn queues a build, so the jobs table grew by a row per turn for ever. A worker now
deletes the done jobs past their retention when it starts and every few minutes after, in
bounded batches; queued, running and dead ones (an operator's to retry) stay, whatever their age.
"""

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway import background
from gateway.settings import Settings
from memory.build import jobs, retention
from memory.errors import InvalidInput
from memory.provider import Provider
from memory.schema import jobs as jobs_table
from tests import own_database

# This module's own database (its workers run every queued job).
database_url = own_database.database_url
engine = own_database.engine

DAY = timedelta(days=1)


async def job(engine: AsyncEngine, tenant_id: int, status: str, age: timedelta) -> int:
    """A job of `status` that finished (or was last updated) `age` ago, never due to run."""
    async with engine.begin() as conn:
        job_id = await jobs.enqueue(
            conn, kind="aged", tenant_id=tenant_id, conversation_id=None, delay_seconds=86400
        )
        assert job_id is not None
        finished = None if status in ("queued", "running") else func.now() - age
        await conn.execute(
            update(jobs_table)
            .where(jobs_table.c.id == job_id)
            .values(status=status, finished_at=finished, updated_at=func.now() - age)
        )
    return job_id


async def remaining(engine: AsyncEngine, tenant_id: int) -> set[int]:
    async with engine.connect() as conn:
        ids = await conn.scalars(select(jobs_table.c.id).where(jobs_table.c.tenant_id == tenant_id))
        return set(ids)


@pytest.fixture
async def provider() -> AsyncIterator[Provider]:
    client = Provider(base_url="http://127.0.0.1:9/v1", api_key=None)  # never called
    yield client
    await client.aclose()


async def test_a_worker_deletes_done_jobs_past_their_retention_and_keeps_the_rest(
    engine: AsyncEngine, database_url: str, tenant_id: int, provider: Provider
) -> None:
    old_done = [await job(engine, tenant_id, "done", 8 * DAY) for _ in range(3)]
    kept = {
        await job(engine, tenant_id, "done", 6 * DAY),
        await job(engine, tenant_id, "dead", 30 * DAY),
        await job(engine, tenant_id, "queued", 30 * DAY),
        await job(engine, tenant_id, "running", 30 * DAY),
    }
    settings = Settings(
        database_url=database_url, job_retention_seconds=7 * 86400, memory_tools="never"
    )
    config = background.tree_config(settings, provider, background.embedder(settings, provider))
    worker = background.worker(engine, settings, config, concurrency=1)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        for _ in range(100):
            if await remaining(engine, tenant_id) == kept:
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
    assert await remaining(engine, tenant_id) == kept, old_done


async def test_done_jobs_are_deleted_in_bounded_batches(
    engine: AsyncEngine, tenant_id: int
) -> None:
    old = {await job(engine, tenant_id, "done", 2 * DAY) for _ in range(5)}
    recent = await job(engine, tenant_id, "done", timedelta(hours=1))
    # Other tenants' old done jobs go too (retention is the database's): count only ours.
    before = await remaining(engine, tenant_id)
    deleted = await retention.delete_done(engine, older_than=86400, batch=2)
    assert deleted >= len(old)
    assert before - await remaining(engine, tenant_id) == old
    assert recent in await remaining(engine, tenant_id)
    with pytest.raises(InvalidInput):
        await retention.delete_done(engine, older_than=0)
