"""Where a message's vector is stored, and what retrieval then reads.

    python -m bench.vectors [--sizes 1000,10000] [--rounds 3] [--turns 40] [--data-dir DIR]
                            [--output FILE] [--tables FILE]

pgvector stores a vector out of line (storage EXTERNAL) once its row passes ~2 kB, and a
message's row with its vector usually does; memstrata keeps the row whole (migration 0014).
This benchmark measures the `LAYOUTS` on one database: conversations of `--sizes` messages of
`bench.overhead`'s varied text, imported through a real `memstrata serve` and fully embedded
and summarized (`--data-dir` keeps them for the next run). Each round rewrites `nodes` in each
layout in turn (`ALTER TABLE`, `VACUUM FULL`, `ANALYZE`) and runs `bench.overhead`'s eight
questions, in this process, through:

* the vector legs with the recall note's pool of 400 (`memory.recall.nearest.vector_legs`:
  an exact scan up to `EXACT_SCAN_MAX` messages, the HNSW index above), and the exact scan
  forced at every size;
* the similarities of 400 given messages by id, as a turn computes them for the candidates
  prepared after the last reply (`prepared`: `memory.recall.recall_note`'s prepared leg);
* the full-text leg with the same pool (`retrieval.fulltext_candidates`);
* `retrieval.search` with limit 8, what `memory_search` and the admin search run.

Per layout, leg and size: wall time p50 (client side, one connection; each round's p50, and
their median), the shared buffers and server time of the leg's last statement under `EXPLAIN
(ANALYZE, BUFFERS)` (median over the questions), and the share of questions whose candidates
were the same as in the first run (the legs measured before any turn is served: the layout
moves bytes, not results; the HNSW index is rebuilt by each rewrite, and may differ). Then,
with `--turns`, each layout again serves `--turns` turns of the same questions per conversation
through `memstrata serve` (`MEMSTRATA_WORKERS=0`), as `bench.side_by_side` sends them: added
latency and the request path's stages. Results: `bench/results/vectors.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Final

import httpx
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from bench import harness as h
from bench.overhead import QUESTIONS
from bench.side_by_side import turns
from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.upstream import UpstreamServer
from memory.db import connect
from memory.embeddings import LocalEmbedder
from memory.recall import nearest, recall_note, retrieval
from memory.recall.fusion import Candidates

RESULTS: Final = h.RESULTS_DIR / "vectors.json"
LAYOUTS: Final = {
    "out of line": ("EXTERNAL", None),
    "vector MAIN": ("MAIN", None),
    "vector MAIN, 4 kB rows": ("MAIN", 4080),
}
"""How `nodes` may store a message's row: pgvector's default (before migration 0014), the
vector's storage MAIN alone, and migration 0014's (MAIN, `toast_tuple_target` 4080)."""
_GATEWAY: Final[dict[str, Any]] = {"log_level": "warning", "summary_mode": "extractive"}
POOL: Final = 400
"""The recall note's candidates a leg (`memory.recall.recall_note.POOL`)."""


async def _rewrite(dsn: str, layout: str) -> dict[str, int]:
    """`nodes` rewritten in `layout`; its heap and TOAST sizes, and how many of its vectors and
    search vectors are out of line."""
    storage, target = LAYOUTS[layout]
    async with h.database(dsn) as db:
        await db.execute(f"ALTER TABLE nodes ALTER COLUMN embedding SET STORAGE {storage}")
        await db.execute(
            f"ALTER TABLE nodes SET (toast_tuple_target = {target})"
            if target
            else "ALTER TABLE nodes RESET (toast_tuple_target)"
        )
        await db.execute("VACUUM FULL nodes")
        await db.execute("ANALYZE nodes")
        row = await db.fetchrow(
            "SELECT pg_relation_size('nodes') AS heap, pg_relation_size(reltoastrelid) AS toast, "
            "(SELECT count(*) FILTER (WHERE pg_column_toast_chunk_id(embedding) IS NOT NULL) "
            " FROM nodes) AS vectors_out, "
            "(SELECT count(*) FILTER (WHERE pg_column_toast_chunk_id(tsv) IS NOT NULL) "
            " FROM nodes) AS tsv_out, "
            "(SELECT count(*) FROM nodes WHERE embedding IS NOT NULL) AS vectors, "
            "(SELECT count(*) FROM nodes) AS nodes "
            "FROM pg_class WHERE relname = 'nodes'"
        )
    return dict(row)


class _Explained:
    """The last statement an engine ran, to be run again under `EXPLAIN`."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.last: tuple[str, Any] | None = None
        event.listen(engine.sync_engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        self.last = (statement, parameters)

    async def figures(self, conn: AsyncConnection) -> tuple[int, float]:
        """Shared buffers touched and server milliseconds of the last statement, run again in
        its transaction."""
        assert self.last is not None
        statement, parameters = self.last
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None
        if "enable_sort" in statement:
            # The index scan is planned with sorting off (`nearest._INDEX_SETTINGS`); the
            # statement turned it back on as it ran.
            await driver.execute("SELECT set_config('enable_sort', 'off', true)")
        found = await driver.fetchval(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, *list(parameters or ())
        )
        [plan] = json.loads(found) if isinstance(found, str) else found
        top = plan["Plan"]
        buffers = int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))
        return buffers, float(plan["Execution Time"])


def _keys(legs: Sequence[Candidates]) -> list[list[tuple[int, int, int]]]:
    return [[place.key for place in leg.ranked] for leg in legs]


SERVED_STAGES: Final = ("assemble", "note", "vector", "fulltext", "load")
"""The request path's stages shown per turn served (`memory.stages`)."""
LEGS: Final = ("vector", "vector, exact", "prepared", "full text", "search, limit 8")
"""`prepared` scores 400 given messages by id, as a turn does with the candidates prepared
after the last reply (`memory.recall.anticipation`): a fixed sample of the conversation's."""
EXPLAINED: Final = ("vector", "vector, exact", "prepared", "full text")
"""The legs whose (last) statement is run again under `EXPLAIN`."""


async def _leg(
    conn: AsyncConnection,
    name: str,
    *,
    tenant_id: int,
    conversation_id: int,
    messages: int,
    question: str,
    vector: Sequence[float],
    prepared: Sequence[int],
) -> list[list[Any]]:
    """One leg for one question, run as retrieval runs it; what it returned, as keys."""
    scope: dict[str, Any] = {"tenant_id": tenant_id, "conversation_ids": [conversation_id]}
    if name == "full text":
        found = await retrieval.fulltext_candidates(conn, **scope, query=question, limit=POOL)
        return _keys([found])
    if name == "prepared":
        found, _ = await recall_note._prepared_leg(
            conn, tenant_id=tenant_id, ids=prepared, vector=vector, abandoned=False
        )
        return _keys([found])
    if name == "search, limit 8":
        hits = await retrieval.search(conn, **scope, query=question, query_vector=vector, limit=8)
        return [[hit.node_id for hit in hits]]
    # `messages` 0 always scans exactly; the scope's size chooses as the request path does.
    scanned = 0 if name == "vector, exact" else messages
    legs = await nearest.vector_legs(
        conn, **scope, query_vector=vector, limit=POOL, messages=scanned
    )
    return _keys(legs)


async def _measure(
    engine: AsyncEngine,
    explained: _Explained,
    *,
    tenant_id: int,
    conversation_id: int,
    messages: int,
    vectors: Sequence[Sequence[float]],
    prepared: Sequence[int],
) -> dict[str, Any]:
    """Each leg for each question, twice (the first pass warms the cache); the second timed,
    each in a transaction of its own, rolled back."""
    out: dict[str, Any] = {}
    for name in LEGS:
        times: list[float] = []
        figures: list[tuple[int, float]] = []
        results: list[list[list[Any]]] = []
        for timed in (False, True):
            for question, vector in zip(QUESTIONS, vectors, strict=True):
                async with engine.connect() as conn:
                    started = time.perf_counter()
                    found = await _leg(
                        conn,
                        name,
                        tenant_id=tenant_id,
                        conversation_id=conversation_id,
                        messages=messages,
                        question=question,
                        vector=vector,
                        prepared=prepared,
                    )
                    ms = (time.perf_counter() - started) * 1000
                    if timed and name in EXPLAINED:
                        figures.append(await explained.figures(conn))
                    await conn.rollback()
                if timed:
                    times.append(ms)
                    results.append(found)
        out[name] = {
            "ms": h.summarize(times),
            "buffers": statistics.median(b for b, _ in figures) if figures else None,
            "server_ms": round(statistics.median(t for _, t in figures), 2) if figures else None,
            "results": results,
        }
    return out


async def _build(
    client: httpx.AsyncClient,
    url: str,
    upstream_url: str,
    external_ids: dict[int, str],
    data_dir: str,
) -> None:
    """The conversations imported (unless kept from a run before), embedded and summarized."""
    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    with GatewayProcess(
        database_url=url, upstream_url=upstream_url, name="builder", data_dir=data_dir, **_GATEWAY
    ) as builder:
        stored = await h.conversation_sizes(dsn, list(external_ids.values()))
        for size, external_id in external_ids.items():
            if not stored.get(external_id):
                conversation = h.conversation(size, seed=13, text="varied")
                seconds = await h.import_conversation(
                    client, builder.root_url, external_id, conversation
                )
                h.log(f"{size} messages imported in {seconds:.1f}s")
        _, built, _ = await h.wait_idle(client, builder.root_url, limit=7200, poll=2)
        h.log(f"embedded and summarized in {built:.1f}s")


async def _served(
    client: httpx.AsyncClient,
    url: str,
    upstream_url: str,
    external_ids: dict[int, str],
    data_dir: str,
    count: int,
) -> dict[str, Any]:
    """`count` turns of `bench.overhead`'s questions on each conversation through `memstrata
    serve` (`MEMSTRATA_WORKERS=0`: nothing else runs meanwhile), as `bench.side_by_side` sends
    them: added latency, `X-Memstrata-Overhead-Ms` and the request path's stages."""
    served: dict[str, Any] = {}
    with GatewayProcess(
        database_url=url,
        upstream_url=upstream_url,
        name="served",
        workers=0,
        data_dir=data_dir,
        **_GATEWAY,
    ) as gateway:
        for size, external_id in external_ids.items():
            for warm in (True, False):
                measured = await turns(
                    client,
                    gateway,
                    upstream_url,
                    external_id=external_id,
                    questions=QUESTIONS,
                    count=5 if warm else count,
                )
            served[str(size)] = measured
    return served


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(size) for size in args.sizes.split(",")]
    external_ids = {size: f"vectors-varied-{size}" for size in sizes}
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        postgres = stack.enter_context(
            throwaway_postgres(prefix="memstrata-vectors-", durable=True, folder=args.data_dir)
        )
        upstream = stack.enter_context(UpstreamServer(latency=0.005))
        dsn = postgres.url.replace("postgresql+asyncpg://", "postgresql://")
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            data_dir = str(postgres.data_dir.parent / "gateway-data")
            await _build(client, postgres.url, upstream.url, external_ids, data_dir)
            async with h.database(dsn) as db:
                query = "SELECT tenant_id, id FROM conversations WHERE external_id = $1"
                ids = {size: tuple(await db.fetchrow(query, e)) for size, e in external_ids.items()}
                sample = (
                    "SELECT id FROM nodes WHERE conversation_id = $1 AND level = 0 "
                    "AND embedding IS NOT NULL ORDER BY md5(id::text) LIMIT 400"
                )
                prepared = {
                    size: [row[0] for row in await db.fetch(sample, ids[size][1])] for size in sizes
                }
            vectors = await LocalEmbedder().embed(list(QUESTIONS))
            engine = connect(postgres.url)
            explained = _Explained(engine)
            try:
                # The legs first, every round, with nothing stored in between: their results
                # can be compared. Then the turns served, which store what they send.
                for round_number in range(1, args.rounds + 1):
                    for layout in LAYOUTS:
                        table = await _rewrite(dsn, layout)
                        legs = {
                            str(size): await _measure(
                                engine,
                                explained,
                                tenant_id=ids[size][0],
                                conversation_id=ids[size][1],
                                messages=size,
                                vectors=vectors,
                                prepared=prepared[size],
                            )
                            for size in sizes
                        }
                        runs.append(
                            {
                                "layout": layout,
                                "round": round_number,
                                "table": table,
                                "sizes": legs,
                                "served": {},
                            }
                        )
                        h.log(f"round {round_number} {layout}: {table}")
                for run_ in runs if args.turns else []:
                    await _rewrite(dsn, run_["layout"])
                    run_["served"] = await _served(
                        client, postgres.url, upstream.url, external_ids, data_dir, args.turns
                    )
                    h.log(f"round {run_['round']} {run_['layout']}: served")
            finally:
                await engine.dispose()
                # The database as the migrations leave it, for the next run.
                await _rewrite(dsn, "vector MAIN, 4 kB rows")
    _compare(runs)
    return {
        "benchmark": "vectors",
        "machine": h.machine_info(),
        "settings": {"sizes": sizes, "rounds": args.rounds, "pool": POOL, "turns": args.turns},
        "runs": runs,
    }


def _compare(runs: list[dict[str, Any]]) -> None:
    """Each leg's results against the first run's, per size and question: `same` is the share
    of questions whose candidates came back identical (the results themselves are dropped)."""
    first = runs[0]["sizes"]
    for run_ in runs:
        for size, legs in run_["sizes"].items():
            for name, leg in legs.items():
                base = first[size][name]["results"]
                same = [mine == theirs for mine, theirs in zip(leg["results"], base, strict=True)]
                leg["same"] = round(sum(same) / len(same), 3)
    for run_ in runs:
        for legs in run_["sizes"].values():
            for leg in legs.values():
                leg.pop("results")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


def table(report: dict[str, Any]) -> list[str]:
    """The runs as Markdown, per layout: each leg per size (wall p50 per round and their
    median, buffers, server ms, same results), the turns served, and the table."""
    runs = report["runs"]
    layouts = list(dict.fromkeys(run_["layout"] for run_ in runs))
    rows = []
    for size in runs[0]["sizes"]:
        for name in LEGS:
            for layout in layouts:
                legs = [run_["sizes"][size][name] for run_ in runs if run_["layout"] == layout]
                p50s = [leg["ms"]["p50"] for leg in legs]
                buffers = [leg["buffers"] for leg in legs if leg["buffers"] is not None]
                server = [leg["server_ms"] for leg in legs if leg["server_ms"] is not None]
                rows.append(
                    [
                        f"{int(size):,}",
                        name,
                        layout,
                        f"{_median(p50s)} ({' / '.join(str(round(p, 1)) for p in p50s)})",
                        f"{statistics.median(buffers):,.0f}" if buffers else "-",
                        _median(server) if server else "-",
                        " / ".join(str(leg["same"]) for leg in legs),
                    ]
                )
    lines = h.markdown_table(
        ["messages", "leg", "layout", "wall p50 ms (rounds)", "buffers", "server ms", "same"],
        rows,
    )
    served = []
    for size in runs[0]["served"]:
        for layout in layouts:
            turns_ = [run_["served"][size] for run_ in runs if run_["layout"] == layout]
            added = [figures["added_ms"]["p50"] for figures in turns_]
            served.append(
                [
                    f"{int(size):,}",
                    layout,
                    f"{_median(added)} ({' / '.join(str(round(a, 1)) for a in added)})",
                    *(
                        _median([figures["stages_ms"].get(stage, 0.0) for figures in turns_])
                        for stage in SERVED_STAGES
                    ),
                ]
            )
    if served:
        lines.append("")
        lines += h.markdown_table(
            [
                "messages",
                "layout",
                "added p50 ms (rounds)",
                *(f"{stage} ms" for stage in SERVED_STAGES),
            ],
            served,
        )
    lines.append("")
    lines += h.markdown_table(
        ["layout", "heap MiB", "TOAST MiB", "vectors out of line", "search vectors out of line"],
        [
            [
                run_["layout"],
                round(run_["table"]["heap"] / 2**20, 1),
                round(run_["table"]["toast"] / 2**20, 1),
                f"{run_['table']['vectors_out']:,} of {run_['table']['vectors']:,}",
                f"{run_['table']['tsv_out']:,} of {run_['table']['nodes']:,}",
            ]
            for run_ in runs
            if run_["round"] == 1
        ],
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=40, help="turns served per size (0: none)")
    parser.add_argument("--data-dir", type=Path, help="keep the database here for the next run")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--tables", type=Path, help="print the Markdown tables of a results file")
    args = parser.parse_args()
    h.run_or_show(args.tables, args.output, lambda: run(args), table)


if __name__ == "__main__":
    main()
