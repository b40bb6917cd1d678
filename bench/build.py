"""Prompt-build latency in-process: `memory.recall.prompt.build` and
`memory.recall.retrieval.search` timed on a database that already holds a large conversation (no
gateway, no HTTP).

    python -m bench.build setup --data-dir /tmp/b --messages 10000 [--tenant 100000]
    python -m bench.build run --data-dir /tmp/b [--budget 8000] [--rounds 3] [--stages]
                              [--tenant] [--chosen out.json]

`setup` imports one synthetic conversation (`bench-<messages>`, the one `bench/scale.py` uses)
into the embedded Postgres under `--data-dir` and builds its summary tree with the extractive
summarizer and the local embedder (minutes). `--tenant N` then fills the tenant up to N
messages with more synthetic conversations whose nodes take the first conversation's
vectors (plus a little noise: embedding 100,000 messages here would take most of an hour), and
their summaries likewise, so that retrieval over the tenant searches N embedded messages.

`run` builds the prompt for questions about facts planted in the synthetic conversations (and
a few generic ones), as the gateway does for a new user message (query embedded by the local
embedder, overlapped with the full-text leg), `--rounds` times, and reports p50/p95 in ms;
`--stages` adds the wall time inside each retrieval/tokenizer stage per build; `--tenant`
also times `retrieval.search` over every conversation of the tenant (as `bench/scale.py`),
every node cold, then with lifecycle tiers (the nodes found for half of the questions made warm:
those asked again, and the other half, still cold);
`--chosen` writes the node ids each prompt chose, to compare two versions of the code;
`--profile` writes a pyinstrument profile of the measured builds.
The machine is shared: compare versions back to back and read the load printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import text

from bench import harness as h
from bench.scale import _questions
from devkit import synthetic
from memory import tiers, tokens
from memory.db import connect
from memory.embeddings import LocalEmbedder
from memory.postgres import EmbeddedPostgres
from memory.recall import prompt, retrieval, tiered

SYSTEM = [{"role": "system", "content": h.SYSTEM_PROMPT}]


def _conversation_file(folder: Path, size: int, seed: int) -> Path:
    path = folder / f"conversation-{seed}.jsonl"
    with path.open("w") as out:
        for message in h.conversation(size, seed=seed):
            out.write(json.dumps(message) + "\n")
    return path


def setup(data_dir: Path, messages: int, tenant: int | None) -> None:
    """Import and summarize `bench-<messages>`; then the tenant's copies (see the docstring)."""
    import subprocess

    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o755)
    env = {
        **os.environ,
        "MEMSTRATA_DATA_DIR": str(data_dir),
        "MEMSTRATA_SUMMARY_MODE": "extractive",
        "MEMSTRATA_LOG_LEVEL": "warning",
    }
    # The code of the working tree this runs from (the `memstrata` script imports the checkout
    # the venv was installed from: another worktree's code, and its migrations).
    memstrata = [sys.executable, "-m", "gateway.cli"]
    if not asyncio.run(_count_conversations(data_dir)):
        first = _conversation_file(data_dir, messages, messages * 1000)
        subprocess.run(
            [*memstrata, "import", str(first), "--conversation", f"bench-{messages}", "--wait"],
            env=env,
            check=True,
        )
    if tenant is None or tenant <= messages:
        return
    count = -(-(tenant - messages) // messages)
    for number in range(count):
        path = _conversation_file(data_dir, messages, 900_000 + number)
        subprocess.run(
            [*memstrata, "import", str(path), "--conversation", f"tenant-{number}"],
            env=env,
            check=True,
        )
    asyncio.run(_fill_tenant(data_dir))


async def _count_conversations(data_dir: Path) -> int:
    if not (data_dir / "postgres.port").exists():
        return 0
    server = EmbeddedPostgres(data_dir)
    server.start()
    engine = connect(server.url)
    try:
        async with engine.connect() as conn:
            return int(await conn.scalar(text("SELECT count(*) FROM conversations")) or 0)
    finally:
        await engine.dispose()
        server.stop_if_started()


async def _fill_tenant(data_dir: Path) -> None:
    """Give the tenant's other conversations the first conversation's vectors (by seq, plus
    noise) and copies of its summaries, and drop their queued jobs."""
    server = EmbeddedPostgres(data_dir)
    server.start()
    engine = connect(server.url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM jobs"))
            source_id = await conn.scalar(
                text(
                    "SELECT id FROM conversations WHERE external_id NOT LIKE 'tenant-%' "
                    "ORDER BY id LIMIT 1"
                )
            )
            rows = (
                await conn.execute(
                    text(
                        "SELECT level, seq, embedding::text AS e FROM nodes "
                        "WHERE conversation_id = :c AND embedding IS NOT NULL"
                    ),
                    {"c": source_id},
                )
            ).all()
            vectors = {(r.level, r.seq): np.array(json.loads(r.e), dtype=np.float32) for r in rows}
            others = [
                int(r.id)
                for r in await conn.execute(
                    text(
                        "SELECT id FROM conversations WHERE id <> :c AND tenant_id ="
                        " (SELECT tenant_id FROM conversations WHERE id = :c)"
                    ),
                    {"c": source_id},
                )
            ]
            # One index build after the updates is much faster than 140,000 index inserts.
            hnsw = (
                await conn.execute(
                    text(
                        "SELECT indexname, indexdef FROM pg_indexes "
                        "WHERE tablename = 'nodes' AND indexdef LIKE '%hnsw%'"
                    )
                )
            ).one()
            await conn.execute(text(f"DROP INDEX {hnsw.indexname}"))
            rng = np.random.default_rng(7)
            for other in others:
                await conn.execute(
                    text(
                        "INSERT INTO nodes (tenant_id, conversation_id, level, seq, span_start,"
                        " span_end, role, name, content, text, token_count, created_at, method,"
                        " model, importance, pinned, status, facts, meta)"
                        " SELECT tenant_id, :o, level, seq, span_start, span_end, role, name,"
                        " content, text, token_count, created_at, method, model, importance,"
                        " pinned, status, facts, meta FROM nodes WHERE conversation_id = :c"
                        " AND level > 0 ON CONFLICT DO NOTHING"
                    ),
                    {"o": other, "c": source_id},
                )
                params = []
                for (level, seq), vector in vectors.items():
                    noisy = vector + rng.normal(0, 0.02, vector.shape).astype(np.float32)
                    noisy /= np.linalg.norm(noisy)
                    params.append(
                        {
                            "o": other,
                            "l": level,
                            "s": seq,
                            "v": "[" + ",".join(f"{x:.5f}" for x in noisy) + "]",
                        }
                    )
                await conn.execute(
                    text(
                        "UPDATE nodes SET embedding = CAST(:v AS vector) "
                        "WHERE conversation_id = :o AND level = :l AND seq = :s"
                    ),
                    params,
                )
                h.log(f"tenant: conversation {other} filled")
            await conn.execute(text("SET maintenance_work_mem = '512MB'"))
            await conn.execute(text(hnsw.indexdef))
        async with engine.connect() as conn:
            await conn.execute(text("COMMIT"))
            await conn.execute(text("VACUUM ANALYZE nodes"))
    finally:
        await engine.dispose()
        server.stop_if_started()


class Stages:
    """Wall ms inside wrapped functions, per build."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        label = f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"
        if asyncio.iscoroutinefunction(original):

            @functools.wraps(original)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    self.seconds[label] += time.perf_counter() - started
                    self.calls[label] += 1

            setattr(owner, name, timed_async)
        else:

            @functools.wraps(original)
            def timed(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.seconds[label] += time.perf_counter() - started
                    self.calls[label] += 1

            setattr(owner, name, timed)

    def report(self, builds: int) -> dict[str, dict[str, float]]:
        return {
            label: {
                "ms_per_build": round(seconds * 1000 / builds, 2),
                "calls_per_build": round(self.calls[label] / builds, 2),
            }
            for label, seconds in sorted(self.seconds.items(), key=lambda item: -item[1])
        }


async def run(arguments: argparse.Namespace) -> dict[str, Any]:
    server = EmbeddedPostgres(arguments.data_dir)
    server.start()
    engine = connect(server.url, pool_size=2)
    embedder = LocalEmbedder()
    await embedder.warmup()
    stages = Stages()
    timed_embed: Callable[[str], Any]

    async def embed(query: str) -> list[float]:
        return (await embedder.embed([query]))[0]

    timed_embed = embed
    if arguments.stages:
        for name in ("fulltext_candidates", "vector_legs", "load", "fuse"):
            stages.wrap(retrieval, name)
        stages.wrap(tokens, "count_messages")
        stages.wrap(prompt, "_recent")

        async def embed_timed(query: str) -> list[float]:
            started = time.perf_counter()
            try:
                return await embed(query)
            finally:
                stages.seconds["embed (overlapped)"] += time.perf_counter() - started
                stages.calls["embed (overlapped)"] += 1

        timed_embed = embed_timed
    result: dict[str, Any] = {"uptime": os.getloadavg()}
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT id, tenant_id, next_seq, token_count FROM conversations "
                        "WHERE external_id = :e"
                    ),
                    {"e": arguments.conversation},
                )
            ).one()
            await conn.rollback()
        questions = _questions(arguments.queries)
        latencies: list[float] = []
        chosen: dict[str, Any] = {}
        profiler = None
        for round_number in range(arguments.rounds + 1):  # round 0 warms up
            if round_number == 1:
                stages.seconds.clear()
                stages.calls.clear()
                if arguments.profile:
                    from pyinstrument import Profiler

                    profiler = Profiler(interval=0.0005)
                    profiler.start()
            for question in questions:
                async with engine.connect() as conn:
                    started = time.perf_counter()
                    built = await prompt.build(
                        conn,
                        tenant_id=int(row.tenant_id),
                        conversation_id=int(row.id),
                        system=SYSTEM,
                        new_messages=[{"role": "user", "content": question}],
                        new_from=int(row.next_seq),
                        query=question,
                        embed=timed_embed,
                        budget=arguments.budget,
                        model="gpt-4o",
                        stored_messages=int(row.next_seq),
                        stored_tokens=int(row.token_count),
                    )
                    elapsed = (time.perf_counter() - started) * 1000
                    await conn.rollback()
                if round_number:
                    latencies.append(elapsed)
                chosen[question] = {
                    "retrieved": built.retrieved,
                    "summaries": built.summaries,
                    "milestones": built.milestones,
                    "tokens": built.tokens,
                }
        if profiler is not None:
            profiler.stop()
            result["profile"] = profiler.output_text(show_all=False)
        result["build_ms"] = h.summarize(latencies)
        if arguments.stages:
            result["stages"] = stages.report(len(latencies))
        result["chosen"] = chosen
        if arguments.tenant:
            result["tenant_search_ms"] = await _tenant_search(
                engine, embedder, int(row.tenant_id), questions, arguments.rounds
            )
    finally:
        await engine.dispose()
        server.stop_if_started()
    result["uptime_after"] = os.getloadavg()
    return result


async def _tenant_search(
    engine: Any, embedder: LocalEmbedder, tenant_id: int, questions: list[str], rounds: int
) -> dict[str, Any]:
    """`retrieval.search` over every conversation of the tenant, as `bench/scale.py` times it
    (the query embedded beforehand), first with every node cold; then with tiers
    (`memory.tiers`): the nodes the first half of the questions found are accessed, as if placed
    in prompts (warm), and both halves are timed again. The first half is then answered from
    the warm tier; the second half asks for facts still cold. `found` counts the questions
    whose planted fact is in a hit, per pass."""
    vectors = [(await embedder.embed([q]))[0] for q in questions]
    facts = _facts(len(questions))
    async with engine.connect() as conn:
        ids = [
            int(r.id)
            for r in await conn.execute(
                text("SELECT id FROM conversations WHERE tenant_id = :t ORDER BY id"),
                {"t": tenant_id},
            )
        ]
        messages = await conn.scalar(
            text("SELECT count(*) FROM nodes WHERE tenant_id = :t AND level = 0"), {"t": tenant_id}
        )
        await conn.execute(text("DELETE FROM node_access WHERE tenant_id = :t"), {"t": tenant_id})
        await conn.commit()

        async def answered_warm(index: int) -> bool:
            """Whether the warm tier answers the question (the cold history is not read)."""
            warm = await tiered.warm_leg(
                conn,
                tenant_id=tenant_id,
                conversation_ids=ids,
                query=questions[index],
                query_vector=vectors[index],
                messages=int(messages),
                pool=retrieval.CANDIDATES,
            )
            await conn.rollback()
            return warm is not None

        async def measure(indexes: Sequence[int]) -> tuple[list[float], dict[int, list[int]], int]:
            latencies: list[float] = []
            hits: dict[int, list[int]] = {}
            found = 0
            for round_number in range(rounds + 1):
                for index in indexes:
                    started = time.perf_counter()
                    result = await retrieval.search(
                        conn,
                        tenant_id=tenant_id,
                        conversation_ids=ids,
                        query=questions[index],
                        query_vector=vectors[index],
                        limit=10,
                    )
                    elapsed = (time.perf_counter() - started) * 1000
                    await conn.rollback()
                    if round_number:
                        latencies.append(elapsed)
                        by_path[await answered_warm(index)].append(elapsed)
                    else:
                        hits[index] = [hit.node_id for hit in result]
                        fact = facts[index]
                        found += fact is not None and any(fact in hit.text for hit in result)
            return latencies, hits, found

        by_path: dict[bool, list[float]] = defaultdict(list)
        everything = range(len(questions))
        warm_half = [i for i in everything if i % 2 == 0]
        cold_half = [i for i in everything if i % 2 == 1]
        cold, hits, found_cold = await measure(everything)
        by_path.clear()
        accessed: Counter[int] = Counter(node for i in warm_half for node in hits[i])
        await tiers.record(conn, tenant_id=tenant_id, accessed=accessed)
        await conn.commit()
        warm_asked, _, found_warm = await measure(warm_half)
        cold_asked, _, found_other = await measure(cold_half)
        await conn.execute(text("DELETE FROM node_access WHERE tenant_id = :t"), {"t": tenant_id})
        await conn.commit()
    planted = sum(fact is not None for fact in facts)
    return {
        "conversations": len(ids),
        "messages": int(messages),
        **h.summarize(cold),
        "planted_facts": planted,
        "found_all_cold": found_cold,
        "with_tiers": {
            "warm_nodes": len(accessed),
            "asked_again_warm": h.summarize(warm_asked),
            "asked_cold": h.summarize(cold_asked),
            "found": found_warm + found_other,
            # Both passes with tiers, by whether the warm tier answered (else the whole
            # history was searched, the warm leg's cost added).
            "answered_warm": h.summarize(by_path[True]) | {"queries": len(by_path[True])},
            "fell_through": h.summarize(by_path[False]) | {"queries": len(by_path[False])},
        },
    }


def _facts(count: int) -> list[str | None]:
    """The planted fact each of `_questions(count)` asks about (None: a generic question)."""
    planted = [fact.value for fact in synthetic.generate(2_000, seed=5, with_tools=False).facts]
    generic: list[str | None] = [None] * 4
    mixed = [q for pair in zip(planted, generic * len(planted), strict=False) for q in pair]
    return (mixed * (count // max(len(mixed), 1) + 1))[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("setup")
    make.add_argument("--data-dir", type=Path, required=True)
    make.add_argument("--messages", type=int, default=10_000)
    make.add_argument("--tenant", type=int)
    measure = commands.add_parser("run")
    measure.add_argument("--data-dir", type=Path, required=True)
    measure.add_argument("--conversation", default="bench-10000")
    measure.add_argument("--budget", type=int, default=8000)
    measure.add_argument("--queries", type=int, default=40)
    measure.add_argument("--rounds", type=int, default=3)
    measure.add_argument("--stages", action="store_true")
    measure.add_argument("--tenant", action="store_true")
    measure.add_argument("--chosen")
    measure.add_argument("--profile", help="write a pyinstrument profile of the builds here")
    arguments = parser.parse_args()
    if arguments.command == "setup":
        setup(arguments.data_dir, arguments.messages, arguments.tenant)
    else:
        result = asyncio.run(run(arguments))
        chosen = result.pop("chosen")
        if arguments.profile:
            Path(arguments.profile).write_text(result.pop("profile"))
        if arguments.chosen:
            Path(arguments.chosen).write_text(json.dumps(chosen, indent=1, sort_keys=True))
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
