"""The tier sweeper: a job that demotes nodes unused for too long (`memory.tiers.sweep`).

One `JOB_KIND` job is queued at a time (deduplicated); each run sweeps every tenant and queues
the next run `every` seconds later, so the sweep keeps going for as long as some worker runs,
whichever worker that is. `schedule()` queues the first (a no-op while one is queued).
"""

import logging
from typing import Final

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory import tiers
from memory.build import jobs
from memory.build.jobs import Job
from memory.db import transaction

log = logging.getLogger(__name__)

JOB_KIND: Final = "tier_sweep"
_DEDUPE: Final = "tier_sweep"


async def schedule(engine: AsyncEngine) -> None:
    """Queue a sweep now, unless one is queued already."""
    async with transaction(engine) as conn:
        await _enqueue(conn, delay_seconds=0)


async def _enqueue(conn: AsyncConnection, *, delay_seconds: float) -> None:
    await jobs.enqueue(
        conn,
        kind=JOB_KIND,
        tenant_id=None,
        conversation_id=None,
        dedupe_key=_DEDUPE,
        delay_seconds=delay_seconds,
    )


def handler(engine: AsyncEngine, *, every: float) -> jobs.Handler:
    """The job handler for `JOB_KIND`: sweep, then queue the next sweep in `every` seconds."""

    async def handle(job: Job) -> None:
        async with transaction(engine) as conn:
            demoted = await tiers.sweep(conn)
            await _enqueue(conn, delay_seconds=every)
        if demoted:
            log.info("tiers swept", extra={"demoted": demoted})

    return handle
