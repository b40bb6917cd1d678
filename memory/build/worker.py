"""Workers: processes that run the queue's jobs (`memory.build.jobs`) with registered handlers.

A `Worker` runs `concurrency` loops that claim a job, run its handler while a background task
extends the lease every lease/3 seconds, and complete or fail it. A handler's exception fails
the job (logged by id and kind only: the error text goes to `last_error`, never the log); a
lost lease cancels the handler, because the job now belongs to another worker. Idle loops wake
on a NOTIFY (a dedicated LISTEN connection) or after the poll interval. `run(stop)` returns once
`stop` is set and the jobs in hand are done; `run_until_idle()` runs until nothing is eligible.
"""

import asyncio
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

from memory.build.jobs import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    CHANNEL,
    MAX_ERROR_CHARS,
    Handler,
    Job,
    claim,
    complete,
    describe_lost,
    extend_lease,
    fail,
)
from memory.errors import InvalidInput, StorageUnavailable

log = logging.getLogger(__name__)

JobObserver = Callable[[str, float, str], None]
"""Told `(kind, seconds, outcome)` of every job this worker runs: outcome `done`, `failed` or
`abandoned` (its lease was lost to another worker). Metrics hang on it; `memory` stays free of
them."""


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
        listen: bool = True,
        observe: JobObserver | None = None,
    ) -> None:
        if lease_seconds <= 0:
            raise InvalidInput("lease_seconds must be positive", param="lease_seconds")
        if poll_interval <= 0:
            raise InvalidInput("poll_interval must be positive", param="poll_interval")
        if concurrency < 1:
            raise InvalidInput("concurrency must be at least 1", param="concurrency")
        self.worker_id = worker_id or default_worker_id()
        self._engine = engine
        self._handlers = dict(handlers)
        self._lease = lease_seconds
        self._poll = poll_interval
        self._concurrency = concurrency
        self._kinds = None if kinds is None else tuple(kinds)
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._listen_enabled = listen
        self._observe = observe
        # Set by a NOTIFY on `CHANNEL`; idle loops wait on it or on the poll interval.
        self._wake = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Run jobs until `stop` is set; then finish the jobs in hand and return."""
        listener = asyncio.create_task(self._listen(stop)) if self._listen_enabled else None
        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(self._concurrency):
                    group.create_task(self._loop(stop))
        finally:
            if listener is not None:
                if not stop.is_set():  # we are leaving on an error or a cancellation
                    listener.cancel()
                await asyncio.gather(listener, return_exceptions=True)

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

    async def _idle(self, stop: asyncio.Event, *, wake: bool) -> None:
        """Wait for `stop`, a notice (if `wake`), or the poll interval."""
        waits = [asyncio.ensure_future(stop.wait())]
        if wake:
            waits.append(asyncio.ensure_future(self._wake.wait()))
        try:
            await asyncio.wait(waits, timeout=self._poll, return_when=asyncio.FIRST_COMPLETED)
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
        work = asyncio.create_task(_run_handler(handler, job), name=f"job-{job.id}")
        lost = asyncio.Event()
        keeper = asyncio.create_task(self._keep_lease(job, work, lost))
        try:
            try:
                await work
            finally:
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
            else:
                self._observed(job, started, "failed")
                await self._fail(job, "the handler was cancelled")
        except Exception as exc:
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
            self._observed(job, started, "done")
            try:
                await complete(self._engine, job=job)
            except StorageUnavailable as exc:
                # The lease runs out and the job runs again: handlers are idempotent.
                log.warning("job %d (%s): could not be marked done: %s", job.id, job.kind, exc)

    def _observed(self, job: Job, started: float, outcome: str) -> None:
        if self._observe is not None:
            self._observe(job.kind, time.perf_counter() - started, outcome)

    async def _fail(self, job: Job, error: str) -> None:
        try:
            await fail(
                self._engine,
                job=job,
                error=error,
                backoff_base=self._backoff_base,
                backoff_cap=self._backoff_cap,
            )
        except StorageUnavailable as exc:
            # The lease runs out and the job runs again, as if this attempt had not happened.
            log.warning("job %d (%s): could not record its failure: %s", job.id, job.kind, exc)

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
        """Hold a LISTEN connection that wakes idle loops; reconnect after a failure."""
        dsn = _listen_dsn(self._engine.url)
        failures = 0
        while not stop.is_set():
            try:
                connection = await asyncpg.connect(
                    dsn, server_settings={"application_name": "memstrata-listen"}
                )
            except (OSError, asyncpg.PostgresError) as exc:
                failures += 1
                # Once per outage, not once per poll: polling carries on meanwhile.
                log.log(
                    logging.WARNING if failures == 1 else logging.DEBUG,
                    "worker %s cannot LISTEN (polling instead): %s",
                    self.worker_id,
                    exc,
                )
            else:
                failures = 0
                try:
                    await self._listen_on(connection, stop)
                except (OSError, asyncpg.PostgresError) as exc:
                    log.warning("worker %s lost its LISTEN connection: %s", self.worker_id, exc)
                finally:
                    await _close(connection)
            if not stop.is_set():
                await self._idle(stop, wake=False)

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
    except (OSError, asyncpg.PostgresError, TimeoutError):
        connection.terminate()


async def _run_handler(handler: Handler, job: Job) -> None:
    await handler(job)
