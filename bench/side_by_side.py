"""Two revisions of the gateway on one database, turn by turn: what a change does to the request
path on a machine whose speed drifts by more than the change.

    python -m bench.side_by_side --base REV [--head REV] [--text varied|repetitive]
                                 [--size 10000] [--turns 80] [--rounds 3]
                                 [--data-dir DIR] [--set NAME=VALUE ...] [--output FILE]

This machine's speed moves by a factor of two within hours (docs/benchmarks.md, "Performance:
closing note"), so two runs of a benchmark made at different times compare the machine, not
the code. Here each revision runs `memstrata serve` (default settings but `--set`) from a
checkout of its own (`git worktree`, removed at the end; the head is the working tree as it is
unless `--head` names a revision), on one kept Postgres cluster holding one synthetic
conversation (`harness.conversation`, imported and summarized on the first run; `--data-dir`
keeps it for the next), against one fake upstream. The revisions take turns, `--rounds` times:
each runs `--turns` turns of `bench.overhead`'s questions at c=1, named by
`X-Memstrata-Conversation`, each body sent to the upstream directly first (added = the
gateway's latency minus the upstream's), back to back as `bench.overhead` sends them.

Per revision and round: added latency p50 / p95, `X-Memstrata-Overhead-Ms` p50 / p95 and the
mean milliseconds per turn of each request-path stage (`memory.stages`, from `/metrics`). The
conversation grows by each turn's question and answer, so both revisions see the same history,
a few turns apart.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench import harness as h
from bench.context_latency import measured_turn
from bench.overhead import QUESTIONS, REPETITIVE_QUESTIONS
from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.upstream import UpstreamServer


@contextmanager
def checkout(revision: str) -> Iterator[Path]:
    """A detached worktree of the repository at `revision`, removed on exit."""
    folder = Path(tempfile.mkdtemp(prefix="memstrata-side-"))
    where = folder / "tree"
    git = ["git", "-C", str(h.REPO_ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", str(where), revision], check=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(where)], check=False)
        # A worktree git could not remove leaves files behind: gone too, without hiding the
        # error that ended the run.
        shutil.rmtree(folder, ignore_errors=True)


def _working_tree() -> str:
    """The working tree as `git describe` names it: its commit, `-dirty` when changed."""
    described = subprocess.run(
        ["git", "-C", str(h.REPO_ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=True,
    )
    return f"working tree ({described.stdout.strip()})"


async def turns(
    client: httpx.AsyncClient,
    gateway: GatewayProcess,
    upstream_url: str,
    *,
    external_id: str,
    questions: Sequence[str],
    count: int,
) -> dict[str, Any]:
    """`count` turns, each against the upstream; their added latency, overhead and stages."""
    added: list[float] = []
    overhead: list[float] = []
    stages: dict[str, float] = {}
    headers = h.json_headers({h.CONVERSATION_HEADER: external_id})
    for number in range(count):
        body = h.encode(
            {
                "model": h.MODEL,
                "messages": [
                    {"role": "system", "content": h.SYSTEM_PROMPT},
                    {"role": "user", "content": questions[number % len(questions)]},
                ],
            }
        )
        upstream, sample, spent = await measured_turn(
            client,
            upstream_url=upstream_url,
            gateway_root=gateway.root_url,
            body=body,
            headers=headers,
        )
        added.append((sample.latency - upstream.latency) * 1000)
        if sample.overhead_ms is not None:
            overhead.append(sample.overhead_ms)
        for name, ms in spent.items():
            stages[name] = stages.get(name, 0.0) + ms
    return {
        "added_ms": h.summarize(added),
        "overhead_ms": h.summarize(overhead),
        "stages_ms": {name: round(total / count, 2) for name, total in sorted(stages.items())},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = dict(pair.split("=", 1) for pair in args.set)
    external_id = f"side-{args.text}-{args.size}"
    questions = REPETITIVE_QUESTIONS if args.text == "repetitive" else QUESTIONS
    with ExitStack() as stack:
        trees = {"base": stack.enter_context(checkout(args.base))}
        trees["head"] = stack.enter_context(checkout(args.head)) if args.head else h.REPO_ROOT
        postgres = stack.enter_context(
            throwaway_postgres(prefix="memstrata-side-", durable=True, folder=args.data_dir)
        )
        upstream = stack.enter_context(UpstreamServer(latency=args.latency))
        values: dict[str, Any] = {
            "log_level": "warning",
            "summary_mode": "extractive",
            "data_dir": str(postgres.data_dir.parent / "gateway-data"),
        }
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            with GatewayProcess(
                database_url=postgres.url, upstream_url=upstream.url, name="builder", **values
            ) as builder:
                dsn = postgres.url.replace("postgresql+asyncpg://", "postgresql://")
                if not (await h.conversation_sizes(dsn, [external_id])).get(external_id):
                    conversation = h.conversation(args.size, seed=13, text=args.text)
                    seconds = await h.import_conversation(
                        client, builder.root_url, external_id, conversation
                    )
                    h.log(f"{args.size} messages imported in {seconds:.1f}s")
                _, built, _ = await h.wait_idle(client, builder.root_url, limit=7200, poll=2)
                h.log(f"summarized in {built:.1f}s")
            runs: list[dict[str, Any]] = []
            for round_number in range(args.rounds):
                for side, tree in trees.items():
                    with GatewayProcess(
                        database_url=postgres.url,
                        upstream_url=upstream.url,
                        name=side,
                        cwd=tree,
                        **{**values, **settings},
                    ) as gateway:
                        # A few turns first: connections, caches, the working context.
                        await turns(
                            client,
                            gateway,
                            upstream.url,
                            external_id=external_id,
                            questions=questions,
                            count=5,
                        )
                        measured = await turns(
                            client,
                            gateway,
                            upstream.url,
                            external_id=external_id,
                            questions=questions,
                            count=args.turns,
                        )
                    runs.append({"side": side, "round": round_number + 1, **measured})
                    h.log(
                        f"round {round_number + 1} {side}: added p50 "
                        f"{measured['added_ms']['p50']} ms, stages {measured['stages_ms']}"
                    )
    return {
        "benchmark": "side by side",
        "machine": h.machine_info(),
        "settings": {
            "base": args.base,
            "head": args.head or _working_tree(),
            "text": args.text,
            "size": args.size,
            "turns": args.turns,
            "rounds": args.rounds,
            "gateway": settings,
        },
        "runs": runs,
    }


def table(report: dict[str, Any]) -> list[str]:
    """The runs as a Markdown table, then each side's mean of its rounds' p50s."""
    names = sorted({name for run in report["runs"] for name in run["stages_ms"]})
    rows = [
        [
            run["side"],
            run["round"],
            f"{run['added_ms']['p50']} / {run['added_ms']['p95']}",
            f"{run['overhead_ms']['p50']} / {run['overhead_ms']['p95']}",
            *(run["stages_ms"].get(name, "-") for name in names),
        ]
        for run in report["runs"]
    ]
    lines = h.markdown_table(
        ["revision", "round", "added p50 / p95 ms", "overhead p50 / p95 ms", *names], rows
    )
    for side in ("base", "head"):
        p50s = [run["added_ms"]["p50"] for run in report["runs"] if run["side"] == side]
        lines.append(f"\n{side}: added p50 {statistics.fmean(p50s):.1f} ms, mean of {len(p50s)}")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--head", help="another revision (default: the working tree)")
    parser.add_argument("--text", choices=h.TEXTS, default="varied")
    parser.add_argument("--size", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.005, help="upstream latency (s)")
    parser.add_argument("--data-dir", type=Path, help="keep the database here for the next run")
    parser.add_argument("--set", action="append", default=[], help="a gateway setting, NAME=VALUE")
    parser.add_argument("--output", type=Path, default=Path("side-by-side.json"))
    args = parser.parse_args(argv)
    report = asyncio.run(run(args))
    h.write_results(args.output, report)
    print("\n".join(table(report)))


if __name__ == "__main__":
    main()
