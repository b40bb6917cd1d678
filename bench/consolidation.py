"""The background cost of the concept graph: one conversation built with and without it.

    python -m bench.consolidation [--messages 10000] [--output FILE]

Starts a throw-away embedded Postgres, imports the same synthetic conversation
(`bench.harness.conversation`, the one `bench.scale` uses) twice, into two tenants, and builds
each one's summary tree as the background worker does (`memory.build.tree.build`, extractive
summaries, the local embedder, `final=True`): once with `MEMSTRATA_GRAPH=off`, once with the
graph consolidated at every closed segment (offline extraction). The first build pays for
warming the embedder up; the order is off first, so any warm-up is charged to the build
without the graph.

Reported per build: wall seconds, this process's CPU seconds, Postgres's CPU seconds (the
server and its backends, from `psutil`) and, with the graph, the wall and CPU seconds spent
inside `memory.build.graph.prepare` (extraction, embedding new concept names) and
`consolidate` (merging, edges, mentions: SQL); then the graph's cost per 10,000 messages and
the build's throughput (messages per second) with and without it. Results go to
`bench/results/consolidation.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psutil
from sqlalchemy import insert, text

from bench import harness as h
from devkit.postgres import throwaway_postgres
from gateway import importer
from memory.build import graph, tree
from memory.build.summarize import ExtractiveSummarizer
from memory.db import connect, migrate
from memory.embeddings import LocalEmbedder
from memory.postgres import EmbeddedPostgres
from memory.schema import tenants

RESULTS = h.RESULTS_DIR / "consolidation.json"
T = TypeVar("T")


def _postgres_cpu(server: EmbeddedPostgres) -> float:
    """CPU seconds of the Postgres server and every backend it runs."""
    pid = int((server.pgdata / "postmaster.pid").read_text().split()[0])
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class Stopwatch:
    """Wall and CPU seconds spent inside the wrapped coroutine functions."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def wrap(self, name: str, function: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(function)
        async def timed(*args: Any, **kwargs: Any) -> T:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return await function(*args, **kwargs)
            finally:
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
                self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu

        return timed


async def _build(
    server: EmbeddedPostgres, messages: list[dict[str, Any]], *, with_graph: bool
) -> dict[str, Any]:
    engine = connect(server.url, pool_size=4)
    try:
        await migrate(engine)
        async with engine.begin() as conn:
            tenant_id = await conn.scalar(
                insert(tenants)
                .values(name=f"consolidation-{'on' if with_graph else 'off'}")
                .returning(tenants.c.id)
            )
        assert tenant_id is not None
        await importer.import_messages(
            engine,
            tenant_id=tenant_id,
            external_id="consolidation",
            messages=[{k: v for k, v in m.items() if k != "created_at"} for m in messages],
            created_at=[datetime.fromisoformat(m["created_at"]) for m in messages],
            model="gpt-4o",
            batch=1000,
        )
        async with engine.connect() as conn:
            conversation_id = int(
                await conn.scalar(
                    text("SELECT id FROM conversations WHERE tenant_id = :t"), {"t": tenant_id}
                )
            )
        embedder = LocalEmbedder()
        await embedder.warmup()
        config = tree.TreeConfig(
            embedder=embedder,
            summarizer=ExtractiveSummarizer(),
            graph=graph.GraphConfig(embedder=embedder) if with_graph else None,
        )
        watch = Stopwatch()
        prepare, consolidate = graph.prepare, graph.consolidate
        graph.prepare = watch.wrap("prepare", prepare)  # type: ignore[assignment]
        graph.consolidate = watch.wrap("consolidate", consolidate)  # type: ignore[assignment]
        try:
            database_cpu = _postgres_cpu(server)
            wall, cpu = time.perf_counter(), time.process_time()
            progress = await tree.build(
                engine,
                tenant_id=tenant_id,
                conversation_id=conversation_id,
                config=config,
                final=True,
            )
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            database_cpu = _postgres_cpu(server) - database_cpu
        finally:
            graph.prepare, graph.consolidate = prepare, consolidate  # type: ignore[assignment]
        async with engine.connect() as conn:
            counts = (
                await conn.execute(
                    text(
                        "SELECT (SELECT count(*) FROM concepts WHERE tenant_id = :t),"
                        " (SELECT count(*) FROM concept_edges WHERE tenant_id = :t),"
                        " (SELECT count(*) FROM concept_mentions WHERE tenant_id = :t)"
                    ),
                    {"t": tenant_id},
                )
            ).one()
    finally:
        await engine.dispose()
    return {
        "graph": with_graph,
        "segments": progress.segments,
        "wall_seconds": round(wall, 2),
        "process_cpu_seconds": round(cpu, 2),
        "postgres_cpu_seconds": round(database_cpu, 2),
        "messages_per_second": round(len(messages) / wall, 1),
        "inside": {
            name: {"wall": round(watch.wall[name], 2), "cpu": round(watch.cpu[name], 2)}
            for name in watch.wall
        },
        "concepts": int(counts[0]),
        "edges": int(counts[1]),
        "mentions": int(counts[2]),
    }


async def main_async(size: int) -> dict[str, Any]:
    messages = h.conversation(size, seed=size * 1000)
    with throwaway_postgres(prefix="memstrata-consolidation-") as server:
        without = await _build(server, messages, with_graph=False)
        h.log(f"consolidation: without the graph {without}")
        with_graph = await _build(server, messages, with_graph=True)
        h.log(f"consolidation: with the graph {with_graph}")
    inside = with_graph["inside"]
    graph_wall = sum(part["wall"] for part in inside.values())
    graph_cpu = sum(part["cpu"] for part in inside.values())
    per = 10_000 / size
    return {
        "benchmark": "consolidation",
        "machine": h.machine_info(),
        "messages": size,
        "without_graph": without,
        "with_graph": with_graph,
        "graph_per_10000_messages": {
            "wall_seconds_inside": round(graph_wall * per, 1),
            "process_cpu_seconds_inside": round(graph_cpu * per, 1),
            "build_wall_seconds_added": round(
                (with_graph["wall_seconds"] - without["wall_seconds"]) * per, 1
            ),
            "postgres_cpu_seconds_added": round(
                (with_graph["postgres_cpu_seconds"] - without["postgres_cpu_seconds"]) * per, 1
            ),
        },
        "throughput_ratio": round(
            with_graph["messages_per_second"] / without["messages_per_second"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--output", type=Path, default=RESULTS)
    arguments = parser.parse_args()
    h.write_results(arguments.output, asyncio.run(main_async(arguments.messages)))


if __name__ == "__main__":
    main()
