"""The durable queue of background work, in Postgres (SPEC §9).

Contract
--------
* `enqueue` inserts a job in the *caller's* transaction, so a job exists exactly when the data it
  concerns was committed. With a `dedupe_key`, enqueueing while a job with that key is still
  `queued` is a no-op (returns None); once that job is running, new work may queue behind it.
  The no-op locks the queued job until the caller commits (`deduplicated`). `pending` says
  whether a conversation's job with a given key is queued or running.
  Enqueueing also NOTIFYs `memstrata_jobs`, which Postgres delivers at commit, so idle workers
  wake at once; polling remains the safety net (delayed retries, expired leases, lost notices).
* `claim` gives one job to one worker for a lease: status `running`, `attempts` + 1,
  `locked_by`, `lease_until`. A running job whose lease ran out (its worker died or hung) is
  claimable again, so a job may run more than once: every handler must be idempotent. Expired
  leases are reclaimed first, then queued jobs are taken in order of due time (`run_after`,
  then id).
* Work for one conversation runs one job at a time, in order of job id: a job is not claimable
  while another job of its conversation is running (live lease or not: an expired one is
  reclaimed first) or, for a queued job, while an older one is queued (even one waiting out a
  backoff). A dead job no longer holds back the ones after it. Jobs without a conversation are
  unordered. Claims of one conversation are serialised by a transaction-level advisory lock, and
  the eligibility is re-checked under that lock with a fresh snapshot (see `claim`).
* A claim ends as `memory.build.outcomes` records it: done, failed (requeued with a backoff,
  or after `max_attempts` attempts moved to `dead`, the dead letter), or given back without
  spending its attempt (an upstream outage: but an unavailable upstream that answers other
  requests is charged as a failure, `memory.build.upstream`). `retry` revives a dead job;
  `memory.build.backlog` shows them. A job whose worker keeps dying (killed, out of memory)
  never calls `fail`: once its lease runs out after its `max_attempts`-th claim, the next
  `claim` dead-letters it instead of running it again, so a job that crashes its worker cannot
  loop.
* Every time is the database's `now()`, never a host's clock, so any number of `serve` and
  `worker` processes on any machines may share one database.

Statuses: queued → running → done; running → queued (retry later, or given back) or dead;
dead → queued (retry).
"""

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Executable,
    Integer,
    Interval,
    Row,
    Subquery,
    Text,
    and_,
    bindparam,
    exists,
    false,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, Insert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory.errors import InvalidInput, NotFound, StorageUnavailable
from memory.schema import jobs

log = logging.getLogger(__name__)

CHANNEL: Final = "memstrata_jobs"
"""The LISTEN/NOTIFY channel on which `enqueue` and `retry` wake idle workers."""

QUEUED: Final = "queued"
RUNNING: Final = "running"
DONE: Final = "done"
DEAD: Final = "dead"
STATUSES: Final = (QUEUED, RUNNING, DONE, DEAD)

MAX_ERROR_CHARS: Final = 4000
"""`last_error` is cut to this length: a failing job must not bloat its row."""

# Key space of our advisory locks: the two-int4 form `(namespace, key)`, which Postgres keeps apart
# from the one-bigint form that `memory.db` uses for migrations, so the two can never collide.
_LOCK_NAMESPACE: Final = 0x6A6F6273  # "jobs" in ASCII
# How many eligible jobs one claim considers: enough that concurrent claimers, each skipping the
# rows and conversations the others are taking, still find one.
_CANDIDATES: Final = 16


def status_sql(value: str) -> ColumnElement[str]:
    """A status as SQL (`memory.build.outcomes` writes them too)."""
    # Statuses are written as SQL literals, not bound parameters, so that the planner can match
    # the partial indexes (`WHERE status = 'queued'`) even in a cached generic plan, and so that
    # ON CONFLICT can infer `uq_jobs_queued_dedupe`.
    return literal_column(f"'{value}'", Text)


_Q, _R, _DEAD = (status_sql(s) for s in (QUEUED, RUNNING, DEAD))


@dataclass(frozen=True)
class Job:
    """A job as claimed by a worker: what its handler needs, and the claim that owns it."""

    id: int
    kind: str
    tenant_id: int | None
    conversation_id: int | None
    payload: dict[str, Any]
    attempts: int
    max_attempts: int
    locked_by: str
    lease_until: datetime


Handler = Callable[[Job], Awaitable[None]]
"""Does the work of one job; raising records a failure (and a retry, or the dead letter)."""


# --- Enqueueing (in the caller's transaction) ------------------------------------------------


def deduplicated(statement: Insert) -> Insert:
    """`statement` (an INSERT into `jobs`) made a no-op for a `dedupe_key` already queued, that
    job locked until the caller commits: it now stands for the caller's work, which a claim in
    between (DO NOTHING locks nothing) ran without. DO UPDATE locks the row even when its WHERE
    is false (nothing changed, nothing returned); `claim` skips locked rows."""
    return statement.on_conflict_do_update(
        index_elements=[jobs.c.dedupe_key],
        index_where=text("status = 'queued'"),
        set_={"dedupe_key": statement.excluded.dedupe_key},
        where=false(),
    )


# Built once: the request path queues a build with every message it stores. A job without a
# `dedupe_key` never conflicts (NULLs are distinct in the unique index).
_QUEUED = (
    deduplicated(
        pg_insert(jobs).values(
            kind=bindparam("kind"),
            tenant_id=bindparam("tenant_id"),
            conversation_id=bindparam("conversation_id"),
            payload=bindparam("payload", type_=JSONB),
            dedupe_key=bindparam("dedupe_key"),
            max_attempts=bindparam("max_attempts"),
            run_after=func.now() + bindparam("delay", type_=Interval),
        )
    )
    .returning(jobs.c.id)
    .cte("queued")
)
_QUEUE = select(_QUEUED.c.id)
# Workers are woken in the same round trip, once per job queued (none when deduplicated),
# and only if and when the caller commits; a delayed job is found by polling instead.
_WAKING = select(_QUEUED.c.id, func.pg_notify(CHANNEL, bindparam("kind")))


async def enqueue(
    conn: AsyncConnection,
    *,
    kind: str,
    tenant_id: int | None,
    conversation_id: int | None,
    payload: Mapping[str, Any] | None = None,
    dedupe_key: str | None = None,
    max_attempts: int = 5,
    delay_seconds: float = 0,
) -> int | None:
    """Queue a job in the caller's transaction; its id, or None if deduplicated.

    With `dedupe_key`, a job with the same key that is still queued makes this a no-op: the
    queued job will do the same (idempotent) work. Nothing is visible to workers until commit.
    """
    if not kind:
        raise InvalidInput("a job needs a kind", param="kind")
    if max_attempts < 1:
        raise InvalidInput("max_attempts must be at least 1", param="max_attempts")
    if delay_seconds < 0:
        raise InvalidInput("delay_seconds must not be negative", param="delay_seconds")
    statement = _WAKING if delay_seconds <= 0 else _QUEUE
    job_id = await conn.scalar(
        statement,
        {
            "kind": kind,
            "tenant_id": tenant_id,
            "conversation_id": conversation_id,
            "payload": dict(payload or {}),
            "dedupe_key": dedupe_key,
            "max_attempts": max_attempts,
            "delay": timedelta(seconds=delay_seconds),
        },
    )
    return None if job_id is None else int(job_id)


async def pending(conn: AsyncConnection, *, conversation_id: int, dedupe_key: str) -> bool:
    """Whether a job of the conversation with `dedupe_key` is queued or running."""
    found = await conn.scalar(
        select(jobs.c.id)
        .where(
            jobs.c.conversation_id == conversation_id,
            jobs.c.dedupe_key == dedupe_key,
            or_(jobs.c.status == _Q, jobs.c.status == _R),
        )
        .limit(1)
    )
    return found is not None


async def _notify(conn: AsyncConnection, kind: str) -> None:
    # The payload is the kind only: notices are visible to every session of the database.
    await conn.execute(select(func.pg_notify(CHANNEL, kind)))


# --- Claiming and settling (each in a transaction of its own) --------------------------------


@asynccontextmanager
async def storage_errors(what: str) -> AsyncIterator[None]:
    """Translate driver errors into `StorageUnavailable`, without the statement's parameters."""
    try:
        yield
    except (OSError, DBAPIError) as exc:
        cause = exc.orig if isinstance(exc, DBAPIError) else exc
        raise StorageUnavailable(f"{what} failed: {type(cause).__name__}: {cause}") from exc
    except PoolTimeout as exc:
        # Every pooled connection busy for the pool's whole wait: a passing fault, waited out
        # like a lost database. Untranslated, it ended the worker, or a running job's lease
        # keeper (the lease ran out and another worker ran the job beside it).
        raise StorageUnavailable(f"{what} failed: no database connection came free") from exc


_JOB_COLUMNS = (
    jobs.c.id,
    jobs.c.kind,
    jobs.c.tenant_id,
    jobs.c.conversation_id,
    jobs.c.payload,
    jobs.c.attempts,
    jobs.c.max_attempts,
    jobs.c.locked_by,
    jobs.c.lease_until,
)


def _job(row: Row[Any]) -> Job:
    return Job(
        id=row.id,
        kind=row.kind,
        tenant_id=row.tenant_id,
        conversation_id=row.conversation_id,
        payload=dict(row.payload or {}),
        attempts=row.attempts,
        max_attempts=row.max_attempts,
        locked_by=row.locked_by,
        lease_until=row.lease_until,
    )


def _sibling_running(job: Any) -> ColumnElement[bool]:
    """Another job of `job`'s conversation is running (false for a job without one)."""
    other = jobs.alias("running_sibling")
    # Even one whose lease has expired blocks: that one is reclaimed first, so the
    # conversation's order is kept.
    return exists().where(
        other.c.conversation_id == job.c.conversation_id,
        other.c.status == _R,
        other.c.id != job.c.id,
    )


def _older_queued(job: Any) -> ColumnElement[bool]:
    """An older job of `job`'s conversation is queued (false for a job without one)."""
    other = jobs.alias("queued_sibling")
    # Even one waiting out a backoff: the conversation's work is applied in order.
    return exists().where(
        other.c.conversation_id == job.c.conversation_id,
        other.c.status == _Q,
        other.c.id < job.c.id,
    )


# `job` is an alias of `jobs`. A NULL conversation_id equals nothing, so the sibling tests are
# false for jobs without a conversation: those are unordered. The tests are top-level ANDs, so
# that the planner may turn them into anti-joins.


def _startable(job: Any) -> ColumnElement[bool]:
    """A queued job that is due and first in its conversation's line."""
    return and_(
        job.c.status == _Q,
        job.c.run_after <= func.now(),
        ~_sibling_running(job),
        ~_older_queued(job),
    )


def _reclaimable(job: Any) -> ColumnElement[bool]:
    """A running job whose worker died or hung (its lease ran out), with attempts left."""
    return and_(
        job.c.status == _R,
        job.c.lease_until < func.now(),
        job.c.attempts < job.c.max_attempts,
        ~_sibling_running(job),
    )


def _eligible(job: Any) -> ColumnElement[bool]:
    return or_(_startable(job), _reclaimable(job))


def _candidates(*, by_kind: bool, by_conversation: bool) -> Executable:
    """The jobs a claim tries, in order: reclaims first (they started earliest), then queued
    jobs by due time; with `by_kind`, only those of the kinds bound to `kinds`, and with
    `by_conversation`, of the conversations bound to `conversations`.

    Two branches, so that each reads only its own partial index (`ix_jobs_running`,
    `ix_jobs_claim`) and never the ever-growing history of done jobs.
    """
    branches: list[Subquery] = []
    for priority, condition, due in (
        (0, _reclaimable, "lease_until"),
        (1, _startable, "run_after"),
    ):
        job = jobs.alias("candidate")
        branch = (
            select(
                job.c.id,
                job.c.conversation_id,
                literal(priority, Integer).label("priority"),
                job.c[due].label("due"),
            )
            .where(condition(job))
            .order_by(job.c[due], job.c.id)
            .limit(_CANDIDATES)
        )
        if by_kind:
            branch = branch.where(job.c.kind.in_(bindparam("kinds", expanding=True)))
        if by_conversation:
            branch = branch.where(
                job.c.conversation_id.in_(bindparam("conversations", expanding=True))
            )
        branches.append(branch.subquery())
    reclaims, queued = branches
    both = union_all(select(reclaims), select(queued)).subquery("both")
    return (
        select(both.c.id, both.c.conversation_id)
        .order_by(both.c.priority, both.c.due, both.c.id)
        .limit(_CANDIDATES)
    )


def _take_statement() -> Executable:
    """Claim job `:job_id` for `:worker_id` and `:lease` if it is still eligible and no one else
    is taking it (SKIP LOCKED)."""
    this = jobs.alias("this")
    still_eligible = (
        select(this.c.id)
        .where(this.c.id == bindparam("job_id"), _eligible(this))
        .with_for_update(of=this, skip_locked=True)
        .scalar_subquery()
    )
    return (
        update(jobs)
        .where(jobs.c.id == still_eligible)
        .values(
            status=_R,
            attempts=jobs.c.attempts + 1,
            locked_by=bindparam("worker_id"),
            lease_until=func.now() + bindparam("lease", type_=Interval()),
            updated_at=func.now(),
        )
        .returning(*_JOB_COLUMNS)
    )


# The claim's statements are built once: building these aliased, nested constructs costs more
# than running them. They are immutable SQL, with every varying value a bound parameter.
_LISTS: Final = {
    (by_kind, by_conversation): _candidates(by_kind=by_kind, by_conversation=by_conversation)
    for by_kind in (False, True)
    for by_conversation in (False, True)
}
_TAKE: Final = _take_statement()
# Jobs whose lease ran out after their last allowed attempt: their worker died each time.
_BURY_LOST: Final = (
    update(jobs)
    .where(
        jobs.c.status == _R,
        jobs.c.lease_until < func.now(),
        jobs.c.attempts >= jobs.c.max_attempts,
    )
    .values(
        status=_DEAD,
        finished_at=func.now(),
        lease_until=None,
        updated_at=func.now(),
        last_error=func.left(
            func.concat(
                "its worker was lost (killed or hung) on each of its ",
                jobs.c.attempts,
                " attempts",
                func.coalesce(func.concat("; last error: ", jobs.c.last_error), ""),
            ),
            MAX_ERROR_CHARS,
        ),
    )
    .returning(jobs.c.id, jobs.c.kind, jobs.c.attempts)
)
_TRY_LOCK: Final = select(
    func.pg_try_advisory_xact_lock(
        literal(_LOCK_NAMESPACE, Integer), bindparam("key", type_=Integer)
    )
)


async def claim(
    engine: AsyncEngine,
    *,
    worker_id: str,
    lease_seconds: float,
    kinds: Collection[str] | None = None,
    conversations: Collection[int] | None = None,
) -> Job | None:
    """Claim the job due longest (of `kinds`, or of any kind; of `conversations`, or of any)
    for `lease_seconds`, or None.

    One transaction, in three steps, because a single statement cannot be safe: its snapshot is
    taken before any lock it acquires, so it could decide on a state that a claim committed
    meanwhile has already changed (two jobs of one conversation running at once).

    1. List the first eligible jobs (no locks): expired leases, then queued jobs by due time.
    2. For a job with a conversation, `pg_try_advisory_xact_lock` on that conversation: held
       until our commit, it makes claims of one conversation take turns; if another claimer
       holds it, skip to the next candidate.
    3. Re-check eligibility and take the row (`FOR UPDATE SKIP LOCKED`) in a new statement,
       whose fresh snapshot sees every claim committed before we got the lock.
    """
    if lease_seconds <= 0:
        raise InvalidInput("lease_seconds must be positive", param="lease_seconds")
    wanted = None if kinds is None else list(kinds)
    of = None if conversations is None else list(conversations)
    if (wanted is not None and not wanted) or (of is not None and not of):
        return None
    bound = {"kinds": wanted, "conversations": of}
    listing = _LISTS[wanted is not None, of is not None]
    async with storage_errors("claiming a job"), engine.begin() as conn:
        for job_id, kind, attempts in await conn.execute(_BURY_LOST):
            log.warning("job %d (%s) is dead: its worker was lost %d times", job_id, kind, attempts)
        listed = await conn.execute(
            listing, {name: value for name, value in bound.items() if value is not None}
        )
        for job_id, conversation_id in listed.all():
            if conversation_id is not None and not await _lock_conversation(conn, conversation_id):
                continue
            job = await _take(conn, job_id=job_id, worker_id=worker_id, lease_seconds=lease_seconds)
            if job is not None:
                return job
    return None


async def _lock_conversation(conn: AsyncConnection, conversation_id: int) -> bool:
    # Ids beyond 2^31 share a key with a smaller one: a harmless, momentary skip.
    return bool(await conn.scalar(_TRY_LOCK, {"key": conversation_id % 2**31}))


async def _take(
    conn: AsyncConnection, *, job_id: int, worker_id: str, lease_seconds: float
) -> Job | None:
    row = (
        await conn.execute(
            _TAKE,
            {"job_id": job_id, "worker_id": worker_id, "lease": timedelta(seconds=lease_seconds)},
        )
    ).one_or_none()
    return None if row is None else _job(row)


# --- Reviving (in the caller's transaction) ------------------------------------------------


async def retry(conn: AsyncConnection, *, job_id: int, tenant_id: int | None = None) -> bool:
    """Queue a dead (or backing-off) job to run now, with its attempts reset.

    Scoped to `tenant_id` when given. True if the job is now queued; False if it is running or
    done, or if a job with the same `dedupe_key` is already queued (that one will do the work).
    Raises `NotFound` if the job does not exist (for this tenant).
    """
    scope = [jobs.c.id == job_id]
    if tenant_id is not None:
        scope.append(jobs.c.tenant_id == tenant_id)
    revive = (
        update(jobs)
        .where(*scope, jobs.c.status.in_([_DEAD, _Q]))
        .values(
            status=_Q,
            attempts=0,
            run_after=func.now(),
            locked_by=None,
            lease_until=None,
            finished_at=None,
            updated_at=func.now(),
        )
        .returning(jobs.c.kind)
    )
    try:
        # A savepoint, so that a duplicate key does not abort the caller's transaction.
        async with conn.begin_nested():
            kind = await conn.scalar(revive)
    except IntegrityError:
        return False
    if kind is not None:
        await _notify(conn, kind)
        return True
    if await conn.scalar(select(jobs.c.id).where(*scope)) is None:
        raise NotFound(f"job {job_id} does not exist")
    return False
