"""Whether the upstream answers, as every worker sees it: the evidence that tells a job the
upstream fails by itself from an upstream that is down (migration 0020).

A transient upstream failure (`memory.errors.ProviderUnavailable`: unreachable, timed out, 408,
409, 429, 5xx) costs a job no attempt while the upstream is down, so that an outage of any
length dead-letters nothing. A request the upstream fails *by itself* (a segment whose summary
always gets a 500 or always times out) would then be retried for ever, holding back every later
job of its conversation. The two are told apart by whether the endpoint answers other requests:

* `note_answers`: after each job, its worker records when each endpoint last answered the job
  (`memory.provider.Answers`) in `upstream_answers`, one row per endpoint, the latest time, in
  the database's clock;
* `answered_since_failure`: whether the endpoint answered any worker's request after the job's
  previous attempt met it unavailable (`jobs.upstream_failed_at`, set by
  `memory.build.outcomes` whenever an attempt ends so; the answers of the job's own attempt
  count). If it did, the upstream works and fails this job: the failure is charged as an
  attempt (backoff, then the dead letter). If not, the upstream may be down: the failure is
  free. A job's first transient failure is always free.

Hence nothing is charged while an endpoint answers no one, however long; an upstream that goes
down and comes back costs a job at most one attempt per outage (when it answered others in
between the job's two failures). The limit: a job the upstream fails is charged only while
other work of the same endpoint gets through; alone in the queue, it stays deferred.
"""

import time
from collections.abc import Mapping
from datetime import timedelta

from sqlalchemy import exists, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.build.jobs import storage_errors
from memory.schema import jobs, upstream_answers


async def note_answers(engine: AsyncEngine, answered: Mapping[str, float]) -> None:
    """Record that each endpoint answered at `answered[endpoint]` (`time.monotonic()` of this
    process), unless a later answer is recorded already."""
    if not answered:
        return
    now = time.monotonic()
    rows = [
        {"endpoint": endpoint, "answered_at": func.now() - timedelta(seconds=max(now - at, 0))}
        for endpoint, at in sorted(answered.items())  # in one order: no deadlock between workers
    ]
    statement = pg_insert(upstream_answers).values(rows)
    statement = statement.on_conflict_do_update(
        index_elements=[upstream_answers.c.endpoint],
        set_={
            "answered_at": func.greatest(
                upstream_answers.c.answered_at, statement.excluded.answered_at
            )
        },
    )
    async with storage_errors("recording the upstream's answers"), engine.begin() as conn:
        await conn.execute(statement)


async def answered_since_failure(engine: AsyncEngine, *, job_id: int, endpoint: str) -> bool:
    """Whether `endpoint` answered anyone after job `job_id` last met it unavailable (False
    if the job never has)."""
    answered = exists().where(
        upstream_answers.c.endpoint == endpoint,
        upstream_answers.c.answered_at > jobs.c.upstream_failed_at,
    )
    async with storage_errors(f"reading job {job_id}"), engine.connect() as conn:
        found = await conn.scalar(select(answered).where(jobs.c.id == job_id))
    return bool(found)
