"""What one prompt build costs, counted in what a busy machine does not change.

    python -m bench --only overhead,costs

Times on a shared machine move with its load; what a prompt build reads and runs does not.
For each conversation of `bench.overhead`'s repetitive sizes, both texts, this scenario runs
the gateway's dry run (`memory.recall.assemble.dry_run`, the question as the next user message,
nothing stored) in this process against the benchmark's database, the overhead questions in
turn, and records per build:

* SQL statements and transactions, and the CPU time of this process (the query's embedding
  included: it runs in a thread of the same process);
* for the last build, every statement replayed under `EXPLAIN (ANALYZE, BUFFERS)` in a rolled
  back transaction: shared buffers touched, rows read from `nodes` (returned or filtered out,
  over every loop of every scan of it) and the server's execution time;
* the full-text leg's buffers and rows of `nodes` read for every question, as built and when
  every word is read (`reads` unbounded: the ranking the leg keeps whenever every word fits
  its reads, and what it cost to read before common words were skipped);
* the wall time, beside the load average it was measured at.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench import harness as h
from bench import overhead
from memory.db import connect, transaction
from memory.embeddings import LocalEmbedder
from memory.recall import assemble, retrieval, tools
from memory.schema import DEFAULT_TENANT

_RULES = assemble.BudgetRules(default=8000, window=128_000, output_reserve=16_384)
_EVERY_WORD = 10**9
MODES: tuple[Literal["rebuild", "working"], ...] = ("rebuild", "working")
"""The paths a build takes: `rebuild` (`MEMSTRATA_CONTEXT_MODE=rebuild`) runs every leg of
retrieval for the question, as a topic change, `memory_search` and the admin search do;
`working` (the default) builds a conversation's first working context, a compaction and a
recall note (the dry run stores nothing, so every build is such a first turn)."""


class _Statements:
    """The statements and transactions an engine runs, as its events report them."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.run: list[tuple[str, Any]] = []
        self.transactions = 0
        event.listen(engine.sync_engine, "before_cursor_execute", self._statement)
        event.listen(engine.sync_engine, "begin", self._begin)

    def _statement(
        self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any
    ) -> None:
        self.run.append((statement, parameters))

    def _begin(self, _conn: Any) -> None:
        self.transactions += 1

    def reset(self) -> None:
        self.run.clear()
        self.transactions = 0


def _walk(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _walk(child)


def _plan_figures(plan: Mapping[str, Any]) -> dict[str, Any]:
    root = plan["Plan"]
    return {
        "server_ms": round(plan["Execution Time"], 2),
        "buffers": root.get("Shared Hit Blocks", 0) + root.get("Shared Read Blocks", 0),
        "nodes_rows_read": int(
            sum(
                (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
                for node in _walk(root)
                if node.get("Relation Name") == "nodes"
            )
        ),
    }


async def _explained(engine: AsyncEngine, run: Sequence[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Every statement of `run` again, the reading ones under EXPLAIN, in a transaction that is
    rolled back (the settings a statement makes hold for the ones after it, as they did)."""
    figures = []
    async with engine.connect() as conn:
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        replay = driver.transaction()
        await replay.start()
        try:
            for statement, parameters in run:
                args = list(parameters) if isinstance(parameters, list | tuple) else []
                reads = statement.lstrip().split(None, 1)[0].upper() in ("SELECT", "WITH")
                if not reads or "set_config" in statement:
                    await driver.execute(statement, *args) if args else await driver.execute(
                        statement
                    )
                    continue
                found = await driver.fetchval(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, *args
                )
                [plan] = json.loads(found) if isinstance(found, str) else found
                figures.append(
                    {"statement": re.sub(r"\s+", " ", statement.strip())[:70]} | _plan_figures(plan)
                )
        finally:
            await replay.rollback()
    return figures


async def _fulltext(
    engine: AsyncEngine, *, tenant_id: int, external_id: str, query: str, reads: int
) -> dict[str, Any]:
    """The full-text leg's statement for `query` under EXPLAIN, as the prompt builder runs it
    (its recent turns left out aside)."""
    async with transaction(engine) as conn:
        conversation_id, next_seq = (
            await conn.execute(
                text(
                    "SELECT id, next_seq FROM conversations "
                    "WHERE tenant_id = :tenant_id AND external_id = :external_id"
                ),
                {"tenant_id": tenant_id, "external_id": external_id},
            )
        ).one()
        found = await conn.scalar(
            text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + str(retrieval._FULLTEXT.text)),
            {
                "tenant_id": tenant_id,
                "conversation_ids": [conversation_id],
                "levels": None,
                "abandoned": False,
                "exclude_conversation": conversation_id,
                "exclude_from": next_seq,
                "query": query,
                "websearch": retrieval.websearch_query(query),
                "identifiers": retrieval.identifiers(query),
                "limit": 400,
                "reads": reads,
            },
        )
    [plan] = json.loads(found) if isinstance(found, str) else found
    return _plan_figures(plan)


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


async def run(stack: h.Stack, config: overhead.OverheadConfig, *, builds: int) -> dict[str, Any]:
    """The figures of every conversation (see the module docstring)."""
    engine = connect(stack.database_url)
    statements = _Statements(engine)
    embedder = LocalEmbedder()
    await embedder.warmup()
    tools_room = tools.tool_tokens(h.MODEL)
    results = []
    try:
        async with transaction(engine) as conn:
            tenant_id = int(
                await conn.scalar(
                    text("SELECT id FROM tenants WHERE name = :n"), {"n": DEFAULT_TENANT}
                )
            )
        for size in config.repetitive:
            for kind in h.TEXTS:
                [external_id] = config.conversation_ids(size, kind)[:1]
                asked = overhead.questions(kind)
                leg = {
                    name: [
                        await _fulltext(
                            engine,
                            tenant_id=tenant_id,
                            external_id=external_id,
                            query=question,
                            reads=reads,
                        )
                        for question in asked
                    ]
                    for name, reads in (
                        ("as built", retrieval.FULLTEXT_READS),
                        ("every word", _EVERY_WORD),
                    )
                }
                for mode in MODES:
                    walls, cpus, counts, transactions = [], [], [], []
                    for number in range(builds + 3):
                        statements.reset()
                        cpu, wall = time.process_time(), time.perf_counter()
                        await assemble.dry_run(
                            engine,
                            tenant_id=tenant_id,
                            external_id=external_id,
                            query=asked[number % len(asked)],
                            budget=None,
                            rules=_RULES,
                            tools_room=tools_room,
                            recall=assemble.Recall(embedder=embedder, mode=mode),
                            model=h.MODEL,
                        )
                        if number >= 3:  # the first builds warm caches
                            walls.append((time.perf_counter() - wall) * 1000)
                            cpus.append((time.process_time() - cpu) * 1000)
                            counts.append(len(statements.run))
                            transactions.append(statements.transactions)
                    load = os.getloadavg()[0]
                    replayed = await _explained(engine, statements.run)
                    entry = {
                        "size": size,
                        "text": kind,
                        "mode": mode,
                        "builds": len(walls),
                        "wall_ms": {"p50": _median(walls), "p95": h.summarize(walls)["p95"]},
                        "load_average_1min": round(load, 2),
                        "cpu_ms_p50": _median(cpus),
                        "statements": statistics.mean(counts),
                        "transactions": statistics.mean(transactions),
                        "replayed": replayed,
                        "fulltext": {
                            name: {
                                key: _median([figures[key] for figures in runs])
                                for key in ("buffers", "nodes_rows_read", "server_ms")
                            }
                            for name, runs in leg.items()
                        },
                    }
                    h.log(
                        f"  costs {size:>6} {kind:<10} {mode:<8} cpu {entry['cpu_ms_p50']} ms, "
                        f"{entry['statements']} statements, full text {entry['fulltext']}"
                    )
                    results.append(entry)
    finally:
        await engine.dispose()
    return {"reads": retrieval.FULLTEXT_READS, "conversations": results}


def render(data: Mapping[str, Any]) -> list[str]:
    """The tables of `docs/benchmarks.md` for these figures."""
    rows = []
    leg_rows = []
    for entry in data["conversations"]:
        replayed = entry["replayed"]
        buffers = sum(item["buffers"] for item in replayed)
        rows.append(
            [
                f"{entry['size']:,}",
                entry["text"],
                entry.get("mode", "rebuild"),
                f"{entry['statements']:.0f} / {entry['transactions']:.0f}",
                f"{buffers:,}",
                f"{sum(item['nodes_rows_read'] for item in replayed):,}",
                f"{entry['cpu_ms_p50']:.1f}",
                f"{entry['wall_ms']['p50']:.1f} / {entry['wall_ms']['p95']:.1f}",
                f"{entry['load_average_1min']:.1f}",
            ]
        )
        if entry.get("mode", "rebuild") != "rebuild":
            continue  # the leg's figures do not depend on the path
        built, every = entry["fulltext"]["as built"], entry["fulltext"]["every word"]
        leg_rows.append(
            [
                f"{entry['size']:,}",
                entry["text"],
                f"{built['nodes_rows_read']:,.0f} / {every['nodes_rows_read']:,.0f}",
                f"{built['buffers']:,.0f} / {every['buffers']:,.0f}",
                f"{built['server_ms']:.1f} / {every['server_ms']:.1f}",
            ]
        )
    return [
        "What one prompt build costs, counted in what the machine's load does not change "
        "(`bench/costs.py`: the gateway's dry run in-process on the benchmark's conversations, "
        "the overhead questions in turn; buffers and rows from `EXPLAIN (ANALYZE, BUFFERS)` of "
        "the last build's statements replayed; CPU of the process, the query's embedding "
        "included). `rebuild`: every leg of retrieval for the question (a topic change, "
        "`memory_search`, the admin search); `working`: a conversation's first working context "
        "(a compaction and a recall note), the default mode's most expensive turn:",
        "",
        *h.markdown_table(
            [
                "stored",
                "text",
                "path",
                "statements / transactions",
                "buffers",
                "rows of `nodes` read",
                "CPU ms (p50)",
                "wall p50 / p95 ms",
                "load average",
            ],
            rows,
        ),
        "",
        f"The full-text leg per question (medians), reading the rarer words within "
        f"{data['reads']:,} messages as built / reading every word (the leg before common "
        "words were skipped, on the same index):",
        "",
        *h.markdown_table(
            ["stored", "text", "rows of `nodes` read", "buffers", "server ms"], leg_rows
        ),
    ]
