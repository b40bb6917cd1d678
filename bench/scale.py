"""Scale: one conversation of 10,000 messages, and a tenant of 100,000.

Both go through a real `memstrata serve` with its in-process background worker (serve's
default, `MEMSTRATA_WORKERS=1`), extractive summaries and the local embedder:

* **one conversation** (`single`): its messages are bulk-imported through the admin endpoint in
  batches of 1,000 (the import rate), and the time until the summary tree is complete (the job
  queue idle) is measured from the start of the import; the progress of embedding and
  summarizing is sampled for the plot;
* **a tenant** (`tenant`): more conversations of 10,000 messages are imported until the tenant
  holds the target number of messages, then the queue is given `budget` seconds to drain; if it
  has not, the result says how far it got and the rate it was going at;
* **retrieval** (`retrieval`): `memory.recall.retrieval.search` timed in this process over the one
  conversation and over every conversation of the tenant, for questions about facts planted in
  the synthetic conversations (the query embedding is timed apart);
* **size**: the database's size per stored message, and the `nodes` table's heap and indexes;
* **memory**: the gateway's resident memory after the import and at its peak.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench import harness as h
from bench import traffic
from devkit import synthetic
from devkit.gateway import GatewayProcess


@dataclass
class ScaleConfig:
    conversation_size: int = 10_000
    tenant_messages: int = 100_000
    tenant_conversation_size: int = 10_000
    # Seconds the tenant's queue gets to drain (bounded by the embedder's speed).
    budget: float = 120.0
    # Seconds the single conversation gets to be summarized.
    single_budget: float = 1200.0
    retrieval_queries: int = 200
    retrieval_seconds: float = 30.0

    @classmethod
    def quick(cls) -> ScaleConfig:
        return cls(
            conversation_size=100,
            tenant_messages=2_500,
            tenant_conversation_size=300,
            budget=5.0,
            single_budget=120.0,
            retrieval_queries=40,
            retrieval_seconds=3.0,
        )


class Progress:
    """Samples of (seconds, messages, embedded, summarized, summaries, queued, running)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.samples: list[dict[str, float]] = []
        self.started = time.perf_counter()

    async def poll(self, _waited: float, depth: dict[str, int]) -> None:
        counts = await h.node_progress(self.dsn)
        self.samples.append(
            {
                "seconds": round(time.perf_counter() - self.started, 2),
                **counts,
                "queued": depth.get("queued", 0),
                "running": depth.get("running", 0),
            }
        )


def _rate(samples: Sequence[dict[str, float]], key: str) -> float | None:
    """Per-second growth of `key` from the first sample to the one where it stopped growing."""
    if len(samples) < 2:
        return None
    top = max(sample[key] for sample in samples)
    last = next(sample for sample in samples if sample[key] == top)
    seconds = last["seconds"] - samples[0]["seconds"]
    return round((last[key] - samples[0][key]) / seconds, 1) if seconds > 0 else None


async def single(
    client: traffic.Client, stack: h.Stack, builder: GatewayProcess, config: ScaleConfig
) -> tuple[str, dict[str, Any]]:
    """Import one conversation and wait for its summary tree; its id and the figures."""
    size = config.conversation_size
    conversation_id = f"bench-{size}-0"
    messages = h.conversation(size, seed=size * 1000)
    progress = Progress(stack.dsn)
    h.log(f"scale: importing one conversation of {size} messages ...")
    imported = await h.import_conversation(client, builder.root_url, conversation_id, messages)
    h.log(f"scale: imported in {imported:.1f}s ({size / imported:.0f} msg/s); summarizing ...")
    idle, _, depth = await h.wait_idle(
        client, builder.root_url, limit=config.single_budget, poll=2.0, on_poll=progress.poll
    )
    total = time.perf_counter() - progress.started
    idle = idle and not depth.get("dead")
    h.log(f"scale: conversation summarized={idle} after {total:.1f}s ({depth})")
    return conversation_id, {
        "messages": size,
        "import_seconds": round(imported, 2),
        "import_messages_per_second": round(size / imported, 1),
        "fully_summarized": idle,
        "seconds_until_summarized": round(total, 1) if idle else None,
        "waited_seconds": round(total, 1),
        "messages_per_second_import_to_summarized": round(size / total, 1) if idle else None,
        "embedding_rate_per_second": _rate(progress.samples, "embedded"),
        "final": progress.samples[-1] if progress.samples else None,
        "depth": depth,
        "dead_job_errors": await h.dead_jobs(client, builder.root_url) if depth.get("dead") else [],
        "progress": progress.samples,
        "gateway_memory": h.process_memory(builder.pid),
    }


async def tenant(
    client: traffic.Client, stack: h.Stack, gateway: GatewayProcess, config: ScaleConfig
) -> dict[str, Any]:
    """Fill the tenant up to `tenant_messages`, give the queue `budget` seconds to drain."""
    before = await h.node_progress(stack.dsn)
    missing = max(config.tenant_messages - before["messages"], 0)
    size = config.tenant_conversation_size
    count = -(-missing // size)
    progress = Progress(stack.dsn)
    h.log(f"scale: tenant holds {before['messages']} messages; importing {count} x {size} ...")
    imported_messages = 0
    for number in range(count):
        part = min(size, missing - imported_messages)
        await h.import_conversation(
            client,
            gateway.root_url,
            f"tenant-{number}",
            h.conversation(part, seed=900_000 + number),
        )
        imported_messages += part
        await progress.poll(0, await h.job_depth(client, gateway.root_url))
    imported = time.perf_counter() - progress.started
    h.log(
        f"scale: {imported_messages} messages imported in {imported:.1f}s; "
        f"draining the queue for up to {config.budget:.0f}s ..."
    )
    idle, _, depth = await h.wait_idle(
        client, gateway.root_url, limit=config.budget, poll=5.0, on_poll=progress.poll
    )
    total = time.perf_counter() - progress.started
    idle = idle and not depth.get("dead")
    after = await h.node_progress(stack.dsn)
    embedding_rate = _rate(progress.samples, "embedded")
    unembedded = after["messages"] - after["embedded"]
    h.log(f"scale: tenant idle={idle} after {total:.1f}s; {after}")
    return {
        "messages_before": before["messages"],
        "messages_imported": imported_messages,
        "messages": after["messages"],
        "import_seconds": round(imported, 2),
        "import_messages_per_second": round(imported_messages / imported, 1)
        if imported_messages
        else None,
        "fully_summarized": idle,
        "seconds_until_summarized": round(total, 1) if idle else None,
        "waited_seconds": round(total, 1),
        "embedding_rate_per_second": embedding_rate,
        "projected_seconds_until_embedded": round(total + unembedded / embedding_rate, 0)
        if not idle and embedding_rate
        else None,
        "final": after,
        "depth": depth,
        "dead_job_errors": await h.dead_jobs(client, gateway.root_url) if depth.get("dead") else [],
        "progress": progress.samples,
        "gateway_memory": h.process_memory(gateway.pid),
    }


def _questions(count: int) -> list[str]:
    """Questions about facts planted in the synthetic conversations."""
    conversation = synthetic.generate(2_000, seed=5, with_tools=False)
    templates = {
        "ticket": "What was ticket {} about?",
        "reference": "Which booking has reference {}?",
        "flight": "When does flight {} leave?",
        "amount": "What did we spend {} on?",
        "percent": "What grows by {}?",
        "date": "What happens on {}?",
        "name": "What is {} responsible for?",
        "count": "Why {} of them?",
    }
    questions = [
        templates.get(fact.kind, "Tell me about {}").format(fact.value)
        for fact in conversation.facts
    ]
    generic = [
        "How did we decide on the migration plan?",
        "What did we say last time about the budget?",
        "Why was the kitchen renovation delayed?",
        "Which candidates are still in the hiring pipeline?",
    ]
    mixed = [q for pair in zip(questions, generic * len(questions), strict=False) for q in pair]
    return (mixed * (count // max(len(mixed), 1) + 1))[:count]


async def retrieval(stack: h.Stack, config: ScaleConfig, *, conversation_id: str) -> dict[str, Any]:
    """Time `memory.recall.retrieval.search` over one conversation and over the whole tenant."""
    try:
        from memory.recall import retrieval as retrieval_module
    except ImportError:
        return {"status": "pending: memory.recall.retrieval is not there yet"}
    search = getattr(retrieval_module, "search", None)
    if search is None:
        return {"status": "pending: memory.recall.retrieval.search is not there yet"}
    from memory.db import connect
    from memory.embeddings import LocalEmbedder

    async with h.database(stack.dsn) as db:
        tenant_id = await db.fetchval("SELECT id FROM tenants WHERE name = 'default'")
        single_id = await db.fetchval(
            "SELECT id FROM conversations WHERE tenant_id = $1 AND external_id = $2",
            tenant_id,
            conversation_id,
        )
        all_ids = [
            r[0]
            for r in await db.fetch(
                "SELECT id FROM conversations WHERE tenant_id = $1 ORDER BY id", tenant_id
            )
        ]
        stored = await db.fetchval(
            "SELECT count(*) FROM nodes WHERE tenant_id = $1 AND level = 0", tenant_id
        )
        embedded = await db.fetchval(
            "SELECT count(*) FROM nodes WHERE tenant_id = $1 AND embedding IS NOT NULL", tenant_id
        )
    questions = _questions(config.retrieval_queries)
    embedder = LocalEmbedder()
    await embedder.embed(["warm up"])
    embed_ms: list[float] = []
    vectors = []
    for question in questions:
        started = time.perf_counter()
        vectors.append((await embedder.embed([question]))[0])
        embed_ms.append((time.perf_counter() - started) * 1000)
    engine = connect(stack.database_url, pool_size=2)
    scopes: dict[str, list[int]] = {
        "conversation": [int(single_id)],
        "tenant": [int(i) for i in all_ids],
    }
    results: dict[str, Any] = {
        "status": "measured",
        "tenant_messages": int(stored),
        "tenant_nodes_embedded": int(embedded),
        "conversations_in_tenant": len(all_ids),
        "queries": len(questions),
        "query_embedding_ms": h.summarize(embed_ms),
    }
    try:
        for label, ids in scopes.items():
            latencies: list[float] = []
            hits = 0
            deadline = time.perf_counter() + config.retrieval_seconds
            async with engine.connect() as conn:
                for question, vector in zip(questions, vectors, strict=True):
                    if time.perf_counter() > deadline:
                        break
                    started = time.perf_counter()
                    found = await search(
                        conn,
                        tenant_id=int(tenant_id),
                        conversation_ids=ids,
                        query=question,
                        query_vector=vector,
                        limit=10,
                    )
                    latencies.append((time.perf_counter() - started) * 1000)
                    hits += len(found)
                    await conn.rollback()
            results[label] = {
                "conversations": len(ids),
                "search_ms": h.summarize(latencies),
                "mean_hits": round(hits / max(len(latencies), 1), 1),
            }
            h.log(f"retrieval over the {label} ({len(ids)} conversations): {results[label]}")
    finally:
        await engine.dispose()
    return results


async def database_size(stack: h.Stack) -> dict[str, Any]:
    """Bytes per stored message: the whole database and the `nodes` table."""
    async with h.database(stack.dsn) as db:
        await db.execute("VACUUM ANALYZE nodes")
        row = await db.fetchrow(
            "SELECT pg_database_size(current_database()) AS database,"
            " pg_relation_size('nodes') AS heap,"
            " pg_total_relation_size('nodes') - pg_relation_size('nodes')"
            "   - pg_indexes_size('nodes') AS toast,"
            " pg_indexes_size('nodes') AS indexes,"
            " (SELECT count(*) FROM nodes WHERE level = 0) AS messages,"
            " (SELECT count(*) FROM nodes WHERE level > 0) AS summaries"
        )
        indexes = await db.fetch(
            "SELECT indexrelid::regclass::text AS name, pg_relation_size(indexrelid) AS bytes"
            " FROM pg_index WHERE indrelid = 'nodes'::regclass ORDER BY 2 DESC"
        )
    assert row is not None
    messages = max(int(row["messages"]), 1)
    return {
        "messages": int(row["messages"]),
        "summaries": int(row["summaries"]),
        "database_bytes": int(row["database"]),
        "bytes_per_message": round(int(row["database"]) / messages),
        "nodes_heap_bytes_per_message": round(int(row["heap"]) / messages),
        "nodes_toast_bytes_per_message": round(int(row["toast"]) / messages),
        "nodes_index_bytes_per_message": round(int(row["indexes"]) / messages),
        "indexes": {r["name"]: int(r["bytes"]) for r in indexes},
    }


def config_dict(config: ScaleConfig) -> dict[str, Any]:
    return asdict(config)


async def main_async(quick: bool) -> dict[str, Any]:
    config = ScaleConfig.quick() if quick else ScaleConfig()
    with h.running_stack(h.StackConfig()) as stack:
        async with traffic.load_client(8) as client:
            builder = stack.gateway(name="scale", workers=1, worker_nice=0)
            conversation_id, one = await single(client, stack, builder, config)
            many = await tenant(client, stack, builder, config)
            builder.stop()
            found = await retrieval(stack, config, conversation_id=conversation_id)
            size = await database_size(stack)
    return {
        "benchmark": "scale",
        "machine": h.machine_info(),
        "settings": config_dict(config),
        "conversation": one,
        "tenant": many,
        "retrieval": found,
        "database": size,
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    arguments = parser.parse_args()
    h.write_results(h.RESULTS_DIR / "scale.json", asyncio.run(main_async(arguments.quick)))
