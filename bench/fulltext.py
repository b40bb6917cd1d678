"""The full-text leg at another revision beside this tree's, on kept conversations.

    python -m bench.fulltext --base REV --data-dir DIR --conversations ID[,ID...]
                             [--questions overhead|repetitive|locomo] [--locomo FILE]
                             [--rounds 5] [--output FILE] [--tables FILE]

`memory.recall.retrieval.fulltext_candidates` is one SQL statement; a change to it should return
the same candidates, in the same order, in less time. This benchmark takes the statement, and
how many messages the leg reads at most (`FULLTEXT_READS`), as they are at `--base` (from `git
show REV:memory/recall/retrieval.py`) and as they are in this tree, and runs both on the same
database, question by question, in turn (one connection, `--rounds` rounds), so that the
machine's drift falls on both alike. The database is a kept one
(`--data-dir`, as `bench.vectors`, `bench.locomo` and `bench.side_by_side` keep theirs); the
conversations are named by their external ids, each asked:

* `overhead`: `bench.overhead`'s eight questions (its varied text);
* `repetitive`: its questions for the repetitive text;
* `locomo`: the first 40 questions of the LoCoMo sample the id names (`locomo-N`, `--locomo`
  the data file).

Per conversation and revision: wall time of the statement as the driver sees it (p50, mean,
p95 over every question and round; the leg's Python work around it is the same at both), its
shared buffers under `EXPLAIN (ANALYZE, BUFFERS)` (median over the questions), and the share of
questions whose candidates, in order, were the same at both revisions. Results:
`bench/results/fulltext.json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from sqlalchemy import TextClause, event
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import harness as h
from bench.overhead import QUESTIONS, REPETITIVE_QUESTIONS
from devkit.postgres import throwaway_postgres
from memory.db import connect
from memory.recall import recall_note, retrieval

RESULTS: Final = h.RESULTS_DIR / "fulltext.json"
LOCOMO_QUESTIONS: Final = 40
"""Questions asked of each LoCoMo conversation."""


@dataclass(frozen=True)
class Leg:
    """The full-text leg as one revision runs it: its statement and how many messages it reads
    at most (`retrieval.FULLTEXT_READS`)."""

    statement: TextClause
    reads: int


def leg_at(revision: str) -> Leg:
    """The full-text leg as `revision` builds it."""
    source = subprocess.run(
        ["git", "show", f"{revision}:memory/recall/retrieval.py"],
        cwd=h.REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "retrieval_at_base.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("retrieval_at_base", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        try:
            spec.loader.exec_module(module)
        finally:
            del sys.modules[spec.name]
    return Leg(statement=module._FULLTEXT, reads=int(module.FULLTEXT_READS))


def questions_for(kind: str, external_id: str, locomo: Path | None) -> Sequence[str]:
    if kind == "overhead":
        return QUESTIONS
    if kind == "repetitive":
        return REPETITIVE_QUESTIONS
    if locomo is None:
        raise SystemExit("--questions locomo needs --locomo FILE")
    sample = json.loads(locomo.read_text(encoding="utf-8"))[int(external_id.rsplit("-", 1)[1])]
    return [qa["question"] for qa in sample["qa"][:LOCOMO_QUESTIONS]]


class _Statements:
    """The leg's last statement and parameters, as the driver was given them."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.last: tuple[str, Any] = ("", ())
        event.listen(engine.sync_engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        self.last = (statement, parameters)


async def _measure(
    engine: AsyncEngine,
    seen: _Statements,
    legs: dict[str, Leg],
    *,
    tenant_id: int,
    conversation_id: int,
    questions: Sequence[str],
    rounds: int,
) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in legs}
    buffers: dict[str, list[int]] = {name: [] for name in legs}
    same = 0
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        for round_number in range(rounds):
            for question in questions:
                found: dict[str, Any] = {}
                for name, leg in legs.items():
                    retrieval._FULLTEXT = leg.statement
                    # Through the leg once, for the statement and parameters it sends.
                    await retrieval.fulltext_candidates(
                        conn,
                        tenant_id=tenant_id,
                        conversation_ids=[conversation_id],
                        query=question,
                        limit=recall_note.POOL,
                        reads=leg.reads,
                    )
                    sql, parameters = seen.last
                    started = time.perf_counter()
                    found[name] = await driver.fetch(sql, *parameters)
                    times[name].append((time.perf_counter() - started) * 1000)
                    if round_number == 0:
                        plan = await driver.fetchval(
                            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, *parameters
                        )
                        [root] = json.loads(plan) if isinstance(plan, str) else plan
                        buffers[name].append(int(root["Plan"].get("Shared Hit Blocks", 0)))
                if round_number == 0:
                    same += len({repr(rows) for rows in found.values()}) == 1
        await conn.rollback()
    return {
        "questions": len(questions),
        "same": round(same / len(questions), 3),
        **{
            name: {
                "ms": h.summarize(times[name]),
                "buffers": statistics.median(buffers[name]),
            }
            for name in legs
        },
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    original = retrieval._FULLTEXT
    legs = {
        "base": leg_at(args.base),
        "head": Leg(statement=original, reads=retrieval.FULLTEXT_READS),
    }
    results: dict[str, Any] = {}
    with throwaway_postgres(durable=True, folder=args.data_dir) as postgres:
        engine = connect(postgres.url)
        seen = _Statements(engine)
        try:
            async with h.database(postgres.url.replace("+asyncpg", "")) as db:
                query = "SELECT tenant_id, id FROM conversations WHERE external_id = $1"
                ids = {e: await db.fetchrow(query, e) for e in args.conversations.split(",")}
            for external_id, row in ids.items():
                if row is None:
                    raise SystemExit(f"no conversation {external_id!r} in {args.data_dir}")
                results[external_id] = await _measure(
                    engine,
                    seen,
                    legs,
                    tenant_id=int(row[0]),
                    conversation_id=int(row[1]),
                    questions=questions_for(args.questions, external_id, args.locomo),
                    rounds=args.rounds,
                )
                h.log(f"{external_id}: {json.dumps(results[external_id])}")
        finally:
            retrieval._FULLTEXT = original
            await engine.dispose()
    return {
        "benchmark": "fulltext",
        "machine": h.machine_info(),
        "settings": {
            "base": args.base,
            "questions": args.questions,
            "rounds": args.rounds,
            "limit": recall_note.POOL,
        },
        "conversations": results,
    }


def table(report: dict[str, Any]) -> list[str]:
    """Each conversation's figures at both revisions, as Markdown."""
    rows = []
    for external_id, cell in report["conversations"].items():
        base, head = cell["base"], cell["head"]
        rows.append(
            [
                external_id,
                cell["questions"],
                " / ".join(h.ms_cell(base["ms"][k], 2) for k in ("p50", "mean", "p95")),
                " / ".join(h.ms_cell(head["ms"][k], 2) for k in ("p50", "mean", "p95")),
                f"{base['buffers']:.0f} / {head['buffers']:.0f}",
                cell["same"],
            ]
        )
    base = report["settings"]["base"]
    return h.markdown_table(
        [
            "conversation",
            "questions",
            f"{base}: p50 / mean / p95 ms",
            "head: p50 / mean / p95 ms",
            "buffers base / head",
            "same",
        ],
        rows,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the revision to compare against")
    parser.add_argument("--data-dir", type=Path, help="a kept database's folder")
    parser.add_argument("--conversations", help="external ids, comma-separated")
    parser.add_argument(
        "--questions", choices=("overhead", "repetitive", "locomo"), default="overhead"
    )
    parser.add_argument("--locomo", type=Path, help="LoCoMo's data file (--questions locomo)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--tables", type=Path, help="print the Markdown table of a results file")
    args = parser.parse_args()
    if args.tables is None and not (args.base and args.data_dir and args.conversations):
        parser.error("--base, --data-dir and --conversations are needed to run")
    h.run_or_show(args.tables, args.output, lambda: run(args), table)


if __name__ == "__main__":
    main()
