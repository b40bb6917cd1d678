"""Background workers, composed from settings: the job handlers of the summary tree (build)
and of the working context's next turn (recall), on the job queue.

`serve` runs them (`MEMSTRATA_WORKERS` > 0) and `memstrata worker` runs them alone;
both build the same `TreeConfig` and working-context `Policy` here, so a worker process and a
gateway process treat a job the same way. `memory.build` and `memory.recall` never import each
other: the recall path's preparation takes plain arguments and is wrapped into a handler here.
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.settings import Settings
from memory.build import jobs, tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import make_summarizer
from memory.build.worker import JobObserver, Worker
from memory.embeddings import Embedder, make_embedder
from memory.provider import Provider
from memory.recall import anticipation, compaction
from memory.recall.prompt import TOOLS_GUIDE
from memory.recall.working_context import Policy
from memory.write.appends import CONTEXT_JOB

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
        quantization=settings.embedding_quantization,
        cache_dir=settings.embedding_cache_dir,
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


def policy(settings: Settings) -> Policy:
    """How working contexts spend the budget under these settings."""
    return Policy(
        high=settings.context_high_water,
        low=settings.context_low_water,
        note=settings.note_share,
        keep_notes=settings.keep_notes == "on",
        tools_guide=TOOLS_GUIDE if settings.memory_tools != "never" else None,
        cache_control=settings.cache_control == "on",
    )


def context_handler(engine: AsyncEngine, settings: Settings, embed: Embedder) -> jobs.Handler:
    """The job handler for `CONTEXT_JOB`: the next turn's recall, and its compaction when one
    nears."""
    rules = policy(settings)
    cross = settings.cross_conversation == "on"
    abandoned = settings.recall_abandoned_branches == "on"

    async def handle(job: jobs.Job) -> None:
        if job.tenant_id is None or job.conversation_id is None:
            raise ValueError(f"job {job.id} names no conversation")
        await anticipation.prepare(
            engine,
            embed,
            tenant_id=job.tenant_id,
            conversation_id=job.conversation_id,
            cross_conversation=cross,
            abandoned=abandoned,
        )
        await compaction.prepare(
            engine, tenant_id=job.tenant_id, conversation_id=job.conversation_id, policy=rules
        )

    return handle


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
        {
            tree.JOB_KIND: tree.handler(engine, config),
            CONTEXT_JOB: context_handler(engine, settings, config.embedder),
        },
        lease_seconds=settings.job_lease_seconds,
        concurrency=concurrency,
        observe=observe,
        grace=settings.worker_grace_seconds,
        retention=settings.job_retention_seconds,
    )


STOP_MARGIN = 5.0
"""Seconds a stopping worker is given beyond its grace, to give back the jobs still running."""


@asynccontextmanager
async def running(runner: Worker) -> AsyncIterator[None]:
    """Run `runner` in the background for the duration of the block; on exit let it finish
    the jobs in hand for its grace period, after which it gives them back. Should it not be
    done `STOP_MARGIN` seconds later, it is cancelled (an unfinished job's lease expires and
    another worker takes it over)."""
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield
    finally:
        stop.set()
        wait = None if runner.grace is None else runner.grace + STOP_MARGIN
        try:
            await asyncio.wait_for(task, wait)
        except TimeoutError:
            log.warning("background worker did not stop within %.0fs", wait)
