"""What the concept graph's leg costs on the read path: LoCoMo's relational questions.

    python -m bench.graph_leg --data-dir DIR [--data ../shared/data/locomo10.json] [--budget 4000]

Uses the database a `bench.locomo --data-dir DIR` run kept (replayed and graphed: every
conversation's graph is backfilled first if it has none). For each question the router calls
relational, the gateway's dry run at `--budget` is timed with the graph leg off (the default)
and on (`MEMSTRATA_GRAPH_RECALL=on`), in alternating order so that both see the same load, and
the leg alone (`memory.recall.graph.leg`: scopes, seeds, the walk, the mentions) is timed
apart. Prints p50/p95 in ms, the load average and the graph's size; nothing is written.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from bench import evidence
from bench.locomo import DATA, load
from devkit.stats import percentile
from gateway.openai import chat
from memory.embeddings import LocalEmbedder
from memory.recall import graph, retrieval
from memory.recall.query import Route


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": round(percentile(values, 50) or 0.0, 1),
        "p95": round(percentile(values, 95) or 0.0, 1),
    }


async def main_async(data: Path, data_dir: Path, budget: int) -> dict[str, Any]:
    samples = load(data, None, None)
    embedder = LocalEmbedder()
    await embedder.warmup()
    timed: dict[str, list[float]] = {"without": [], "with": [], "leg": []}
    async with evidence.database(prefix="memstrata-graph-", tenant="locomo", folder=data_dir) as (
        engine,
        tenant,
    ):
        states = evidence.states(engine, embedder, tenant)
        asked = 0
        for sample in samples:
            await evidence.replay(engine, tenant, sample, embedder)
            for question in sample.questions:
                if retrieval.route(question.question) is not Route.RELATIONAL:
                    continue
                asked += 1
                order = [("without", states.plain), ("with", states.graph)]
                for name, state in order if asked % 2 else order[::-1]:
                    started = time.perf_counter()
                    await chat.dry_run(
                        state,
                        tenant_id=tenant,
                        external_id=sample.external_id,
                        query=question.question,
                        budget=budget,
                        model=evidence.MODEL,
                    )
                    timed[name].append((time.perf_counter() - started) * 1000)
                [vector] = await embedder.embed([question.question])
                async with engine.connect() as conn:
                    started = time.perf_counter()
                    await graph.leg(
                        conn,
                        tenant_id=tenant,
                        conversation_ids=[sample.conversation_id],
                        query=question.question,
                        query_vector=vector,
                        which=Route.RELATIONAL,
                        limit=400,
                        levels=[0],
                    )
                    timed["leg"].append((time.perf_counter() - started) * 1000)
        async with engine.connect() as conn:
            size = {
                table: int(await conn.scalar(text(f"SELECT count(*) FROM {table}")) or 0)
                for table in ("concepts", "concept_edges", "concept_mentions")
            }
    return {
        "load_average": [round(value, 1) for value in os.getloadavg()],
        "budget": budget,
        "dry_run_without_graph_ms": _summary(timed["without"]),
        "dry_run_with_graph_ms": _summary(timed["with"]),
        "graph_leg_ms": _summary(timed["leg"]),
        "graph": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--budget", type=int, default=4000)
    arguments = parser.parse_args()
    result = asyncio.run(main_async(arguments.data, arguments.data_dir, arguments.budget))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
