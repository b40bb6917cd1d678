"""`serve`'s background workers in a process of their own, beside the one that answers requests.

Embedding, segmenting and summarizing are CPU work; run on the request path's event loop (as
they once were, in a task of the same process), they took the GIL away from it for tens of
milliseconds at a time and added ~60 ms to every request while a tree was being built. So
`serve` with `MEMSTRATA_WORKERS` > 0 starts one child process (multiprocessing, spawned: a
fresh interpreter, nothing inherited but its arguments) that runs the job queue with that
many jobs at once, exactly as `memstrata worker` does (`gateway.background`).

* The child runs at a lower CPU priority (`MEMSTRATA_WORKER_NICE`, 10 by default: a nice-10
  process competing with nice-0 ones gets about a tenth of their share of a core): on a busy
  machine the requests, and the Postgres backends that serve them, get the cores first, and
  the background takes what they leave (its trees lag while the machine stays busy; messages
  not embedded yet are still found by full text); on an idle one it runs as fast as before.
* Job outcomes cross back through a queue, so `serve`'s `/metrics` still counts them.
* The child stops when `serve` stops (it finishes the jobs in hand for
  `MEMSTRATA_WORKER_GRACE_SECONDS`, then gives back those still running; one that does not
  leave a few seconds later is terminated, its unfinished job's lease runs out and another
  worker takes it over), and also when `serve` dies without stopping it. Each child is told
  to stop by `serve` closing a pipe of that child's own, which the kernel also closes when
  `serve` dies; the child watches its parent too and exits once orphaned. Closing a pipe
  waits for no one: the children once shared a multiprocessing Event, whose `set()` waits for
  every process waiting on it to wake, and for ever for a child killed while it waited, so
  `serve` never finished stopping after it had replaced a dead child, and its new child,
  blocked on the lock that `set()` held, never noticed `serve` was gone. The child ignores
  SIGINT, which a terminal's Ctrl-C sends it beside `serve`: `serve` stops it.
* A child that dies while `serve` runs (killed by the OOM killer, crashed) is logged and
  replaced by a new one, after a delay that doubles while children keep dying young: without
  it `serve` went on answering while the jobs it queued were never run. A job the dead child
  held is taken over once its lease runs out. Each child has an outcome queue of its own: one
  killed while writing to a shared queue would leave its lock held for good.
"""

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from gateway import background, logs
from gateway.settings import Settings
from memory.build.worker import JobObserver
from memory.db import connect

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.5
# Seconds before a dead child is replaced: doubled while children die within
# `_RESTART_SETTLED` seconds of starting (a crash at start-up), up to `_RESTART_LAST`.
_RESTART_FIRST = 1.0
_RESTART_LAST = 60.0
_RESTART_SETTLED = 60.0


@contextlib.asynccontextmanager
async def running(
    settings: Settings,
    database_url: str,
    *,
    observe: JobObserver | None = None,
) -> AsyncIterator[None]:
    """The worker process (another one whenever it dies), for the duration of the block."""
    grace = settings.worker_grace_seconds + background.STOP_MARGIN
    context = multiprocessing.get_context("spawn")

    def start() -> _Child:
        outcomes: Any = context.Queue()
        stop_read, stop = context.Pipe(duplex=False)
        process = context.Process(
            target=_main,
            args=(settings, database_url, outcomes, stop_read, os.getpid()),
            name="memstrata-worker",
            daemon=True,
        )
        process.start()
        # The child has its own copy now; the only end left here is the one that stops it.
        stop_read.close()
        log.info("background worker process started", extra={"pid": process.pid})
        return _Child(process, outcomes, stop, asyncio.create_task(_relay(outcomes, observe)))

    current = [start()]
    keeper = asyncio.create_task(_replace_when_dead(current, start))
    try:
        yield
    finally:
        # No replacement from here on: the child now leaves because it is told to.
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        (child,) = current
        child.stop.close()
        await asyncio.to_thread(child.process.join, grace)
        if child.process.is_alive():
            log.warning("background worker process did not stop within %.0fs", grace)
            child.process.terminate()
            await asyncio.to_thread(child.process.join, 5)
        await child.close()


@dataclass
class _Child:
    """One worker process, the queue its job outcomes come back on, the pipe whose closing
    stops it, and the relay of its outcomes."""

    process: BaseProcess
    outcomes: Any
    stop: Connection
    relay: asyncio.Task[None]

    async def close(self) -> None:
        self.stop.close()
        self.relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.relay
        self.outcomes.close()


async def _replace_when_dead(current: list[_Child], start: Callable[[], _Child]) -> None:
    """Start a new child whenever `current`'s has died, backing off while they die young."""
    delay = _RESTART_FIRST
    started = time.monotonic()
    while True:
        await asyncio.sleep(_POLL_SECONDS)
        (child,) = current
        if child.process.is_alive():
            continue
        if time.monotonic() - started > _RESTART_SETTLED:
            delay = _RESTART_FIRST
        log.error(
            "background worker process %s exited with code %s; starting another in %.0fs",
            child.process.pid,
            child.process.exitcode,
            delay,
        )
        await child.close()
        await asyncio.sleep(delay)
        current[0] = start()
        started = time.monotonic()
        delay = min(delay * 2, _RESTART_LAST)


async def _relay(outcomes: Any, observe: JobObserver | None) -> None:
    """Hand the child's job outcomes to `observe`, as they come."""
    while True:
        try:
            kind, seconds, outcome = await asyncio.to_thread(outcomes.get, True, _POLL_SECONDS)
        except queue.Empty:
            continue
        except (EOFError, OSError, ValueError):
            return  # the queue is closed: the child is gone
        if observe is not None:
            observe(kind, seconds, outcome)


def _main(
    settings: Settings, database_url: str, outcomes: Any, stop: Connection, parent: int
) -> None:
    """The child: run the queue until the pipe `stop` reads from is closed, or the parent is
    gone."""
    # Ctrl-C in a terminal signals the whole foreground process group, this child too: `serve`
    # stops on it and tells the child to (closes `stop`), which finishes its jobs in hand first.
    # Interrupted by the signal itself, the child abandoned them, each until its lease ran out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(settings.worker_nice)
    logs.configure(level=settings.log_level, format=settings.log_format)
    asyncio.run(_work(settings, database_url, outcomes, stop, parent))


async def _work(
    settings: Settings, database_url: str, outcomes: Any, stop: Connection, parent: int
) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def watch() -> None:
        # Nothing is ever sent: the pipe becomes readable (at its end) once `serve` closes it,
        # or dies. The parent's pid is looked at too, in case a process forked from `serve`
        # holds a copy of its end.
        while not stop.poll(_POLL_SECONDS):
            if os.getppid() != parent:
                break  # orphaned: serve died without stopping us
        loop.call_soon_threadsafe(stopping.set)

    threading.Thread(target=watch, name="memstrata-worker-watch", daemon=True).start()
    engine = connect(database_url, pool_size=max(2, settings.workers + 1))
    upstream = background.provider(settings)
    try:
        config = background.tree_config(settings, upstream, background.embedder(settings, upstream))
        runner = background.worker(
            engine,
            settings,
            config,
            concurrency=settings.workers,
            observe=lambda kind, seconds, outcome: outcomes.put((kind, seconds, outcome)),
        )
        await runner.run(stopping)
    finally:
        await upstream.aclose()
        await engine.dispose()
