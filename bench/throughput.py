"""Background throughput: messages per second from import to a fully summarized tree.

    python -m bench.throughput --messages 10000 [--runs 1x1,2x4] [--max-length 256] [--profile]
                               [--embedder local|instant|upstream]

Starts its own embedded Postgres (pgvector) in a temporary folder, `durable=False` (fsync,
synchronous_commit and full_page_writes off, as in the test suite; `--durable` for the real
thing), and for each run (`CONCURRENCYxCONVERSATIONS`) makes a fresh database, migrates it,
imports `--messages` synthetic messages (`devkit/synthetic.py`, split evenly over the
conversations) with `gateway.importer.import_messages` -- which also queues the build jobs --
and then runs the queued tree jobs through a `memory.build.worker.Worker` with that concurrency
until the queue is idle, extractive summaries. Import and processing are timed separately; the
headline is `messages / (import + processing)`.

Embeddings (`--embedder`): `local`, the default deployment (all-MiniLM-L6-v2 int8 ONNX on this
machine's CPU); `upstream`, the deployment with `MEMSTRATA_EMBEDDING_PROVIDER=upstream`, built
by `gateway.background.embedder` from `Settings` exactly as the gateway builds it, against the
fake OpenAI server process (`devkit/upstream_server.py`: deterministic vectors, over real HTTP on
127.0.0.1) -- a real provider's latency and model time are off this machine and not in the
figure, the fake server's CPU is reported apart; `instant`, free in-process vectors, to measure
everything but the model.

Phases are instrumented by wrapping, not by sampling: the embedder and the summarizer are
wrapped (time spent in `embed` and in `summarize`, per level), and so are the builder's three
steps (`_segment`, which embeds the new messages, `_roll_up`, `_embed_pending`) and
`segments.split`; what a step spends outside its embedder / summarizer / split calls is
database work and Python glue. Times are
summed over concurrent jobs, so with concurrency > 1 they add up to more than the wall time.

Results are printed and written to `bench/results/throughput.json`: a local-model run is the
file's main figure; a run with another embedder is filed under `other_embedders` beside it, and
each kind of run keeps the others'.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import cProfile
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
from sqlalchemy import func, insert, select

from devkit import synthetic
from devkit.postgres import fresh_database, throwaway_postgres
from devkit.upstream import UpstreamServer
from gateway import background, importer
from gateway.settings import Settings
from memory import tokens
from memory.build import segments, tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer, Summary, SummaryInput
from memory.build.worker import Worker
from memory.db import connect, migrate
from memory.embeddings import EMBEDDING_DIM, Embedder, LocalEmbedder
from memory.schema import jobs, nodes, tenants

RESULTS = Path(__file__).resolve().parent / "results" / "throughput.json"
TARGET = 500.0  # messages per second, import to fully summarized


class Timers:
    """Seconds and calls per label, summed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.items: dict[str, int] = defaultdict(int)

    def add(self, label: str, seconds: float, items: int = 0) -> None:
        self.seconds[label] += seconds
        self.calls[label] += 1
        self.items[label] += items

    def report(self) -> dict[str, dict[str, float]]:
        return {
            label: {
                "seconds": round(self.seconds[label], 3),
                "calls": self.calls[label],
                **({"items": self.items[label]} if self.items[label] else {}),
            }
            for label in sorted(self.seconds)
        }


# What is being embedded: a build embeds its new messages in its segment step, then (in its
# last step, `_embed_pending`) the summaries that got no centroid of their children's vectors.
EMBEDDING: contextvars.ContextVar[str] = contextvars.ContextVar("embedding", default="messages")


class InstantEmbedder:
    """Unit vectors drawn from a hash of the text, at no cost: `--embedder instant` measures
    what the pipeline costs besides the model (segments then close where random vectors
    say, so level counts differ a little from the real model's)."""

    name = "instant (hash-seeded random unit vectors)"
    dim = EMBEDDING_DIM

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        vectors = []
        for text in texts:
            seed = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
            vector = np.random.default_rng(seed).standard_normal(self.dim)
            vectors.append((vector / np.linalg.norm(vector)).tolist())
        return vectors


class TimedEmbedder:
    def __init__(self, inner: Embedder, timers: Timers) -> None:
        self.inner = inner
        self.name = inner.name
        self.dim = inner.dim
        self.timers = timers

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        started = time.perf_counter()
        try:
            return await self.inner.embed(texts)
        finally:
            seconds = time.perf_counter() - started
            self.timers.add("embed", seconds, len(texts))
            self.timers.add(f"embed {EMBEDDING.get()}", seconds, len(texts))


class TimedSummarizer:
    def __init__(self, inner: ExtractiveSummarizer, timers: Timers) -> None:
        self.inner = inner
        self.timers = timers

    async def summarize(
        self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
    ) -> Summary:
        started = time.perf_counter()
        try:
            return await self.inner.summarize(items, level=level, target_tokens=target_tokens)
        finally:
            label = "summarize level 1" if level == 1 else "summarize level 2+"
            self.timers.add(label, time.perf_counter() - started, len(items))


@contextlib.contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """Time the builder's steps and `split` by wrapping them in `memory.build.tree`."""
    originals: dict[str, Any] = {}

    def wrap_async(name: str, label: str) -> None:
        original: Callable[..., Awaitable[int]] = getattr(tree, name)
        originals[name] = original

        async def timed(*args: Any, **kwargs: Any) -> int:
            started = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                timers.add(label, time.perf_counter() - started)

        setattr(tree, name, timed)

    split = segments.split
    originals["split"] = split

    def timed_split(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return split(*args, **kwargs)
        finally:
            timers.add("split", time.perf_counter() - started)

    # `tree` calls the `split` it imported: replace that name.
    setattr(tree, "split", timed_split)  # noqa: B010
    wrap_async("_embed_pending", "step embed_pending")
    embed_pending = tree._embed_pending

    async def labelled(*args: Any, **kwargs: Any) -> int:
        token = EMBEDDING.set("summaries")
        try:
            return await embed_pending(*args, **kwargs)
        finally:
            EMBEDDING.reset(token)

    tree._embed_pending = labelled
    wrap_async("_segment", "step segment")
    wrap_async("_roll_up", "step roll_up")
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(tree, name, original)


@dataclass(frozen=True)
class Run:
    concurrency: int
    conversations: int

    @property
    def label(self) -> str:
        return f"{self.concurrency}x{self.conversations}"


def parse_runs(text: str) -> list[Run]:
    runs = []
    for part in text.split(","):
        concurrency, _, conversations = part.strip().partition("x")
        runs.append(Run(int(concurrency), int(conversations or 1)))
    return runs


def postgres_cpu_seconds(pgdata: Path) -> float:
    """User + system CPU seconds of the postmaster and its live children (the backends)."""
    try:
        postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command (which may hold spaces) start at ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        pid, ppid = int(entry.name), int(fields[1])
        if pid == postmaster or ppid == postmaster:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(
    server_url: str,
    run: Run,
    *,
    pgdata: Path,
    conversation: synthetic.Conversation,
    embedder: Embedder,
    import_batch: int,
    profile: bool,
    provider_pid: int | None = None,
) -> dict[str, Any]:
    """One run; `provider_pid`: the fake embeddings provider, whose CPU is reported apart."""
    url = await fresh_database(server_url, f"bench_{run.label}")
    engine = connect(url, pool_size=max(4, run.concurrency * 2))
    timers = Timers()
    try:
        await migrate(engine)
        async with engine.begin() as conn:
            tenant = await conn.scalar(
                insert(tenants).values(name=f"bench-{run.label}").returning(tenants.c.id)
            )
        assert tenant is not None
        total = len(conversation.messages)
        share = -(-total // run.conversations)

        started = time.perf_counter()
        for number in range(run.conversations):
            part = slice(number * share, min((number + 1) * share, total))
            await importer.import_messages(
                engine,
                tenant_id=int(tenant),
                external_id=f"bench-{number}",
                messages=conversation.messages[part],
                created_at=conversation.created_at[part],
                model="gpt-4o",
                batch=import_batch,
            )
        import_seconds = time.perf_counter() - started

        config = tree.TreeConfig(
            embedder=TimedEmbedder(embedder, timers),
            summarizer=TimedSummarizer(ExtractiveSummarizer("gpt-4o"), timers),
            policy=SegmentPolicy(),
        )
        worker = Worker(
            engine,
            {tree.JOB_KIND: tree.handler(engine, config)},
            concurrency=run.concurrency,
            listen=False,
        )
        profiler = cProfile.Profile() if profile else None
        load_before = os.getloadavg()
        cpu_before, pg_before = time.process_time(), postgres_cpu_seconds(pgdata)
        provider_before = process_cpu_seconds(provider_pid) if provider_pid else 0.0
        started = time.perf_counter()
        with instrumented(timers):
            if profiler is not None:
                profiler.enable()
            jobs_run = await worker.run_until_idle()
            if profiler is not None:
                profiler.disable()
        process_seconds = time.perf_counter() - started
        python_cpu = time.process_time() - cpu_before
        postgres_cpu = postgres_cpu_seconds(pgdata) - pg_before
        provider_cpu = process_cpu_seconds(provider_pid) - provider_before if provider_pid else None
        load_after = os.getloadavg()

        async with engine.connect() as conn:
            levels: dict[int, int] = dict(
                (
                    await conn.execute(
                        select(nodes.c.level, func.count())
                        .where(nodes.c.tenant_id == tenant)
                        .group_by(nodes.c.level)
                        .order_by(nodes.c.level)
                    )
                ).all()
            )
            unembedded = await conn.scalar(
                select(func.count()).where(nodes.c.tenant_id == tenant, nodes.c.embedding.is_(None))
            )
            statuses: dict[str, int] = dict(
                (
                    await conn.execute(
                        select(jobs.c.status, func.count())
                        .where(jobs.c.tenant_id == tenant)
                        .group_by(jobs.c.status)
                    )
                ).all()
            )
    finally:
        await engine.dispose()

    result: dict[str, Any] = {
        "run": run.label,
        "concurrency": run.concurrency,
        "conversations": run.conversations,
        "jobs_run": jobs_run,
        "job_statuses": statuses,
        "levels": {str(level): count for level, count in levels.items()},
        "unembedded_after": unembedded,
        "import_seconds": round(import_seconds, 3),
        "process_seconds": round(process_seconds, 3),
        "import_messages_per_second": round(total / import_seconds, 1),
        "process_messages_per_second": round(total / process_seconds, 1),
        "messages_per_second": round(total / (import_seconds + process_seconds), 1),
        "cpu_seconds_during_processing": {
            "python (event loop + embedding threads)": round(python_cpu, 1),
            "postgres (all backends)": round(postgres_cpu, 1),
            **(
                {"fake embeddings provider (not in the estimate)": round(provider_cpu, 1)}
                if provider_cpu is not None
                else {}
            ),
        },
        # What the processing would take on this many otherwise idle cores, if CPU-bound:
        # a contention-independent estimate (the box is shared; wall times depend on load).
        "cpu_bound_estimate_messages_per_second": round(
            total / max((python_cpu + postgres_cpu) / (os.cpu_count() or 1), 1e-9), 1
        ),
        "load_average_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "phases": timers.report(),
        "phase_split": phase_split(timers, process_seconds),
    }
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        result["profile_top_tottime"] = out.getvalue().splitlines()
    return result


def phase_split(timers: Timers, wall: float) -> dict[str, float]:
    """Seconds per phase: embedding, segmentation + level-1 summaries, roll-ups, the rest."""
    s = timers.seconds
    embed_step = s["step embed_pending"]
    segment_step = s["step segment"]
    rollup_step = s["step roll_up"]
    return {
        "embedding (model)": round(s["embed"], 3),
        "  of which messages": round(s["embed messages"], 3),
        "  of which summaries": round(s["embed summaries"], 3),
        "segmentation (split)": round(s["split"], 3),
        "level-1 summaries (extractive)": round(s["summarize level 1"], 3),
        "segment step, DB and glue": round(
            segment_step - s["embed messages"] - s["split"] - s["summarize level 1"], 3
        ),
        "roll-up summaries (extractive)": round(s["summarize level 2+"], 3),
        "roll-up step, DB and glue": round(rollup_step - s["summarize level 2+"], 3),
        "last embedding step, DB and glue": round(embed_step - s["embed summaries"], 3),
        # Meaningful with concurrency 1 only (with more, step times overlap).
        "outside the steps (claims, job bookkeeping)": round(
            max(wall - embed_step - segment_step - rollup_step, 0.0), 3
        ),
    }


def machine() -> dict[str, Any]:
    versions = {}
    for package in ("onnxruntime", "tokenizers", "numpy", "sqlalchemy", "asyncpg", "tiktoken"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "versions": versions,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    conversation = synthetic.generate(args.messages, seed=args.seed, with_tools=True)
    texts = [tokens.message_text(m) for m in conversation.messages]
    stack = contextlib.AsyncExitStack()
    embedder: Embedder
    provider_pid: int | None = None
    if args.embedder == "local":
        local = LocalEmbedder(max_length=args.max_length)
        await local.warmup()
        embedder = local
    elif args.embedder == "upstream":
        fake = stack.enter_context(UpstreamServer())
        provider_pid = fake.pid
        settings = Settings(
            embedding_provider="upstream", upstream_base_url=fake.url, upstream_api_key="bench"
        )
        provider = background.provider(settings)
        stack.push_async_callback(provider.aclose)
        embedder = background.embedder(settings, provider)
    else:
        embedder = InstantEmbedder()
    await embedder.embed(["warm up the session"] * 8)
    started = time.perf_counter()
    try:
        server = await asyncio.to_thread(
            stack.enter_context,
            throwaway_postgres(prefix="memstrata-bench-", durable=args.durable),
        )
        results = []
        for run in parse_runs(args.runs):
            print(
                f"run {run.label}: concurrency {run.concurrency}, "
                f"{run.conversations} conversation(s) ...",
                file=sys.stderr,
                flush=True,
            )
            result = await one_run(
                server.url,
                run,
                pgdata=server.pgdata,
                conversation=conversation,
                embedder=embedder,
                import_batch=args.import_batch,
                profile=args.profile,
                provider_pid=provider_pid,
            )
            print(
                json.dumps(
                    {k: v for k, v in result.items() if k != "profile_top_tottime"}, indent=1
                ),
                file=sys.stderr,
                flush=True,
            )
            results.append(result)
        server_version = await server_version_of(server.url)
    finally:
        await stack.aclose()
    return {
        "benchmark": "throughput",
        "target_messages_per_second": TARGET,
        "machine": machine(),
        "postgres": server_version,
        "settings": {
            "messages": args.messages,
            "seed": args.seed,
            "summary_mode": "extractive",
            "embedder": {
                "local": f"local {embedder.name}, max_length {args.max_length}",
                "upstream": (
                    f"upstream {embedder.name} (MEMSTRATA_EMBEDDING_PROVIDER=upstream) against "
                    "the fake OpenAI server process over HTTP on 127.0.0.1: the provider's own "
                    "latency and model time are not in this figure"
                ),
                "instant": embedder.name,
            }[args.embedder],
            "summary_vectors": "unit centroid of the children's vectors (no model call)",
            "segment_policy": "default (shift 0.30, token cap 2048, max 64 messages)",
            "fanout": 8,
            "import_batch": args.import_batch,
            "durable": args.durable,
            "mean_message_chars": round(sum(map(len, texts)) / max(len(texts), 1), 1),
            "mean_message_tokens": round(
                sum(tokens.count_text(t, model="gpt-4o") for t in texts) / max(len(texts), 1), 1
            ),
        },
        "runs": results,
        "total_seconds": round(time.perf_counter() - started, 1),
    }


async def server_version_of(url: str) -> str:
    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return str(await connection.fetchval("SELECT version()"))
    finally:
        await connection.close()


def save(report: dict[str, Any], path: Path, *, embedder: str) -> None:
    """Write `report` to `path`: at the top for the local model, else under `other_embedders`."""
    previous = json.loads(path.read_text()) if path.exists() else {}
    others = previous.get("other_embedders", {})
    if embedder == "local":
        saved = {**report, "other_embedders": others}
    else:
        saved = {**previous, "other_embedders": {**others, embedder: report}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--runs",
        default="1x1,1x4,2x4",
        help="comma-separated CONCURRENCYxCONVERSATIONS (default: 1x1,1x4,2x4)",
    )
    parser.add_argument("--max-length", type=int, default=256, help="embedder token truncation")
    parser.add_argument(
        "--embedder",
        choices=("local", "upstream", "instant"),
        default="local",
        help="local MiniLM; upstream: the provider's /embeddings (here the fake OpenAI server "
        "over HTTP); instant: free vectors, to measure everything but the model",
    )
    parser.add_argument("--import-batch", type=int, default=1000)
    parser.add_argument("--durable", action="store_true", help="fsync on (default: off)")
    parser.add_argument("--profile", action="store_true", help="cProfile the processing")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = asyncio.run(main_async(args))
    save(report, args.output, embedder=args.embedder)
    for run in report["runs"]:
        print(
            f"{run['run']:>5}: import {run['import_messages_per_second']:>7.1f} msg/s, "
            f"processing {run['process_messages_per_second']:>7.1f} msg/s, "
            f"import→summarized {run['messages_per_second']:>7.1f} msg/s "
            f"(target {TARGET:.0f}; CPU-bound estimate "
            f"{run['cpu_bound_estimate_messages_per_second']:.1f} msg/s; "
            f"load {run['load_average_before_after']})"
        )
    print(f"written to {args.output}")


if __name__ == "__main__":
    main()
