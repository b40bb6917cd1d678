"""Sustained throughput: requests per second through one `memstrata serve` at concurrency 64.

Each of the 64 virtual clients holds short conversations the way an unmodified OpenAI SDK does:
it resends the whole history (a system prompt, then user and assistant turns) with a new user
message, without `X-Memstrata-Conversation`, so the gateway finds the conversation by its hash
chain; after `turns` requests it starts a new conversation (its first question is unique, so no
two clients share one). Non-stream. The same scripts run for `duration` seconds against the
gateway and, for reference, for a shorter time against the upstream directly and the relay
floor -- the ceiling of this load generator and upstream on this machine, which share its cores
with the gateway and Postgres.

Recorded: completed requests per second (overall and per second of the run, for the plot),
errors (the target is zero), latency percentiles, the gateway's CPU time per request and its
memory before and after. The gateway runs on a database of its own, with its background workers
off during the run (`MEMSTRATA_WORKERS=0`; what the requests queue is left for `memstrata
worker` processes), and once more with the in-process worker on, as `serve` runs by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import harness as h
from bench import traffic
from devkit.postgres import fresh_database
from devkit.service import Service

TOPICS = (
    "plan a weekend trip to Lisbon in May with a budget of $1,200",
    "migrate the orders table to Postgres 17 without downtime",
    "organise a birthday party for 14 guests on a Saturday",
    "triage the login bug INV-2041 that started after the release",
    "split the Q3 marketing budget between events and ads",
    "hire a senior data engineer before the end of the quarter",
    "renovate the kitchen without moving the plumbing",
)
FOLLOW_UPS = (
    "Good. What should I do first?",
    "What could go wrong, and how do I avoid it?",
    "Can you make that shorter, as a checklist?",
    "How long will all of that take?",
    "Thanks. Anything I forgot?",
)


@dataclass
class LoadConfig:
    concurrency: int = 64
    duration: float = 60.0
    reference_duration: float = 20.0
    turns: int = 5
    workers_variant_duration: float = 30.0

    @classmethod
    def quick(cls) -> LoadConfig:
        return cls(duration=6.0, reference_duration=2.0, workers_variant_duration=0.0)


class Scripts:
    """The conversations of every virtual client: the next request, and the reply it got."""

    def __init__(self, url: str, *, concurrency: int, turns: int, tag: str) -> None:
        self.url = url
        self.turns = turns
        self.tag = tag
        self.histories: list[list[dict[str, Any]]] = [[] for _ in range(concurrency)]
        self.started = [0] * concurrency
        self.conversations = 0

    def next_call(self, index: int, worker: int) -> traffic.Call:
        history = self.histories[worker]
        if not history or len(history) >= 1 + 2 * self.turns:
            self.conversations += 1
            topic = TOPICS[self.conversations % len(TOPICS)]
            history[:] = [
                {"role": "system", "content": h.SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": f"Help me {topic}. (client {worker}, conversation "
                    f"{self.tag}-{self.conversations})",
                },
            ]
        else:
            history.append({"role": "user", "content": FOLLOW_UPS[index % len(FOLLOW_UPS)]})
        body = h.encode({"model": h.MODEL, "messages": history})
        return traffic.Call(
            url=f"{self.url}/chat/completions", body=body, headers=h.json_headers(), keep_body=True
        )

    def observe(self, worker: int, sample: traffic.Sample) -> None:
        history = self.histories[worker]
        reply: dict[str, Any] | None = None
        if sample.ok and sample.body:
            try:
                reply = json.loads(sample.body)["choices"][0]["message"]
            except (ValueError, KeyError, IndexError, TypeError):
                reply = None
        if reply is None:
            history.clear()  # start over: a failed turn breaks the chain
            return
        history.append({"role": "assistant", "content": reply.get("content") or ""})


def per_second(samples: Sequence[traffic.Sample], duration: float) -> list[int]:
    """Requests completed in each second of the run."""
    buckets = [0] * (int(duration) + 1)
    for sample in samples:
        second = int(sample.started + sample.latency)
        if 0 <= second < len(buckets):
            buckets[second] += 1
    return buckets


async def run_target(
    client: traffic.Client,
    name: str,
    url: str,
    config: LoadConfig,
    *,
    duration: float,
    service: Service | None = None,
    stack: h.Stack | None = None,
) -> dict[str, Any]:
    scripts = Scripts(url, concurrency=config.concurrency, turns=config.turns, tag=name)
    # Warm-up: open the connections, load what loads lazily.
    await traffic.run_load(
        client,
        scripts.next_call,
        concurrency=config.concurrency,
        count=config.concurrency * 2,
        duration=min(duration / 2, 20.0),
        observe=scripts.observe,
    )
    memory_before = h.process_memory(service.pid) if service else None
    cpu_before = h.process_cpu_seconds(service.pid) if service else None
    postgres_before = stack.postgres_cpu_seconds() if stack else None
    started = time.perf_counter()
    samples = await traffic.run_load(
        client,
        scripts.next_call,
        concurrency=config.concurrency,
        duration=duration,
        observe=scripts.observe,
    )
    wall = time.perf_counter() - started
    good = sum(1 for s in samples if s.ok)
    result: dict[str, Any] = {
        "target": name,
        "seconds": round(wall, 2),
        "requests": len(samples),
        "ok": good,
        "errors": len(samples) - good,
        "requests_per_second": round(good / wall, 1),
        "conversations_started": scripts.conversations,
        **traffic.latency_figures(samples),
        "per_second": per_second(samples, wall),
    }
    if service is not None:
        cpu_after = h.process_cpu_seconds(service.pid)
        if cpu_before is not None and cpu_after is not None:
            used = cpu_after - cpu_before
            result["cpu_ms_per_request"] = round(used * 1000 / max(len(samples), 1), 2)
            result["cpu_cores_busy"] = round(used / wall, 2)
        result["memory_before"] = memory_before
        result["memory_after"] = h.process_memory(service.pid)
    postgres_after = stack.postgres_cpu_seconds() if stack else None
    if postgres_before is not None and postgres_after is not None:
        used = postgres_after - postgres_before
        result["postgres_cpu_ms_per_request"] = round(used * 1000 / max(len(samples), 1), 2)
        result["postgres_cpu_cores_busy"] = round(used / wall, 2)
    h.log(
        f"load {name}: {result['requests_per_second']} req/s over {wall:.0f}s, "
        f"{result['errors']} errors, p50 {result['latency_ms']['p50']} ms, "
        f"p99 {result['latency_ms']['p99']} ms"
    )
    return result


async def _gateway_target(
    client: traffic.Client, stack: h.Stack, config: LoadConfig, *, workers: int
) -> dict[str, Any]:
    """One `serve` process on a database of its own, with or without its in-process worker."""
    suffix = "" if workers == 0 else "_workers"
    url = await fresh_database(stack.database_url, f"bench_load{suffix}")
    gateway = stack.gateway(
        name=f"load{suffix.replace('_', '-')}", database_url=url, workers=workers
    )
    try:
        result = await run_target(
            client,
            "gateway" if workers == 0 else "gateway (in-process worker)",
            f"{gateway.root_url}/v1",
            config,
            duration=config.duration if workers == 0 else config.workers_variant_duration,
            service=gateway,
            stack=stack,
        )
    finally:
        gateway.stop()
    result["settings"] = (
        "MEMSTRATA_WORKERS=0" if workers == 0 else "MEMSTRATA_WORKERS=1 (serve's default)"
    )
    return result


async def run(client: traffic.Client, stack: h.Stack, config: LoadConfig) -> dict[str, Any]:
    """Reference runs (upstream, relay), then the gateway (workers off, then on)."""
    targets: list[dict[str, Any]] = []
    targets.append(
        await run_target(
            client, "upstream", stack.upstream.url, config, duration=config.reference_duration
        )
    )
    targets.append(
        await run_target(
            client,
            "relay",
            f"{stack.relay_url}/v1",
            config,
            duration=config.reference_duration,
            service=stack.relay,
        )
    )
    targets.append(await _gateway_target(client, stack, config, workers=0))
    if config.workers_variant_duration > 0:
        targets.append(await _gateway_target(client, stack, config, workers=1))
    return {"config": asdict(config), "targets": targets}


def headline(result: Mapping[str, Any]) -> dict[str, Any] | None:
    for target in result["targets"]:
        if target["target"] == "gateway":
            return dict(target)
    return None


async def standalone(args: argparse.Namespace) -> dict[str, Any]:
    config = LoadConfig.quick() if args.quick else LoadConfig()
    with h.running_stack(h.StackConfig(upstream_latency=args.latency)) as stack:
        async with traffic.load_client(config.concurrency) as client:
            result = await run(client, stack, config)
    return {
        "benchmark": "load",
        "machine": h.machine_info(),
        "settings": {"upstream_latency_s": args.latency},
        **result,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency", type=float, default=0.005, help="upstream latency (s)")
    parser.add_argument("--output", type=Path, default=h.RESULTS_DIR / "load.json")
    args = parser.parse_args()
    h.write_results(args.output, asyncio.run(standalone(args)))


if __name__ == "__main__":
    main()
