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

Two texts (`bench.harness.TEXTS`): the varied synthetic conversations of the grid, and at
1,000 and 10,000 messages (`repetitive`) a conversation whose few words repeat ("message 412
about topic 10 with number 2884"), asked questions made of those words ("new question 7 about
topic 3"). At concurrency 1, non-stream, both texts are measured with `MEMSTRATA_WORKERS=0` and
with the default `serve` (its background jobs in a child process, working on what the requests
store): the prompt build (`X-Memstrata-Overhead-Ms`, the time from the request's arrival to
its forwarding) and the added latency; then `memory_search` through `/mcp` on each of those
conversations (`search_latency`).

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
from bench import traffic
from devkit.gateway import GatewayProcess

TARGETS = ("upstream", "relay", "gateway")
DEFAULT_SERVE = "default serve"
"""The variant label of `memstrata serve` as `make run` starts it (one background job at a time,
in a child process)."""
REBUILD_SERVE = "default serve, rebuild"
"""The variant label of the default `serve` with `MEMSTRATA_CONTEXT_MODE=rebuild`: every turn
runs every leg of retrieval for its question (what a compaction, a topic change and the dry run
do), where the working context's turns mostly reuse what they hold or prepared."""
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
# The repetitive conversation's words, asked back as questions do.
REPETITIVE_QUESTIONS = tuple(
    f"new question {n} about topic {topic}"
    for n, topic in ((7, 3), (2, 15), (5, 8), (1, 20), (4, 11), (6, 0), (3, 17), (8, 6))
)


def questions(text: str) -> tuple[str, ...]:
    return REPETITIVE_QUESTIONS if text == "repetitive" else QUESTIONS


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
    # Sizes of the repetitive conversations, each measured at c=1 beside the varied ones.
    repetitive: tuple[int, ...] = (1_000, 10_000)
    # The default-serve variant (MEMSTRATA_WORKERS=1) at c=1 on both texts at the repetitive
    # sizes, and at c=32 at the largest; 0: skipped.
    variant_seconds: float = 15.0
    # memory_search calls per conversation (through /mcp, on the default serve); 0: skipped.
    searches: int = 100

    @classmethod
    def quick(cls) -> OverheadConfig:
        return cls(
            sizes=(10, 100),
            pools={10: 4, 100: 1},
            requests={1: 100, 32: 320},
            seconds={1: 1.2, 32: 2.0},
            warmup=4,
            rounds=2,
            repetitive=(100,),
            variant_seconds=2.0,
            searches=20,
        )

    def conversation_ids(self, size: int, text: str = "varied") -> list[str]:
        if text == "repetitive":
            return [f"bench-rep-{size}-0"]
        return [f"bench-{size}-{number}" for number in range(self.pools.get(size, 1))]

    def texts_at(self, size: int) -> tuple[str, ...]:
        """The texts measured at `size` stored messages."""
        return h.TEXTS if size in self.repetitive else ("varied",)


async def prepare(
    client: traffic.Client,
    builder: GatewayProcess,
    config: OverheadConfig,
    *,
    skip: Sequence[str] = (),
    parallel: int = 4,
) -> dict[str, Any]:
    """Import every pool conversation (except `skip`, already there) and wait until the
    summary trees are built."""
    wanted = [
        (size, text, conversation_id)
        for size in sorted({*config.sizes, *config.repetitive})
        for text in config.texts_at(size)
        for conversation_id in config.conversation_ids(size, text)
        if conversation_id not in skip
    ]
    gate = asyncio.Semaphore(parallel)

    async def one(size: int, text: str, conversation_id: str, seed: int) -> None:
        async with gate:
            messages = h.conversation(size, seed=seed, text=text)
            await h.import_conversation(client, builder.root_url, conversation_id, messages)

    started = time.perf_counter()
    await asyncio.gather(
        *(one(size, text, cid, seed=size * 1000 + n) for n, (size, text, cid) in enumerate(wanted))
    )
    imported = time.perf_counter() - started
    messages = sum(size for size, _, _ in wanted)
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
    asked: Sequence[str] = QUESTIONS,
) -> traffic.Factory:
    """Requests `offset + index`: the same questions and conversations whatever the target."""
    bodies: dict[int, bytes] = {}

    def make(index: int, worker: int) -> traffic.Call:
        number = offset + index
        # At concurrency 1 the pool is walked in turn; otherwise each worker keeps to its own
        # conversation, moving on by one pool-width each round.
        slot = number if concurrency == 1 else worker + concurrency * (index // concurrency)
        conversation_id = conversation_ids[slot % len(conversation_ids)]
        body = bodies.get(number)
        if body is None:
            # The questions repeat (users do); a per-request tag would add a search term.
            question = asked[number % len(asked)]
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
        return traffic.Call(
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
    client: traffic.Client,
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
    text: str = "varied",
) -> dict[str, Any]:
    """One cell: every target, `requests` each (or `seconds` at most), in rotating rounds."""
    stream = mode == "stream"
    asked = questions(text)
    metric = "ttfb_ms" if stream else "latency_ms"
    samples: dict[str, list[traffic.Sample]] = {target: [] for target in urls}
    names = list(urls)
    for target in names:  # warm connections and caches, not measured
        await traffic.run_load(
            client,
            _factory(
                urls[target],
                stream=stream,
                conversation_ids=conversation_ids,
                concurrency=concurrency,
                offset=offset,
                asked=asked,
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
            samples[target] += await traffic.run_load(
                client,
                _factory(
                    urls[target],
                    stream=stream,
                    conversation_ids=conversation_ids,
                    concurrency=concurrency,
                    offset=offset,
                    asked=asked,
                ),
                concurrency=concurrency,
                count=per_round,
                duration=seconds / rounds,
            )
        offset += per_round
    figures = {target: traffic.latency_figures(samples[target]) for target in names}
    cell: dict[str, Any] = {
        "size": size,
        "text": text,
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
        f"  size {size:>6} {text:<10} {mode:<10} c={concurrency:<3} "
        + " ".join(
            f"{t}: p50 {figures[t][metric]['p50']} p95 {figures[t][metric]['p95']}" for t in names
        )
        + f" | gateway errors {g.get('errors')}"
    )
    return cell


Spec = tuple[int, str, str, int]
"""One cell to measure: (stored messages, text, mode, concurrency)."""


def grid(config: OverheadConfig) -> list[Spec]:
    """The cells measured with `MEMSTRATA_WORKERS=0`: every size, mode and concurrency of the
    varied text, and the repetitive text at c=1, non-stream."""
    return [
        *(
            (size, "varied", mode, concurrency)
            for size in config.sizes
            for mode in config.modes
            for concurrency in config.concurrencies
        ),
        *((size, "repetitive", "non-stream", 1) for size in config.repetitive),
    ]


def default_serve_cells(config: OverheadConfig) -> list[Spec]:
    """The cells measured again with the default `serve`: both texts at c=1 at the repetitive
    sizes, and the varied text at the largest concurrency and size."""
    return [
        *((size, text, "non-stream", 1) for size in config.repetitive for text in h.TEXTS),
        (max(config.sizes), "varied", "non-stream", max(config.concurrencies)),
    ]


async def measure(
    client: traffic.Client,
    stack: h.Stack,
    gateway: GatewayProcess,
    config: OverheadConfig,
    *,
    cells: Sequence[Spec],
    variant: str = "workers=0",
    seconds: Mapping[int, float] | None = None,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """The `cells` against `gateway` (and the upstream and the relay)."""
    urls = {
        "upstream": stack.upstream.url,
        "relay": f"{stack.relay_url}/v1",
        "gateway": f"{gateway.root_url}/v1",
    }
    seconds = seconds or config.seconds
    measured = []
    for size, text, mode, concurrency in cells:
        ids = config.conversation_ids(size, text)
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
            text=text,
        )
        offset = cell.pop("next_offset")
        after = await h.conversation_sizes(stack.dsn, ids)
        cell["variant"] = variant
        cell["stored_before"] = {"min": min(before.values()), "max": max(before.values())}
        cell["stored_after"] = {"min": min(after.values()), "max": max(after.values())}
        measured.append(cell)
    return measured


async def search_latency(
    client: traffic.Client, gateway: GatewayProcess, config: OverheadConfig
) -> list[dict[str, Any]]:
    """`memory_search` (limit 8, the tool's default) called through `/mcp` one at a time on
    each conversation of the repetitive sizes, both texts: latency p50 / p95 (the query's
    embedding included). Run right after the default `serve`'s cells, while its worker still
    works through what they stored."""
    results = []
    for size in config.repetitive:
        for text in h.TEXTS:
            [conversation_id] = config.conversation_ids(size, text)[:1]
            asked = questions(text)
            samples: list[float] = []
            errors: list[str] = []
            for number in range(config.searches + config.warmup):
                body = {
                    "jsonrpc": "2.0",
                    "id": number,
                    "method": "tools/call",
                    "params": {
                        "name": "memory_search",
                        "arguments": {
                            "conversation": conversation_id,
                            "query": asked[number % len(asked)],
                        },
                    },
                }
                started = time.perf_counter()
                response = await client.post(
                    f"{gateway.root_url}/mcp",
                    content=h.encode(body),
                    headers=h.json_headers({"accept": "application/json, text/event-stream"}),
                )
                elapsed = (time.perf_counter() - started) * 1000
                reply = response.json() if response.status_code == 200 else {}
                if response.status_code != 200 or reply.get("result", {}).get("isError"):
                    errors.append(f"HTTP {response.status_code}: {response.text[:200]}")
                elif number >= config.warmup:
                    samples.append(elapsed)
            figures = h.summarize(samples, errors=len(errors))
            h.log(
                f"  memory_search {size:>6} {text:<10} p50 {figures.get('p50')} "
                f"p95 {figures.get('p95')} errors {len(errors)}"
            )
            results.append(
                {
                    "size": size,
                    "text": text,
                    "conversation": conversation_id,
                    "latency_ms": figures,
                    "error_examples": errors[:3],
                    "load_average_1min": round(os.getloadavg()[0], 2),
                }
            )
    return results


async def default_serve(
    client: traffic.Client, stack: h.Stack, config: OverheadConfig
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The default `serve`'s cells (`default_serve_cells`) and `memory_search` on it, then both
    texts at c=1 with `MEMSTRATA_CONTEXT_MODE=rebuild` (`REBUILD_SERVE`); nothing when
    `variant_seconds` is 0."""
    if config.variant_seconds <= 0:
        return [], []
    seconds = {c: config.variant_seconds for c in config.concurrencies}
    gateway = stack.gateway(name="gateway-default", workers=1)
    await _drain(client, gateway, "default serve")
    cells = await measure(
        client,
        stack,
        gateway,
        config,
        cells=default_serve_cells(config),
        variant=DEFAULT_SERVE,
        seconds=seconds,
        offset=1_000_000,
    )
    searches = await search_latency(client, gateway, config) if config.searches else []
    gateway.stop()
    gateway = stack.gateway(name="gateway-rebuild", workers=1, context_mode="rebuild")
    await _drain(client, gateway, "rebuild")
    cells += await measure(
        client,
        stack,
        gateway,
        config,
        cells=[(size, text, "non-stream", 1) for size in config.repetitive for text in h.TEXTS],
        variant=REBUILD_SERVE,
        seconds=seconds,
        offset=2_000_000,
    )
    gateway.stop()
    return cells, searches


def config_dict(config: OverheadConfig) -> dict[str, Any]:
    data = asdict(config)
    data["pools"] = {str(k): v for k, v in config.pools.items()}
    data["requests"] = {str(k): v for k, v in config.requests.items()}
    data["seconds"] = {str(k): v for k, v in config.seconds.items()}
    return data


async def _drain(client: traffic.Client, gateway: GatewayProcess, variant: str) -> None:
    """Let `gateway`'s worker finish the jobs queued before it started (the messages the
    `MEMSTRATA_WORKERS=0` cells stored, thousands of them, which nothing embedded), so that
    what runs beside its measured requests is what a default `serve` does in steady state:
    embedding and summarizing the messages those requests store, and preparing their recall."""
    waited = await h.drain(client, gateway.root_url, limit=3600)
    h.log(f"  {variant}: the queue drained in {waited:.1f}s before measuring")


async def standalone(args: argparse.Namespace) -> dict[str, Any]:
    config = OverheadConfig.quick() if args.quick else OverheadConfig()
    with h.running_stack(h.StackConfig(upstream_latency=args.latency)) as stack:
        async with traffic.load_client(64) as client:
            builder = stack.gateway(name="builder", workers=1, worker_nice=0)
            data = await prepare(client, builder, config)
            builder.stop()
            gateway = stack.gateway(workers=0)
            cells = await measure(client, stack, gateway, config, cells=grid(config))
            gateway.stop()
            more, searches = await default_serve(client, stack, config)
            cells += more
    return {
        "benchmark": "overhead",
        "machine": h.machine_info(),
        "settings": {"upstream_latency_s": args.latency, **config_dict(config)},
        "data": data,
        "cells": cells,
        "searches": searches,
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
