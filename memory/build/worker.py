"""Workers: processes that run the queue's jobs (`memory.build.jobs`) with registered handlers.

A `Worker` runs `concurrency` loops that claim a job, run its handler while a background task
extends the lease every lease/3 seconds, and complete or fail it (`memory.build.outcomes`). A
handler's exception fails the job (logged by id and kind only: the error text goes to
`last_error`, never the log), except a passing upstream fault (`ProviderUnavailable`: the
upstream is down, timing out, rate-limiting or answering 5xx), which gives the job back
without spending an attempt, after a backoff that grows while such faults of its endpoint
follow one another with no answer between them (`memory.build.backoff.Outage`): an outage of
any length dead-letters nothing. But if the endpoint answered any worker after the job's
previous attempt met it unavailable, the upstream works and fails this job by itself (a
request it always answers 500, or never in time): the fault is charged as a failed attempt,
with one warning saying so, and the job ends in the dead letter like any failing job
(`memory.build.upstream`). A lost lease cancels the handler, because the job now belongs to
another worker.

The worker learns that the upstream answers from the job's handlers themselves: each runs with
a `memory.provider.Answers` (`memory.provider.noting`) in which every provider call notes its
answers; the worker records them for every worker (`memory.build.upstream.note_answers`) and
ends its own outage of each endpoint that answered.

Idle loops wake on a NOTIFY (a dedicated LISTEN connection, reconnected whenever it fails or
the server ends it, with a warning) or after the poll interval. With a `retention`, the worker
also deletes done jobs older than that now and then (`memory.build.retention`).

`run(stop)` returns once `stop` is set and the jobs in hand are done, or, after `grace`
seconds, gives those still running back to the queue (their attempt not spent) and returns;
`run_until_idle()` runs until nothing is eligible.
"""

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection, Mapping
from typing import Any, Final

import asyncpg
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.build import retention, upstream
from memory.build.backoff import BACKOFF_BASE, BACKOFF_CAP, OUTAGE_BACKOFF_CAP, Outage
from memory.build.jobs import CHANNEL, MAX_ERROR_CHARS, Handler, Job, claim
from memory.build.outcomes import complete, describe_lost, extend_lease, fail, requeue
from memory.errors import InvalidInput, ProviderUnavailable, StorageUnavailable
from memory.provider import Answers, noting

log = logging.getLogger(__name__)

JobObserver = Callable[[str, float, str], None]
"""Told `(kind, seconds, outcome)` of every job this worker runs: outcome `done`, `failed`
(an unavailable upstream that answers others included), `deferred` (its upstream was
unavailable: given back, no attempt spent), `abandoned` (its lease
was lost to another worker) or `released` (given back when the worker stopped). Metrics hang on
it; `memory` stays free of them."""

# Seconds between two looks for done jobs past their retention: each look is one indexed scan
# and deletes in bounded batches, so a week's backlog goes at the first one.
SWEEP_SECONDS: Final = 300.0
# The longest wait before a lost LISTEN connection is opened again: notices sent meanwhile are
# lost, and a worker with a long poll interval would sleep through its queue until then.
_RELISTEN_SECONDS: Final = 1.0


_DSN_OPTIONS: Final = frozenset(
    {"sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslpassword", "sslnegotiation"}
)


def _listen_dsn(url: URL) -> str:
    """The engine's URL as a plain asyncpg DSN, keeping the TLS options asyncpg understands.

    The other query options are SQLAlchemy's own (asyncpg would send them to the server as
    settings and fail), and SQLAlchemy's `ssl=` is asyncpg's `sslmode=`.
    """
    query = {k: v for k, v in url.query.items() if k in _DSN_OPTIONS}
    if "ssl" in url.query and "sslmode" not in query:
        query["sslmode"] = url.query["ssl"]
    return url.set(drivername="postgresql", query=query).render_as_string(hide_password=False)


def default_worker_id() -> str:
    """`host:pid:random`: unique per Worker, and says where a stuck job's worker lives."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


class Worker:
    """Runs jobs with `handlers` (kind → handler), `concurrency` at a time.

    Claims jobs of `kinds` (default: every kind; a job of a kind without a handler is failed,
    so that it ends in the dead letter rather than sitting unseen in the queue).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        handlers: Mapping[str, Handler],
        *,
        worker_id: str | None = None,
        lease_seconds: float = 60,
        poll_interval: float = 1.0,
        concurrency: int = 1,
        kinds: Collection[str] | None = None,
        backoff_base: float = BACKOFF_BASE,
        backoff_cap: float = BACKOFF_CAP,
        outage_backoff_cap: float = OUTAGE_BACKOFF_CAP,
        listen: bool = True,
        observe: JobObserver | None = None,
        grace: float | None = None,
        retention: float | None = None,
        sweep_interval: float = SWEEP_SECONDS,
    ) -> None:
        """`grace`: seconds `run` lets the jobs in hand finish once stopped (None: as long as
        they take); `retention`: seconds a done job is kept (None: for ever), looked for every
        `sweep_interval` seconds."""
        if lease_seconds <= 0:
            raise InvalidInput("lease_seconds must be positive", param="lease_seconds")
        if poll_interval <= 0:
            raise InvalidInput("poll_interval must be positive", param="poll_interval")
        if concurrency < 1:
            raise InvalidInput("concurrency must be at least 1", param="concurrency")
        if grace is not None and grace < 0:
            raise InvalidInput("grace must not be negative", param="grace")
        if retention is not None and retention <= 0:
            raise InvalidInput("retention must be positive", param="retention")
        self.worker_id = worker_id or default_worker_id()
        self._engine = engine
        self._handlers = dict(handlers)
        self._lease = lease_seconds
        self._poll = poll_interval
        self._concurrency = concurrency
        self._kinds = None if kinds is None else tuple(kinds)
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._outage = Outage(base=backoff_base, cap=outage_backoff_cap)
        self._listen_enabled = listen
        self._observe = observe
        self.grace = grace
        self._retention = retention
        self._sweep_interval = sweep_interval
        # Set by a NOTIFY on `CHANNEL`; idle loops wait on it or on the poll interval.
        self._wake = asyncio.Event()
        # The handlers running now, by job id; given back once `grace` has run out.
        self._in_hand: dict[int, asyncio.Task[None]] = {}
        self._releasing = False

    async def run(self, stop: asyncio.Event) -> None:
        """Run jobs until `stop` is set; then finish the jobs in hand (for up to `grace`
        seconds, after which they are given back) and return."""
        # Each ends by itself once `stop` is set.
        helpers = [self._listen(stop)] if self._listen_enabled else []
        if self._retention is not None:
            helpers.append(self._sweep(stop, self._retention))
        tasks = [asyncio.create_task(helper) for helper in helpers]
        deadline = None if self.grace is None else asyncio.create_task(self._release_late(stop))
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(self._concurrency):
                    group.create_task(self._loop(stop))
        finally:
            if deadline is not None:
                deadline.cancel()
                tasks.append(deadline)
            if not stop.is_set():  # we are leaving on an error or a cancellation
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _release_late(self, stop: asyncio.Event) -> None:
        """Once `stop` is set and `grace` has passed, cancel the handlers still running: their
        jobs are given back (`_execute`), so that a stopping worker is not held for as long as a
        job may take (a summary's upstream request, minutes) and loses none of them."""
        await stop.wait()
        await asyncio.sleep(self.grace or 0)
        self._releasing = True
        for job_id, work in list(self._in_hand.items()):
            log.warning(
                "worker %s stopping: job %d still running after %gs; giving it back",
                self.worker_id,
                job_id,
                self.grace,
            )
            work.cancel()

    async def _sweep(self, stop: asyncio.Event, older_than: float) -> None:
        """Delete done jobs older than `older_than` seconds every `sweep_interval`, until
        `stop` is set."""
        while not stop.is_set():
            try:
                deleted = await retention.delete_done(self._engine, older_than=older_than)
            except StorageUnavailable as exc:
                log.warning("worker %s cannot delete old done jobs: %s", self.worker_id, exc)
            else:
                if deleted:
                    log.info("worker %s deleted %d old done jobs", self.worker_id, deleted)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._sweep_interval)

    async def run_until_idle(self, *, conversations: Collection[int] | None = None) -> int:
        """Run jobs (of `conversations` only, if given) until none is eligible (delayed
        retries are not waited for); how many ran."""
        ran = 0

        async def loop() -> None:
            nonlocal ran
            # A loop that finishes a job always claims again, so a job unblocked by the last
            # one to finish (the next of its conversation) is still run.
            while (job := await self._claim(conversations)) is not None:
                await self._execute(job)
                ran += 1

        async with asyncio.TaskGroup() as group:
            for _ in range(self._concurrency):
                group.create_task(loop())
        return ran

    async def _claim(self, conversations: Collection[int] | None = None) -> Job | None:
        return await claim(
            self._engine,
            worker_id=self.worker_id,
            lease_seconds=self._lease,
            kinds=self._kinds,
            conversations=conversations,
        )

    async def _loop(self, stop: asyncio.Event) -> None:
        failures = 0
        while not stop.is_set():
            # Cleared before claiming, so a notice that arrives during the claim is not lost.
            self._wake.clear()
            try:
                job = await self._claim()
            except StorageUnavailable as exc:
                failures += 1
                # Once per outage, not once per poll (as the LISTEN connection does).
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "worker %s cannot claim jobs: %s",
                    self.worker_id,
                    exc,
                )
                await self._idle(stop, wake=False)
                continue
            failures = 0
            if job is None:
                await self._idle(stop, wake=True)
            else:
                await self._execute(job)

    async def _idle(self, stop: asyncio.Event, *, wake: bool, seconds: float | None = None) -> None:
        """Wait for `stop`, a notice (if `wake`), or `seconds` (the poll interval if None)."""
        waits = [asyncio.ensure_future(stop.wait())]
        if wake:
            waits.append(asyncio.ensure_future(self._wake.wait()))
        try:
            await asyncio.wait(
                waits,
                timeout=self._poll if seconds is None else seconds,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _execute(self, job: Job) -> None:
        """Run one claimed job and record its outcome; never raises for the job's own faults."""
        handler = self._handlers.get(job.kind)
        if handler is None:
            log.warning("job %d (%s): worker %s has no handler", job.id, job.kind, self.worker_id)
            known = ", ".join(sorted(self._handlers)) or "none"
            await self._fail(
                job,
                f"no handler for job kind {job.kind!r} on worker {self.worker_id} "
                f"(it handles: {known})",
            )
            return
        started = time.perf_counter()
        answers = Answers()
        work = asyncio.create_task(_run_handler(handler, job, answers), name=f"job-{job.id}")
        self._in_hand[job.id] = work
        lost = asyncio.Event()
        keeper = asyncio.create_task(self._keep_lease(job, work, lost))
        try:
            try:
                await work
            finally:
                del self._in_hand[job.id]
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are being cancelled: the lease runs out and another worker retries
            if lost.is_set():
                what = await describe_lost(self._engine, job=job)
                log.warning("job %d (%s) %s; abandoned", job.id, job.kind, what)
                self._observed(job, started, "abandoned")
            elif self._releasing:
                self._observed(job, started, "released")
                await self._requeue(job, None, 0)
            else:
                self._observed(job, started, "failed")
                await self._fail(job, "the handler was cancelled")
        except ProviderUnavailable as exc:
            await self._answered(answers)
            if await self._answers_others(job, exc):
                log.warning(
                    "job %d (%s) failed on attempt %d of %d, charged although its upstream is "
                    "unavailable: the %s endpoint answers other requests: %s",
                    job.id,
                    job.kind,
                    job.attempts,
                    job.max_attempts,
                    exc.endpoint,
                    exc,
                )
                self._observed(job, started, "failed")
                await self._fail(job, _describe(exc), upstream_failed=True)
                return
            delay = self._outage.failed(exc.endpoint)
            # Once per outage at warning level: every job of the queue meets the same one.
            log.log(
                logging.WARNING if self._outage.failures(exc.endpoint) == 1 else logging.INFO,
                "job %d (%s) deferred for %.1fs, its attempt not counted: %s",
                job.id,
                job.kind,
                delay,
                exc,
            )
            self._observed(job, started, "deferred")
            await self._requeue(job, _describe(exc), delay, upstream_failed=True)
        except Exception as exc:
            await self._answered(answers)
            # Only the exception's type: its message may quote conversation contents. The full
            # text is kept in the job's last_error, which only its tenant and the admin can read.
            log.warning(
                "job %d (%s) failed on attempt %d of %d: %s",
                job.id,
                job.kind,
                job.attempts,
                job.max_attempts,
                type(exc).__name__,
            )
            self._observed(job, started, "failed")
            await self._fail(job, _describe(exc))
        else:
            await self._answered(answers)
            self._observed(job, started, "done")
            try:
                await complete(self._engine, job=job)
            except StorageUnavailable as exc:
                # The lease runs out and the job runs again: handlers are idempotent.
                log.warning("job %d (%s): could not be marked done: %s", job.id, job.kind, exc)

    def _observed(self, job: Job, started: float, outcome: str) -> None:
        if self._observe is not None:
            self._observe(job.kind, time.perf_counter() - started, outcome)

    async def _answered(self, answers: Answers) -> None:
        """End this worker's outage of each endpoint that answered the job, and tell every
        worker that it answers."""
        for endpoint in answers.at:
            self._outage.answered(endpoint)
        try:
            await upstream.note_answers(self._engine, answers.at)
        except StorageUnavailable as exc:
            # Only evidence against a failing job is lost: it stays deferred a little longer.
            log.warning("worker %s cannot record the upstream's answers: %s", self.worker_id, exc)

    async def _answers_others(self, job: Job, exc: ProviderUnavailable) -> bool:
        """Whether the endpoint that failed `job` answered anyone since the job's previous
        attempt met it unavailable (`memory.build.upstream`)."""
        try:
            return await upstream.answered_since_failure(
                self._engine, job_id=job.id, endpoint=exc.endpoint
            )
        except StorageUnavailable:
            return False  # the outcome cannot be recorded either: the lease runs out

    async def _fail(self, job: Job, error: str, *, upstream_failed: bool = False) -> None:
        try:
            await fail(
                self._engine,
                job=job,
                error=error,
                backoff_base=self._backoff_base,
                backoff_cap=self._backoff_cap,
                upstream_failed=upstream_failed,
            )
        except StorageUnavailable as exc:
            # The lease runs out and the job runs again, as if this attempt had not happened.
            log.warning("job %d (%s): could not record its failure: %s", job.id, job.kind, exc)

    async def _requeue(
        self, job: Job, error: str | None, delay: float, *, upstream_failed: bool = False
    ) -> None:
        try:
            await requeue(
                self._engine,
                job=job,
                error=error,
                delay_seconds=delay,
                upstream_failed=upstream_failed,
            )
        except StorageUnavailable as exc:
            # The lease runs out and the job runs again (this attempt counted after all).
            log.warning("job %d (%s): could not give it back: %s", job.id, job.kind, exc)

    async def _keep_lease(self, job: Job, work: asyncio.Task[None], lost: asyncio.Event) -> None:
        """Extend the lease every third of it while `work` runs; cancel `work` if it is lost."""
        while True:
            await asyncio.sleep(self._lease / 3)
            try:
                kept = await extend_lease(self._engine, job=job, lease_seconds=self._lease)
            except StorageUnavailable as exc:
                # Keep trying: the lease has two more thirds to go.
                log.warning("job %d (%s): could not extend its lease: %s", job.id, job.kind, exc)
                continue
            if not kept:
                # Reclaimed by another worker: it runs the job now; running it twice at once
                # would break the conversation's one-at-a-time order.
                lost.set()
                work.cancel()
                return

    async def _listen(self, stop: asyncio.Event) -> None:
        """Hold a LISTEN connection that wakes idle loops until `stop` is set; reconnect after
        any failure, and say so: polling carries on meanwhile, but a worker that lost its
        wake-ups unnoticed waited out its poll interval for every job."""
        dsn = _listen_dsn(self._engine.url)
        failures = 0
        while not stop.is_set():
            try:
                connection = await asyncpg.connect(
                    dsn, server_settings={"application_name": "memstrata-listen"}
                )
            # Whatever it was (asyncpg raises some errors outside its PostgresError), this
            # task must not end: nothing would notice that wake-ups stopped.
            except Exception as exc:
                failures += 1
                # Once per outage, not once per poll: polling carries on meanwhile.
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "worker %s cannot LISTEN (polling instead): %s",
                    self.worker_id,
                    _describe(exc),
                )
            else:
                failures = 0
                try:
                    await self._listen_on(connection, stop)
                except Exception as exc:
                    log.warning(
                        "worker %s lost its LISTEN connection: %s", self.worker_id, _describe(exc)
                    )
                else:
                    if not stop.is_set():
                        log.warning(
                            "worker %s lost its LISTEN connection: the server closed it",
                            self.worker_id,
                        )
                finally:
                    await _close(connection)
            if not stop.is_set():
                await self._idle(stop, wake=False, seconds=min(self._poll, _RELISTEN_SECONDS))

    async def _listen_on(self, connection: Any, stop: asyncio.Event) -> None:
        """Wake idle loops on every notice until `stop` is set or `connection` closes."""
        closed = asyncio.Event()
        connection.add_termination_listener(lambda _connection: closed.set())
        await connection.add_listener(CHANNEL, lambda *_notice: self._wake.set())
        # Notices sent while we were not listening are lost: have the loops look now.
        self._wake.set()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(closed.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)


async def _close(connection: Any) -> None:
    if connection.is_closed():
        return
    try:
        await asyncio.wait_for(connection.close(), timeout=5)
    except Exception:  # any failure to close politely (the listener must live on): just drop it
        connection.terminate()


async def _run_handler(handler: Handler, job: Job, answers: Answers) -> None:
    with noting(answers):
        await handler(job)
