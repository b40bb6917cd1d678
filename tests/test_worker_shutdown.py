"""`memstrata worker` stopped (SIGTERM) while a job runs leaves within its grace period, and
gives the job back to the queue: a summary request that hangs no longer holds the process
(for up to `MEMSTRATA_UPSTREAM_TIMEOUT`, 10 minutes, per request), and its job loses nothing,
not even an attempt.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import WorkerProcess
from devkit.upstream import UpstreamServer
from tests import own_database
from tests.test_workers import KILLED_TOKEN_CAP, import_one, job_rows, summaries_taking, wait_for

# This module's own database (its workers run every queued job).
database_url = own_database.database_url
engine = own_database.engine

pytestmark = pytest.mark.timeout(300)

GRACE = 2.0


@pytest.fixture
def hanging_upstream() -> Iterator[UpstreamServer]:
    """Summaries that take five minutes each."""
    with summaries_taking(300) as server:
        yield server


async def test_a_stopped_worker_gives_back_its_job_after_the_grace_period(
    engine: AsyncEngine, database_url: str, tenant_id: int, hanging_upstream: UpstreamServer
) -> None:
    await import_one(engine, tenant_id, "stopped", seed=17)
    worker = WorkerProcess(
        database_url,
        upstream_base_url=hanging_upstream.url,
        summary_mode="llm",
        summary_model="slow-model",
        embedding_provider="upstream",
        segment_token_cap=KILLED_TOKEN_CAP,
        worker_grace_seconds=GRACE,
    )
    try:

        async def summarizing() -> bool:
            rows = await job_rows(engine, tenant_id)
            return bool(
                rows[0].status == "running"
                and worker.owns(rows[0].locked_by)
                and hanging_upstream.requests("/v1/chat/completions")
            )

        await wait_for(summarizing, within=120, what="a summary request", workers=[worker])
        stopped = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(worker.process.wait, GRACE + 15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not leave within {GRACE + 15}s of SIGTERM")
        took = time.monotonic() - stopped
    finally:
        worker.stop()
    logs = worker.logs()
    assert code == 0, logs[-3000:]
    assert GRACE <= took < GRACE + 10, logs[-3000:]
    assert "giving it back" in logs
    (job,) = await job_rows(engine, tenant_id)
    # Queued again, due now, with the attempt it was on not counted.
    assert (job.status, job.attempts, job.last_error) == ("queued", 0, None), logs[-3000:]
