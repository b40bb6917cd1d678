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
* The child stops when `serve` stops (it finishes the jobs in hand for a grace period, then is
  terminated; an unfinished job's lease runs out and another worker takes it over), and also
  when `serve` dies without stopping it: it watches its parent and exits once orphaned.
"""

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import threading
from collections.abc import AsyncIterator
from multiprocessing.synchronize import Event as ProcessEvent
from typing import Any

from gateway import background, logs
from gateway.settings import Settings
from memory.build import sweeper
from memory.build.worker import JobObserver
from memory.db import connect

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.5


@contextlib.asynccontextmanager
async def running(
    settings: Settings,
    database_url: str,
    *,
    observe: JobObserver | None = None,
    grace: float = 10.0,
) -> AsyncIterator[None]:
    """The worker process, for the duration of the block."""
    context = multiprocessing.get_context("spawn")
    outcomes: Any = context.Queue()
    stop = context.Event()
    child = context.Process(
        target=_main,
        args=(settings, database_url, outcomes, stop, os.getpid()),
        name="memstrata-worker",
        daemon=True,
    )
    child.start()
    log.info("background worker process started", extra={"pid": child.pid})
    relay = asyncio.create_task(_relay(outcomes, observe))
    try:
        yield
    finally:
        stop.set()
        await asyncio.to_thread(child.join, grace)
        if child.is_alive():
            log.warning("background worker process did not stop within %.0fs", grace)
            child.terminate()
            await asyncio.to_thread(child.join, 5)
        relay.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await relay
        outcomes.close()


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
    settings: Settings, database_url: str, outcomes: Any, stop: ProcessEvent, parent: int
) -> None:
    """The child: run the queue until `stop` is set or the parent is gone."""
    os.nice(settings.worker_nice)
    logs.configure(level=settings.log_level, format=settings.log_format)
    asyncio.run(_work(settings, database_url, outcomes, stop, parent))


async def _work(
    settings: Settings, database_url: str, outcomes: Any, stop: ProcessEvent, parent: int
) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def watch() -> None:
        while not stop.wait(_POLL_SECONDS):
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
        await sweeper.schedule(engine)
        await runner.run(stopping)
    finally:
        await upstream.aclose()
        await engine.dispose()
