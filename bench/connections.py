"""Upstream connections: how many the gateway opens, and what a request waits for them, at a
few request rates.

    python -m bench.connections [--spacings 0.05,0.5,1,2] [--requests 24] [--base REV]
                                [--output FILE]

One client sends `--requests` chat requests one at a time, `spacing` seconds apart, to a real
`memstrata serve` (`MEMSTRATA_WORKERS=0`, extractive summaries; each request a short question
on one of three conversations) in front of the fake upstream (5 ms latency), which records the
peer (`host:port`) of every request it serves: requests with one peer came over one connection.
Before each spacing the run waits past the gateway's keep-alive, so each starts with no
connection open. Per spacing: the connections opened per request, and the mean time to the
upstream's response headers as the gateway measures it (`memstrata_upstream_latency_seconds`
in `/metrics`, a new connection's set-up included). With `--base REV` the same runs go through
a gateway from a checkout of REV first, against the same upstream.

Over loopback a new connection costs little; to a provider over TLS each one is a TCP and a
TLS handshake (two to three round trips) before the prompt is sent. Results:
`bench/results/connections.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench import harness as h
from bench.side_by_side import checkout
from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.upstream import UpstreamServer
from gateway.upstream import KEEPALIVE_SECONDS

RESULTS = h.RESULTS_DIR / "connections.json"
PATH = "/chat/completions"


def _upstream_seconds(metrics: str) -> tuple[float, float]:
    """The sum and count of the gateway's upstream chat-completion timings so far."""
    total = count = 0.0
    for line in metrics.splitlines():
        if PATH not in line:
            continue
        if line.startswith("memstrata_upstream_latency_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("memstrata_upstream_latency_seconds_count"):
            count += float(line.split()[-1])
    return total, count


async def measure(
    client: httpx.AsyncClient,
    gateway: GatewayProcess,
    upstream: UpstreamServer,
    *,
    spacing: float,
    requests: int,
) -> dict[str, Any]:
    """One spacing's run, from no connection open (see the module docstring)."""
    await asyncio.sleep(KEEPALIVE_SECONDS + 1.0)
    upstream.reset()
    before = _upstream_seconds((await client.get(f"{gateway.root_url}/metrics")).text)
    latencies = []
    for number in range(requests):
        started = time.perf_counter()
        response = await client.post(
            f"{gateway.url}{PATH}",
            headers={"X-Memstrata-Conversation": f"connections-{spacing}-{number % 3}"},
            json={"model": "m", "messages": [{"role": "user", "content": f"question {number}"}]},
        )
        latencies.append((time.perf_counter() - started) * 1000)
        response.raise_for_status()
        await asyncio.sleep(spacing)
    after = _upstream_seconds((await client.get(f"{gateway.root_url}/metrics")).text)
    peers = {request["peer"] for request in upstream.requests(f"/v1{PATH}")}
    served = after[1] - before[1]
    return {
        "spacing_s": spacing,
        "requests": requests,
        "connections": len(peers),
        "connections_per_request": round(len(peers) / requests, 3),
        "upstream_headers_ms_mean": round((after[0] - before[0]) / served * 1000, 2),
        "client_latency_ms_p50": round(statistics.median(latencies), 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    spacings = [float(value) for value in args.spacings.split(",")]
    found: dict[str, Any] = {}
    with ExitStack() as stack:
        trees: dict[str, Path | None] = {}
        if args.base:
            trees["base"] = stack.enter_context(checkout(args.base))
        trees["head"] = None
        postgres = stack.enter_context(throwaway_postgres(prefix="memstrata-connections-"))
        upstream = stack.enter_context(UpstreamServer(latency=0.005))
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            for side, tree in trees.items():
                with (
                    tempfile.TemporaryDirectory(prefix="memstrata-connections-") as data_dir,
                    GatewayProcess(
                        database_url=postgres.url,
                        upstream_url=upstream.url,
                        name=side,
                        cwd=tree,
                        workers=0,
                        log_level="warning",
                        summary_mode="extractive",
                        data_dir=data_dir,
                    ) as gateway,
                ):
                    found[side] = []
                    for spacing in spacings:
                        row = await measure(
                            client, gateway, upstream, spacing=spacing, requests=args.requests
                        )
                        h.log(f"{side}: {row}")
                        found[side].append(row)
    return {
        "benchmark": "upstream connections",
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": h.machine_info(),
        "base": args.base,
        "results": found,
    }


def table(report: dict[str, Any]) -> list[str]:
    """The results as a Markdown table, one row per gateway and spacing."""
    rows = [
        (
            side,
            f"{row['spacing_s']} s",
            f"{row['connections']} for {row['requests']}",
            f"{row['upstream_headers_ms_mean']:.2f}",
            f"{row['client_latency_ms_p50']:.1f}",
        )
        for side, runs in report["results"].items()
        for row in runs
    ]
    header = [
        "gateway",
        "requests apart",
        "upstream connections opened",
        "to the upstream's headers, mean ms",
        "client p50 ms",
    ]
    return h.markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--spacings", default="0.05,0.5,1,2")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--base", default=None, help="also measure a gateway at this revision")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    h.write_results(args.output, report)
    print("\n".join(table(report)))


if __name__ == "__main__":
    main()
