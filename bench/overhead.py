"""Latency the gateway adds: the same requests sent to the upstream, the relay floor and memstrata.

For each stored-conversation size (10, 1,000 and 10,000 messages by default), each mode
(non-stream: whole answer; stream: time to the first event) and each concurrency (1 and 32), the
identical sequence of requests -- a system prompt and one new user message, with
`X-Memstrata-Conversation` naming a pre-stored conversation -- is sent to

* `upstream`: the fake OpenAI server directly (the baseline),
* `relay`: the minimal pass-through relay (`bench.relay`, the practical floor),
* `gateway`: `memstrata serve` (extractive summaries, log level warning).

The three targets are measured back to back in rounds whose order rotates, so that drift of the
machine affects them alike; "added" latency is a target's percentile minus the upstream's.
Conversations are imported first through the admin bulk import endpoint and the summary tree is
built before measuring (the job queue is idle). Every request stores two messages (the question
and the answer), so a conversation grows while it is measured: the results say how many
messages each pool held before and after its cell. At concurrency 32 the requests are spread
over a pool of conversations of the same size (32 of size 10, fewer of the big sizes, which
take long to summarize): requests on one conversation are serialized by its row lock, by design.

Run alone: `python -m bench.overhead [--quick]` (prepares its own data); `python -m bench` runs
it with the other scenarios and writes the report.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import harness as h
from devkit.gateway import GatewayProcess

TARGETS = ("upstream", "relay", "gateway")
QUESTIONS = (
    "What did we decide about the maintenance window, and who owns the rollback plan?",
    "Remind me which flight we booked for the conference and the booking reference.",
    "How much was the renovation budget again, and what was the contractor's name?",
    "Which ticket was the login bug filed under, and is it fixed yet?",
    "What percentage of the budget goes to cloud hosting this quarter?",
    "Who did we pick for the final interview, and when is it scheduled?",
    "Can you summarize where we are with the database migration?",
    "What was the date of the birthday party and how many guests are coming?",
)


@dataclass
class OverheadConfig:
    """Sizes, pools, request counts; `quick()` is the small version."""

    sizes: tuple[int, ...] = (10, 1_000, 10_000)
    # Conversations per size (concurrency-32 requests are spread over them).
    pools: dict[int, int] = field(default_factory=lambda: {10: 32, 1_000: 2, 10_000: 1})
    concurrencies: tuple[int, ...] = (1, 32)
    modes: tuple[str, ...] = ("non-stream", "stream")
    requests: dict[int, int] = field(default_factory=lambda: {1: 300, 32: 960})
    # A target's share of a cell ends at its request count or after this many seconds.
    seconds: dict[int, float] = field(default_factory=lambda: {1: 12.0, 32: 15.0})
    warmup: int = 16
    rounds: int = 3
    # The in-process-worker variant (MEMSTRATA_WORKERS=1) at the largest size; 0: skipped.
    variant_seconds: float = 15.0

    @classmethod
    def quick(cls) -> OverheadConfig:
        return cls(
            sizes=(10, 100),
            pools={10: 4, 100: 1},
            requests={1: 100, 32: 320},
            seconds={1: 1.2, 32: 2.0},
            warmup=4,
            rounds=2,
            variant_seconds=0.0,
        )

    def conversation_ids(self, size: int) -> list[str]:
        return [f"bench-{size}-{number}" for number in range(self.pools.get(size, 1))]


async def prepare(
    client: h.Client,
    builder: GatewayProcess,
    config: OverheadConfig,
    *,
    skip: Sequence[str] = (),
    parallel: int = 4,
) -> dict[str, Any]:
    """Import every pool conversation (except `skip`, already there) and wait until the
    summary trees are built."""
    wanted = [
        (size, conversation_id)
        for size in config.sizes
        for conversation_id in config.conversation_ids(size)
        if conversation_id not in skip
    ]
    gate = asyncio.Semaphore(parallel)

    async def one(size: int, conversation_id: str, seed: int) -> None:
        async with gate:
            await h.import_conversation(
                client, builder.root_url, conversation_id, h.conversation(size, seed=seed)
            )

    started = time.perf_counter()
    await asyncio.gather(
        *(one(size, cid, seed=size * 1000 + n) for n, (size, cid) in enumerate(wanted))
    )
    imported = time.perf_counter() - started
    messages = sum(size for size, _ in wanted)
    h.log(
        f"overhead data: {len(wanted)} conversations, {messages} messages imported "
        f"in {imported:.1f}s; building summary trees ..."
    )
    idle, waited, depth = await h.wait_idle(client, builder.root_url, limit=3600, poll=2.0)
    h.log(f"overhead data ready after {waited:.1f}s more (idle={idle}, {depth})")
    return {
        "conversations": len(wanted),
        "messages": messages,
        "import_seconds": round(imported, 2),
        "build_seconds": round(waited, 2),
        "idle": idle,
        "depth": depth,
        "dead_job_errors": await h.dead_jobs(client, builder.root_url) if depth.get("dead") else [],
    }


def _factory(
    url: str,
    *,
    stream: bool,
    conversation_ids: Sequence[str],
    concurrency: int,
    offset: int,
) -> h.Factory:
    """Requests `offset + index`: the same questions and conversations whatever the target."""
    bodies: dict[int, bytes] = {}

    def make(index: int, worker: int) -> h.Call:
        number = offset + index
        # At concurrency 1 the pool is walked in turn; otherwise each worker keeps to its own
        # conversation, moving on by one pool-width each round.
        slot = number if concurrency == 1 else worker + concurrency * (index // concurrency)
        conversation_id = conversation_ids[slot % len(conversation_ids)]
        body = bodies.get(number)
        if body is None:
            # The questions repeat (users do); a per-request tag would add a search term.
            question = QUESTIONS[number % len(QUESTIONS)]
            body = h.encode(
                {
                    "model": h.MODEL,
                    "stream": stream,
                    "messages": [
                        {"role": "system", "content": h.SYSTEM_PROMPT},
                        {"role": "user", "content": question},
                    ],
                }
            )
            bodies[number] = body
        return h.Call(
            url=f"{url}/chat/completions",
            body=body,
            headers=h.json_headers({h.CONVERSATION_HEADER: conversation_id}),
        )

    return make


def _added(figures: Mapping[str, Any], baseline: Mapping[str, Any], metric: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in ("p50", "p95", "p99", "mean"):
        value, base = figures[metric].get(p), baseline[metric].get(p)
        out[p] = None if value is None or base is None else round(value - base, 3)
    return out


async def measure_cell(
    client: h.Client,
    urls: Mapping[str, str],
    *,
    size: int,
    mode: str,
    concurrency: int,
    conversation_ids: Sequence[str],
    requests: int,
    seconds: float,
    warmup: int,
    rounds: int,
    offset: int,
) -> dict[str, Any]:
    """One cell: every target, `requests` each (or `seconds` at most), in rotating rounds."""
    stream = mode == "stream"
    metric = "ttfb_ms" if stream else "latency_ms"
    samples: dict[str, list[h.Sample]] = {target: [] for target in urls}
    names = list(urls)
    for target in names:  # warm connections and caches, not measured
        await h.run_load(
            client,
            _factory(
                urls[target],
                stream=stream,
                conversation_ids=conversation_ids,
                concurrency=concurrency,
                offset=offset,
            ),
            concurrency=concurrency,
            count=max(warmup, concurrency),
            duration=seconds / rounds,
        )
    offset += max(warmup, concurrency)
    per_round = max(requests // rounds, concurrency)
    started = time.perf_counter()
    for number in range(rounds):
        order = names[number % len(names) :] + names[: number % len(names)]
        for target in order:
            samples[target] += await h.run_load(
                client,
                _factory(
                    urls[target],
                    stream=stream,
                    conversation_ids=conversation_ids,
                    concurrency=concurrency,
                    offset=offset,
                ),
                concurrency=concurrency,
                count=per_round,
                duration=seconds / rounds,
            )
        offset += per_round
    figures = {target: h.latency_figures(samples[target]) for target in names}
    cell: dict[str, Any] = {
        "size": size,
        "mode": mode,
        "concurrency": concurrency,
        "metric": metric,
        "conversations": len(conversation_ids),
        "requests_per_target": {target: len(samples[target]) for target in names},
        "seconds": round(time.perf_counter() - started, 1),
        "targets": figures,
        "added_ms": {
            target: _added(figures[target], figures["upstream"], metric)
            for target in names
            if target != "upstream"
        },
        "next_offset": offset,
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    gateway_added, relay_added = cell["added_ms"].get("gateway"), cell["added_ms"].get("relay")
    if gateway_added and relay_added and None not in (relay_added["p50"], gateway_added["p50"]):
        cell["gateway_vs_relay_p50"] = round(
            gateway_added["p50"] / max(relay_added["p50"], 0.01), 2
        )
    g = figures.get("gateway", {}).get(metric, {})
    h.log(
        f"  size {size:>6} {mode:<10} c={concurrency:<3} "
        + " ".join(
            f"{t}: p50 {figures[t][metric]['p50']} p95 {figures[t][metric]['p95']}" for t in names
        )
        + f" | gateway errors {g.get('errors')}"
    )
    return cell


async def measure(
    client: h.Client,
    stack: h.Stack,
    gateway: GatewayProcess,
    config: OverheadConfig,
    *,
    variant: str = "workers=0",
    seconds: Mapping[int, float] | None = None,
    sizes: Sequence[int] | None = None,
    modes: Sequence[str] | None = None,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """Every cell of the grid against `gateway` (and the upstream and the relay)."""
    urls = {
        "upstream": stack.upstream.url,
        "relay": f"{stack.relay_url}/v1",
        "gateway": f"{gateway.root_url}/v1",
    }
    seconds = seconds or config.seconds
    cells = []
    for size in sizes or config.sizes:
        ids = config.conversation_ids(size)
        for mode in modes or config.modes:
            for concurrency in config.concurrencies:
                before = await h.conversation_sizes(stack.dsn, ids)
                cell = await measure_cell(
                    client,
                    urls,
                    size=size,
                    mode=mode,
                    concurrency=concurrency,
                    conversation_ids=ids,
                    requests=config.requests[concurrency],
                    seconds=seconds[concurrency],
                    warmup=config.warmup,
                    rounds=config.rounds,
                    offset=offset,
                )
                offset = cell.pop("next_offset")
                after = await h.conversation_sizes(stack.dsn, ids)
                cell["variant"] = variant
                cell["stored_before"] = {"min": min(before.values()), "max": max(before.values())}
                cell["stored_after"] = {"min": min(after.values()), "max": max(after.values())}
                cells.append(cell)
    return cells


def config_dict(config: OverheadConfig) -> dict[str, Any]:
    data = asdict(config)
    data["pools"] = {str(k): v for k, v in config.pools.items()}
    data["requests"] = {str(k): v for k, v in config.requests.items()}
    data["seconds"] = {str(k): v for k, v in config.seconds.items()}
    return data


async def standalone(args: argparse.Namespace) -> dict[str, Any]:
    config = OverheadConfig.quick() if args.quick else OverheadConfig()
    with h.running_stack(h.StackConfig(upstream_latency=args.latency)) as stack:
        async with h.load_client(64) as client:
            builder = stack.gateway(name="builder", workers=1)
            data = await prepare(client, builder, config)
            builder.stop()
            gateway = stack.gateway(workers=0)
            cells = await measure(client, stack, gateway, config)
            gateway.stop()
    return {
        "benchmark": "overhead",
        "machine": h.machine_info(),
        "settings": {"upstream_latency_s": args.latency, **config_dict(config)},
        "data": data,
        "cells": cells,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency", type=float, default=0.005, help="upstream latency (s)")
    parser.add_argument("--output", type=Path, default=h.RESULTS_DIR / "overhead.json")
    args = parser.parse_args()
    h.write_results(args.output, asyncio.run(standalone(args)))


if __name__ == "__main__":
    main()
