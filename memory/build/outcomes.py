"""What becomes of a claimed job (`memory.build.jobs.claim`): each outcome in a transaction of its
own, recorded only while the caller still owns the claim.

Contract
--------
* A claim is named by (`locked_by`, `attempts`), and every claim increments `attempts`:
  `extend_lease`, `complete`, `fail` and `requeue` change nothing once the job was reclaimed, so
  a worker whose lease ran out cannot overwrite the new owner's state. `describe_lost` says
  what became of a lost claim.
* `complete`: done. `fail`: queued again after an exponential backoff with jitter
  (`memory.build.backoff`), or, after `max_attempts` attempts, `dead` (the dead letter),
  keeping `last_error`. `requeue`: queued again without spending the attempt (an upstream
  outage, a worker leaving), so a job waits out an outage of any length and never dies of one.
  Either, told `upstream_failed`, records when the attempt met an unavailable upstream
  (`jobs.upstream_failed_at`): whether the upstream answered others since decides whether the
  job's next such failure is charged (`memory.build.upstream`).
* A failed or given-back job whose work was queued again meanwhile (same `dedupe_key`) is
  closed as done rather than requeued beside the one that will do it.
"""

import logging
from datetime import timedelta

from sqlalchemy import ColumnElement, and_, case, exists, false, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.build.backoff import BACKOFF_BASE, BACKOFF_CAP, backoff_seconds
from memory.build.jobs import (
    DEAD,
    DONE,
    MAX_ERROR_CHARS,
    QUEUED,
    RUNNING,
    Job,
    status_sql,
    storage_errors,
)
from memory.errors import StorageUnavailable
from memory.schema import jobs

log = logging.getLogger(__name__)

_Q, _R, _DONE, _DEAD = (status_sql(s) for s in (QUEUED, RUNNING, DONE, DEAD))


def _owned(job: Job) -> ColumnElement[bool]:
    # `attempts` grows with every claim, so (locked_by, attempts) names one claim: even another
    # loop of the same worker that reclaimed the job is told apart. (`requeue` takes an increment
    # back, but only from the claim it settles: see there.)
    return and_(
        jobs.c.id == job.id,
        jobs.c.status == _R,
        jobs.c.locked_by == job.locked_by,
        jobs.c.attempts == job.attempts,
    )


async def describe_lost(engine: AsyncEngine, *, job: Job) -> str:
    """What became of a claim that is no longer ours, for the log: the job was deleted (with
    its conversation), dead-lettered (its lease ran out on its last attempt), or reclaimed."""
    try:
        async with storage_errors(f"reading job {job.id}"), engine.connect() as conn:
            row = (
                await conn.execute(
                    select(jobs.c.status, jobs.c.locked_by).where(jobs.c.id == job.id)
                )
            ).one_or_none()
    except StorageUnavailable:
        return "is no longer ours"
    if row is None:
        return "was deleted (with its conversation)"
    if row.status == DEAD:
        return "was dead-lettered (its lease ran out on its last attempt)"
    return f"was reclaimed by worker {row.locked_by}"


async def extend_lease(engine: AsyncEngine, *, job: Job, lease_seconds: float) -> bool:
    """Push the lease to now + `lease_seconds`; False if the job is no longer ours."""
    async with storage_errors(f"extending the lease of job {job.id}"), engine.begin() as conn:
        kept = await conn.scalar(
            update(jobs)
            .where(_owned(job))
            .values(
                lease_until=func.now() + timedelta(seconds=lease_seconds), updated_at=func.now()
            )
            .returning(jobs.c.id)
        )
    return kept is not None


async def complete(engine: AsyncEngine, *, job: Job) -> None:
    """Mark the job done, unless another worker has reclaimed it meanwhile."""
    async with storage_errors(f"completing job {job.id}"), engine.begin() as conn:
        done = await conn.scalar(
            update(jobs)
            .where(_owned(job))
            .values(status=_DONE, lease_until=None, finished_at=func.now(), updated_at=func.now())
            .returning(jobs.c.id)
        )
    if done is None:
        await _log_lost(engine, job=job, outcome="not marked done")


async def fail(
    engine: AsyncEngine,
    *,
    job: Job,
    error: str,
    backoff_base: float = BACKOFF_BASE,
    backoff_cap: float = BACKOFF_CAP,
    upstream_failed: bool = False,
) -> None:
    """Record a failed attempt: requeue after a backoff, or dead-letter after `max_attempts`.

    `last_error` keeps `error` either way. If, while this job ran, the same work was queued
    again (same `dedupe_key`), that queued job will do it: this one is closed as done rather
    than requeued beside it (the unique index allows one queued job per key).
    """
    delay = backoff_seconds(job.attempts, base=backoff_base, cap=backoff_cap)
    await _settle(
        engine,
        job=job,
        error=error,
        delay_seconds=delay,
        spent=True,
        upstream_failed=upstream_failed,
    )


async def requeue(
    engine: AsyncEngine,
    *,
    job: Job,
    error: str | None,
    delay_seconds: float,
    upstream_failed: bool = False,
) -> None:
    """Give the claim back without spending its attempt: the job is queued again after
    `delay_seconds` (or closed, as by `fail`, if its work was queued again meanwhile).

    For an attempt that says nothing about the job: its upstream was down (`error`, kept in
    `last_error`), or its worker is leaving (None). Its attempts count is restored, so a
    claim's (`locked_by`, `attempts`) still names no earlier claim: while running, the job
    always has more attempts than any claim that lost it.
    """
    await _settle(
        engine,
        job=job,
        error=error,
        delay_seconds=delay_seconds,
        spent=False,
        upstream_failed=upstream_failed,
    )


async def _settle(
    engine: AsyncEngine,
    *,
    job: Job,
    error: str | None,
    delay_seconds: float,
    spent: bool,
    upstream_failed: bool,
) -> None:
    duplicate = jobs.alias("duplicate")
    queued_duplicate = exists().where(
        duplicate.c.dedupe_key == jobs.c.dedupe_key,
        duplicate.c.status == _Q,
        duplicate.c.id != jobs.c.id,
    )
    exhausted = jobs.c.attempts >= jobs.c.max_attempts if spent else false()
    settled = or_(exhausted, queued_duplicate)
    statement = (
        update(jobs)
        .where(_owned(job))
        .values(
            status=case((exhausted, _DEAD), (queued_duplicate, _DONE), else_=_Q),
            attempts=jobs.c.attempts if spent else jobs.c.attempts - 1,
            run_after=case(
                (settled, jobs.c.run_after),
                else_=func.now() + timedelta(seconds=delay_seconds),
            ),
            finished_at=case((settled, func.now()), else_=None),
            lease_until=None,
            last_error=jobs.c.last_error if error is None else error[:MAX_ERROR_CHARS],
            upstream_failed_at=func.now() if upstream_failed else jobs.c.upstream_failed_at,
            updated_at=func.now(),
        )
        .returning(jobs.c.status)
    )
    async with storage_errors(f"recording the failure of job {job.id}"):
        try:
            async with engine.begin() as conn:
                status = await conn.scalar(statement)
        except IntegrityError:
            # A job with our key was queued after our snapshot: a second try sees it (and
            # closes this one); a second conflict is left to the lease to sort out.
            async with engine.begin() as conn:
                status = await conn.scalar(statement)
    if status is None:
        await _log_lost(engine, job=job, outcome="failure not recorded")
    elif status == DEAD:
        log.warning("job %d (%s) is dead after %d attempts", job.id, job.kind, job.attempts)


async def _log_lost(engine: AsyncEngine, *, job: Job, outcome: str) -> None:
    log.info("job %d (%s) %s; %s", job.id, job.kind, await describe_lost(engine, job=job), outcome)
