"""`python -m bench [--quick] [--only overhead,costs,...]`: the performance benchmarks.

One run on one machine, in this order, sharing one embedded Postgres, fake upstream and relay:

1. scale, part 1 -- one conversation of 10,000 messages imported through a `memstrata serve`
   with its in-process worker, timed until fully summarized (it is also the 10,000-message
   conversation of the overhead grid and of the profile);
2. overhead -- the other conversations of the grid (and the repetitive ones) are imported and
   summarized, then the grid is measured against the upstream, the relay floor and the gateway
   (workers off), then both texts at c=1 and the largest size at c=32 once more with the
   default `serve` (background jobs in its child process), and `memory_search` through `/mcp`;
3. costs -- what one prompt build reads and runs on the repetitive sizes, both texts, counted in
   what the machine's load does not change (`bench.costs`);
4. profile -- the request path at 10,000 messages (pyinstrument, stage timers, SQL);
5. load -- 60 s at concurrency 64 with short conversations, on a database of its own;
6. scale, part 2 -- the tenant filled up to 100,000 messages, its queue given a time budget,
   then retrieval latency, database size per message and gateway memory.

Results go to `bench/results/*.json` and the report (`bench.report`) to `docs/benchmarks.md`
(the `## Performance` sections) with plots in `docs/img/`. `--quick` runs a small version in
under three minutes and writes everything under `bench/results/quick/` instead (docs untouched).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from bench import costs, load, overhead, profile, report, scale, traffic
from bench import harness as h

SCENARIOS = ("overhead", "costs", "profile", "load", "scale")


async def run_all(args: argparse.Namespace, out_dir: Path) -> dict[str, Path]:
    quick = bool(args.quick)
    only = set(args.only.split(",")) if args.only else set(SCENARIOS)
    ov = overhead.OverheadConfig.quick() if quick else overhead.OverheadConfig()
    sc = scale.ScaleConfig.quick() if quick else scale.ScaleConfig()
    ld = load.LoadConfig.quick() if quick else load.LoadConfig()
    sc.conversation_size = max(ov.sizes)
    stack_config = h.StackConfig(
        upstream_latency=args.latency, upstream_chunk_delay=args.chunk_delay, durable=True
    )
    common = {
        "upstream_latency_s": args.latency,
        "upstream_chunk_delay_s": args.chunk_delay,
        "database": "embedded Postgres 18 + pgvector, durable (fsync on), as `serve` runs it",
        "gateway": "memstrata serve, MEMSTRATA_SUMMARY_MODE=extractive, LOG_LEVEL=warning",
        "shared_machine": "load generator, fake upstream, relay, Postgres and gateway share "
        "the same cores",
        "quick": quick,
    }
    written: dict[str, Path] = {}
    started = time.perf_counter()
    with h.running_stack(stack_config) as stack:
        async with traffic.load_client(64) as client:
            scale_single: dict[str, Any] | None = None
            conversation_id = f"bench-{max(ov.sizes)}-0"
            if only & {"overhead", "costs", "profile", "scale"}:
                builder = stack.gateway(name="builder", workers=1, worker_nice=0)
                conversation_id, scale_single = await scale.single(client, stack, builder, sc)
                data = await overhead.prepare(client, builder, ov, skip=[conversation_id])
                builder.stop()
            if "overhead" in only:
                gateway = stack.gateway(name="gateway", workers=0)
                cells = await overhead.measure(client, stack, gateway, ov, cells=overhead.grid(ov))
                memory = h.process_memory(gateway.pid)
                gateway.stop()
                more, searches = await overhead.default_serve(client, stack, ov)
                cells += more
                written["overhead"] = h.write_results(
                    out_dir / "overhead.json",
                    {
                        "benchmark": "overhead",
                        "machine": h.machine_info(),
                        "settings": {**common, **overhead.config_dict(ov)},
                        "data": data,
                        "gateway_memory_after": memory,
                        "cells": cells,
                        "searches": searches,
                    },
                )
            if "costs" in only:
                written["costs"] = h.write_results(
                    out_dir / "costs.json",
                    {
                        "benchmark": "costs",
                        "machine": h.machine_info(),
                        "settings": common,
                        **await costs.run(stack, ov, builds=10 if quick else 30),
                    },
                )
            if "profile" in only:
                result = await profile.run(
                    client,
                    stack,
                    conversation_id=conversation_id,
                    size=max(ov.sizes),
                    requests=60 if quick else 300,
                    seconds=2.0 if quick else 20.0,
                    out_dir=out_dir,
                    pool=ov.conversation_ids(min(ov.sizes)),
                    html=bool(args.profile_html),
                )
                written["profile"] = h.write_results(
                    out_dir / "profile.json",
                    {
                        "benchmark": "profile",
                        "machine": h.machine_info(),
                        "settings": common,
                        **result,
                    },
                )
            if "load" in only:
                result = await load.run(client, stack, ld)
                written["load"] = h.write_results(
                    out_dir / "load.json",
                    {
                        "benchmark": "load",
                        "machine": h.machine_info(),
                        "settings": common,
                        **result,
                    },
                )
            if "scale" in only and scale_single is not None:
                gateway = stack.gateway(name="scale", workers=1, worker_nice=0)
                many = await scale.tenant(client, stack, gateway, sc)
                gateway.stop()
                found = await scale.retrieval(stack, sc, conversation_id=conversation_id)
                size = await scale.database_size(stack)
                written["scale"] = h.write_results(
                    out_dir / "scale.json",
                    {
                        "benchmark": "scale",
                        "machine": h.machine_info(),
                        "settings": {**common, **scale.config_dict(sc)},
                        "conversation": scale_single,
                        "tenant": many,
                        "retrieval": found,
                        "database": size,
                    },
                )
    h.log(f"benchmarks done in {time.perf_counter() - started:.0f}s")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small version, < 3 minutes")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--latency", type=float, default=0.005, help="upstream latency (s)")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="stream chunk delay (s)")
    parser.add_argument("--report-only", action="store_true", help="only redraw the report")
    parser.add_argument(
        "--profile-html", action="store_true", help="also write pyinstrument HTML (large)"
    )
    args = parser.parse_args()
    out_dir = h.RESULTS_DIR / "quick" if args.quick else h.RESULTS_DIR
    if not args.report_only:
        asyncio.run(run_all(args, out_dir))
    report.write(out_dir, quick=bool(args.quick))


if __name__ == "__main__":
    main()
