"""Background workers, composed from settings: the summary tree's job handler on the job queue.

`serve` runs them in-process (`MEMSTRATA_WORKERS` > 0) and `memstrata worker` runs them alone;
both build the same `TreeConfig` here, so a worker process and a gateway process treat a job
the same way.
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.settings import Settings
from memory.build import tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import make_summarizer
from memory.build.worker import JobObserver, Worker
from memory.embeddings import Embedder, make_embedder
from memory.provider import Provider

log = logging.getLogger(__name__)


def provider(settings: Settings) -> Provider:
    """The upstream as background work calls it (embeddings, summaries), with retries; the
    caller closes it."""
    return Provider(
        base_url=settings.upstream_url,
        api_key=settings.upstream_api_key,
        max_retries=settings.background_retries,
        timeout=settings.upstream_timeout,
    )


def embedder(settings: Settings, upstream: Provider) -> Embedder:
    """The embedder the settings ask for (local ONNX by default, offline)."""
    return make_embedder(
        provider=settings.embedding_provider,
        upstream=upstream,
        model=settings.embedding_model,
        model_path=settings.embedding_model_path,
        tokenizer_path=settings.embedding_tokenizer_path,
    )


def tree_config(settings: Settings, upstream: Provider, embed: Embedder) -> tree.TreeConfig:
    """How summary trees are built under these settings."""
    return tree.TreeConfig(
        embedder=embed,
        summarizer=make_summarizer(
            settings.summary_mode, provider=upstream, model=settings.summary_model
        ),
        policy=SegmentPolicy(
            shift_threshold=settings.shift_threshold,
            token_cap=settings.segment_token_cap,
            min_tokens=settings.segment_min_tokens,
        ),
        fanout=settings.fanout,
        summary_tokens=settings.summary_tokens,
        passages=settings.passages == "on",
    )


def worker(
    engine: AsyncEngine,
    settings: Settings,
    config: tree.TreeConfig,
    *,
    concurrency: int,
    observe: JobObserver | None = None,
) -> Worker:
    """A job worker with every handler memstrata has; `observe` is told each job's outcome."""
    return Worker(
        engine,
        {tree.JOB_KIND: tree.handler(engine, config)},
        lease_seconds=settings.job_lease_seconds,
        concurrency=concurrency,
        observe=observe,
    )


@asynccontextmanager
async def running(runner: Worker, *, grace: float = 10.0) -> AsyncIterator[None]:
    """Run `runner` in the background for the duration of the block; on exit let it finish
    the jobs in hand for up to `grace` seconds (an unfinished job's lease expires and another
    worker takes it over)."""
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, grace)
        except TimeoutError:
            log.warning("background worker did not stop within %.0fs", grace)
