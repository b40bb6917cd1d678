"""Latency the gateway adds on a conversation served from its working context, compaction turns
apart (issue #13: at 10,000 stored messages, c=1, turns without compaction, p50 ≤ 15 ms and
p95 ≤ 30 ms; first byte added for a stream ≤ 20 ms).

    python -m bench.context_latency [--size 10000] [--turns 150] [--budget 8000]
                                    [--modes non-stream,stream] [--latency 0.005]
                                    [--output bench/results/context-latency.json]
    python -m bench.context_latency --tables bench/results/context-latency.json

A synthetic conversation of `--size` messages (`harness.conversation`) is imported and its
summary tree built; then a client talks to it turn by turn, one request at a time, naming it in
`X-Memstrata-Conversation` and sending a system prompt and one new question (`bench.overhead`'s
questions): far past the budget, every turn is served from the conversation's working context,
which grows by the question and its answer until a compaction. Before each turn the same body
goes to the fake upstream directly: the turn's added latency (and, for a stream, added time to
the first byte) is the gateway's minus the upstream's. A separate `memstrata worker` runs the
background jobs, and each turn waits until the queue is idle, as a person's pause lets it (the
next turn's recall is prepared, `memory.recall.anticipation`).

Per turn: whether it compacted (the working context's `compactions` grew), the added latency,
the gateway's own `X-Memstrata-Overhead-Ms`, the request path's stages (`memory.stages`, the
difference of `/metrics`' `memstrata_request_stage_seconds_sum` around the request) and the
1-minute load average. The summary splits compaction turns from the rest, per mode. The
figures are only as quiet as the machine: the load average is beside each.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import harness as h
from bench import traffic
from bench.overhead import QUESTIONS
from devkit.gateway import WorkerProcess

STAGES = "memstrata_request_stage_seconds"


async def stage_sums(client: httpx.AsyncClient, root_url: str) -> dict[str, float]:
    """Seconds spent so far in each stage of the request path, from `/metrics`."""
    response = await client.get(f"{root_url}/metrics", timeout=60)
    response.raise_for_status()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        if family.name != STAGES:
            continue
        for sample in family.samples:
            if sample.name == f"{STAGES}_sum":
                found[sample.labels["stage"]] = sample.value
    return found


async def measured_turn(
    client: httpx.AsyncClient,
    *,
    upstream_url: str,
    gateway_root: str,
    body: bytes,
    headers: dict[str, str],
) -> tuple[traffic.Sample, traffic.Sample, dict[str, float]]:
    """One turn's body sent to the upstream directly, then through the gateway: both samples,
    and the milliseconds each request-path stage that ran took (from `/metrics` around it)."""
    upstream = await traffic.send(
        client,
        traffic.Call(f"{upstream_url}/chat/completions", body, h.json_headers()),
        worker=0,
        origin=0.0,
    )
    before = await stage_sums(client, gateway_root)
    sample = await traffic.send(
        client,
        traffic.Call(f"{gateway_root}/v1/chat/completions", body, headers),
        worker=0,
        origin=0.0,
    )
    if not sample.ok:
        raise RuntimeError(f"HTTP {sample.status} {sample.error}")
    after = await stage_sums(client, gateway_root)
    stages = {
        name: round((seconds - before.get(name, 0.0)) * 1000, 3)
        for name, seconds in after.items()
        if seconds > before.get(name, 0.0)
    }
    return upstream, sample, stages


async def compactions(dsn: str, external_id: str) -> int | None:
    """The conversation's working-context compactions so far (None: no context yet)."""
    async with h.database(dsn) as db:
        found = await db.fetchval(
            "SELECT w.compactions FROM working_contexts w JOIN conversations c "
            "ON c.id = w.conversation_id WHERE c.external_id = $1",
            external_id,
        )
    return None if found is None else int(found)


FOLLOW_UPS = (
    "And is the rollback plan for the maintenance window written down somewhere?",
    "Which seat did I get on that conference flight?",
    "Did the contractor say the renovation would stay within that budget?",
    "Who is working on that login bug ticket now?",
    "Is the cloud hosting share of the budget higher than last quarter?",
    "What did the interviewers think of that final candidate?",
    "What is left to do before the database migration is finished?",
    "Who is bringing the cake to the birthday party?",
)
"""A follow-up on each of `QUESTIONS`' subjects: every other turn stays on the subject, as
people do, so that the recall prepared after the last reply may cover it."""


def question(number: int) -> str:
    """Turn `number`'s question: a new subject, then a follow-up on it."""
    subject = (number // 2) % len(QUESTIONS)
    return (QUESTIONS if number % 2 == 0 else FOLLOW_UPS)[subject]


def _body(number: int, *, stream: bool) -> bytes:
    return h.encode(
        {
            "model": h.MODEL,
            "stream": stream,
            "messages": [
                {"role": "system", "content": h.SYSTEM_PROMPT},
                {"role": "user", "content": question(number)},
            ],
        }
    )


async def turns(
    client: httpx.AsyncClient,
    stack: h.Stack,
    gateway_url: str,
    *,
    conversation_id: str,
    mode: str,
    count: int,
    offset: int,
) -> list[dict[str, Any]]:
    """`count` turns in `mode`, each measured against the upstream (see the module docstring)."""
    stream = mode == "stream"
    headers = h.json_headers({h.CONVERSATION_HEADER: conversation_id})
    found = []
    for number in range(offset, offset + count):
        before = await compactions(stack.dsn, conversation_id)
        upstream, sample, stages_ms = await measured_turn(
            client,
            upstream_url=stack.upstream.url,
            gateway_root=gateway_url,
            body=_body(number, stream=stream),
            headers=headers,
        )
        after = await compactions(stack.dsn, conversation_id)
        record: dict[str, Any] = {
            "turn": number,
            "mode": mode,
            "compacted": before is not None and after != before,
            "follow_up": number % 2 == 1,
            "added_ms": round((sample.latency - upstream.latency) * 1000, 3),
            "overhead_ms": sample.overhead_ms,
            # Retrieval ran (no vector search: the prepared candidates were used).
            "retrieved": "vector" in stages_ms,
            "stages_ms": stages_ms,
            "load_average_1min": round(os.getloadavg()[0], 2),
        }
        if stream and sample.ttfb is not None and upstream.ttfb is not None:
            record["first_byte_added_ms"] = round((sample.ttfb - upstream.ttfb) * 1000, 3)
        found.append(record)
        # A person's pause: the worker prepares the next turn meanwhile.
        await h.wait_idle(client, gateway_url, limit=300, poll=0.05)
    return found


def summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the turns without compaction (all, then those that retrieved and those that
    used the prepared recall) and the compaction turns apart."""
    kinds: dict[str, Callable[[dict[str, Any]], bool]] = {
        "without compaction": lambda r: not r["compacted"],
        "without compaction, retrieval": lambda r: not r["compacted"] and r["retrieved"],
        "without compaction, prepared recall": lambda r: not r["compacted"] and not r["retrieved"],
        "compaction": lambda r: r["compacted"],
    }
    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in records}):
        for kind, wanted in kinds.items():
            chosen = [r for r in records if r["mode"] == mode and wanted(r)]
            if not chosen:
                continue
            part: dict[str, Any] = {
                "turns": len(chosen),
                "added_ms": h.summarize([r["added_ms"] for r in chosen]),
                "overhead_header_ms": h.summarize(
                    [r["overhead_ms"] for r in chosen if r["overhead_ms"] is not None]
                ),
                "stages_mean_ms": {
                    name: round(statistics.fmean(r["stages_ms"].get(name, 0.0) for r in chosen), 3)
                    for name in sorted({n for r in chosen for n in r["stages_ms"]})
                },
                "load_average_1min": {
                    "min": min(r["load_average_1min"] for r in chosen),
                    "mean": round(statistics.fmean(r["load_average_1min"] for r in chosen), 2),
                    "max": max(r["load_average_1min"] for r in chosen),
                },
            }
            firsts = [r["first_byte_added_ms"] for r in chosen if "first_byte_added_ms" in r]
            if firsts:
                part["first_byte_added_ms"] = h.summarize(firsts)
            out[f"{mode}, {kind}"] = part
    return out


STAGE_NAMES = (
    *("store", "assemble", "context", "embed", "fulltext", "vector"),
    *("passages", "load", "fuse", "note", "save"),
)


def tables(report: dict[str, Any]) -> list[str]:
    """The summary as Markdown: latency per kind of turn, then the mean stages of the turns
    without compaction."""
    lines = [
        "| turns | n | added p50 / p95 ms | first byte added p50 / p95 ms | "
        "X-Memstrata-Overhead-Ms p50 / p95 | load average (1 min) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, part in report["summary"].items():
        added, own, load = part["added_ms"], part["overhead_header_ms"], part["load_average_1min"]
        first = part.get("first_byte_added_ms")
        lines.append(
            f"| {kind} | {part['turns']} | {added['p50']:.0f} / {added['p95']:.0f} | "
            + (f"{first['p50']:.0f} / {first['p95']:.0f}" if first else "-")
            + f" | {own['p50']:.0f} / {own['p95']:.0f} | "
            f"{load['mean']} ({load['min']}-{load['max']}) |"
        )
    lines += ["", "| turns | " + " | ".join(STAGE_NAMES) + " |"]
    lines.append("|---|" + "---|" * len(STAGE_NAMES))
    for kind, part in report["summary"].items():
        if "without compaction" in kind:
            stages = part["stages_mean_ms"]
            cells = [f"{stages[name]:.1f}" if name in stages else "-" for name in STAGE_NAMES]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return lines


async def run(args: argparse.Namespace) -> dict[str, Any]:
    conversation_id = f"context-{args.size}"
    modes = args.modes.split(",")
    with h.running_stack(h.StackConfig(upstream_latency=args.latency)) as stack:
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            builder = stack.gateway(name="builder", workers=1, context_budget=args.budget)
            imported = await h.import_conversation(
                client, builder.root_url, conversation_id, h.conversation(args.size, seed=13)
            )
            _, built, _ = await h.wait_idle(client, builder.root_url, limit=7200, poll=2)
            h.log(f"{args.size} messages imported in {imported:.1f}s, built in {built:.1f}s")
            builder.stop()
            with WorkerProcess(
                stack.database_url, summary_mode="extractive", data_dir=str(stack.gateway_data)
            ):
                gateway = stack.gateway(workers=0, context_budget=args.budget)
                # The first turn builds the working context; a few more warm the caches.
                await turns(
                    client,
                    stack,
                    gateway.root_url,
                    conversation_id=conversation_id,
                    mode=modes[0],
                    count=args.warmup,
                    offset=0,
                )
                records: list[dict[str, Any]] = []
                for mode in modes:
                    records += await turns(
                        client,
                        stack,
                        gateway.root_url,
                        conversation_id=conversation_id,
                        mode=mode,
                        count=args.turns,
                        offset=args.warmup + len(records),
                    )
                    h.log(f"{mode}: {args.turns} turns measured")
                gateway.stop()
    return {
        "benchmark": "context latency",
        "machine": h.machine_info(),
        "settings": {
            "size": args.size,
            "turns_per_mode": args.turns,
            "warmup": args.warmup,
            "budget": args.budget,
            "upstream_latency_s": args.latency,
        },
        "data": {"import_seconds": round(imported, 1), "build_seconds": round(built, 1)},
        "summary": summary(records),
        "turns": records,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget", type=int, default=8000)
    parser.add_argument("--modes", default="non-stream,stream")
    parser.add_argument("--latency", type=float, default=0.005, help="upstream latency (s)")
    parser.add_argument("--output", type=Path, default=h.RESULTS_DIR / "context-latency.json")
    parser.add_argument(
        "--tables", type=Path, default=None, help="print the Markdown tables of a results file"
    )
    args = parser.parse_args(argv)
    h.run_or_show(args.tables, args.output, lambda: run(args), tables)


if __name__ == "__main__":
    main()
