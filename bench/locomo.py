"""Memory quality on LoCoMo: are a question's evidence turns in the prompt sent upstream?

    python -m bench.locomo [--data ../shared/data/locomo10.json]
                           [--audit ../shared/data/locomo_audit_errors.json]
                           [--budgets 1000,2000,4000,8000] [--quick] [--output FILE]
                           [--conversations 0-4] [--systems memstrata,flat_embedding]

Starts its own embedded Postgres (throw-away, `durable=False`), migrates it, and replays every
LoCoMo conversation through the real import path (`gateway.importer.import_messages`): one
conversation per LoCoMo sample, one message per dialogue turn, `created_at` from the session's
date (turn k of a session is stamped k minutes after the session starts). The two speakers map
to roles by order of appearance in the sample's metadata: `speaker_a` is `user`, `speaker_b` is
`assistant`, and the speaker's name is kept in OpenAI's `name` field (so neither the searchable
text nor the embedding carries it). A turn that shares a photo gets its caption appended to the
text as `[shares a photo: CAPTION]`, as a chat app would show it to a text model. The summary
tree is then built with the extractive summarizer and the local MiniLM embedder
(`memory.build.tree.build`, `final=True`).

For each question of categories 1-4 and each budget, the prompt is built exactly as the gateway
would (`gateway.openai.chat.dry_run`: the question as the new user message, model gpt-4o) and scored
by the share of its evidence turns whose whole text (surrounding whitespace aside) is present
verbatim in the prompt. Evidence ids are normalized (`D:11:26` → `D11:26`, `D8:6; D9:17` → two ids);
ids that name no turn are dropped and counted. Scores are reported with the dataset's evidence and
with the audit file's `correct_evidence` in place of the cited one. memstrata is measured twice:
with the memory tools off (`MEMSTRATA_MEMORY_TOOLS=never`: the prompt is all messages, like the
baselines') and with them offered (the default `auto`: their definitions are reserved out of the
budget, so the messages get less). Three baselines get the same budgets and the same token
counting: the newest turns only (verbatim chat messages), flat embedding top-k (MiniLM cosine over
all turns) and flat full-text top-k (Postgres `ts_rank_cd` over the question's words joined by
`or`), the last two as one memory message of `[date speaker] text` lines.

The data is CC BY-NC: it is read from its path and never copied into the repository. Results
are printed and written to `bench/results/locomo.json`, and the `## Memory quality (LoCoMo)`
section of docs/benchmarks.md is redrawn (`bench.locomo_report`; `--report-only` redraws it
from the results alone). `--quick` runs 2 conversations at 4k into `locomo-quick.json`, docs
untouched; `--data-dir DIR` keeps the database there and reuses it on the next run.
`--conversations` (`0-4`, `5-9`, `0,3`) and `--systems` (methods to score) narrow a run for
iterating on the policy; such runs write `locomo-quick.json` unless `--output` is given and
leave the docs untouched.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np
from sqlalchemy import insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.locomo_report import CATEGORIES, METHODS, ROOT, render, update_docs
from devkit.postgres import throwaway_postgres
from devkit.stats import percentile
from gateway import importer
from gateway.openai import chat
from gateway.settings import Settings
from gateway.state import State
from memory import tokens
from memory.build import tree
from memory.build.summarize import ExtractiveSummarizer
from memory.db import connect, migrate
from memory.embeddings import LocalEmbedder
from memory.recall import retrieval, tools
from memory.schema import nodes, tenants

RESULTS = ROOT / "bench" / "results" / "locomo.json"
DATA = ROOT.parent / "shared" / "data" / "locomo10.json"
AUDIT = ROOT.parent / "shared" / "data" / "locomo_audit_errors.json"
MODEL = "gpt-4o"
_EVIDENCE = re.compile(r"D\s*:?\s*(\d+)\s*[:\s]\s*(\d+)")


@dataclass
class Turn:
    dia_id: str
    seq: int
    speaker: str
    text: str
    created_at: datetime


@dataclass
class Question:
    sample: int
    index: int
    category: int
    question: str
    evidence: list[str]
    corrected: list[str] | None = None


@dataclass
class Sample:
    number: int
    external_id: str
    speakers: tuple[str, str]
    turns: list[Turn]
    questions: list[Question]
    by_dia: dict[str, Turn] = field(default_factory=dict)
    conversation_id: int = 0
    embeddings: Any = None


def normalize_evidence(raw: Sequence[str]) -> list[str]:
    """Evidence ids as `D<session>:<turn>`, malformed ones repaired, several per string split."""
    found: list[str] = []
    for item in raw:
        for session, turn in _EVIDENCE.findall(str(item)):
            dia = f"D{int(session)}:{int(turn)}"
            if dia not in found:
                found.append(dia)
    return found


def parse_date(value: str) -> datetime:
    """LoCoMo's `1:56 pm on 8 May, 2023`."""
    return datetime.strptime(value.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)


def load(data: Path, audit: Path | None, limit: int | None) -> list[Sample]:
    raw = json.loads(data.read_text(encoding="utf-8"))
    corrections: dict[tuple[int, int], list[str]] = {}
    if audit is not None and audit.exists():
        for entry in json.loads(audit.read_text(encoding="utf-8")):
            match = re.fullmatch(r"locomo_(\d+)_qa(\d+)", entry["question_id"])
            if match and entry.get("correct_evidence") is not None:
                key = (int(match.group(1)), int(match.group(2)))
                corrections[key] = normalize_evidence(entry["correct_evidence"])
    samples = []
    for number, item in enumerate(raw[:limit] if limit else raw):
        conv = item["conversation"]
        speakers = (conv["speaker_a"], conv["speaker_b"])
        turns: list[Turn] = []
        session = 1
        while f"session_{session}" in conv:
            start = parse_date(conv[f"session_{session}_date_time"])
            for offset, turn in enumerate(conv[f"session_{session}"]):
                body = turn["text"]
                if turn.get("blip_caption"):
                    body = f"{body} [shares a photo: {turn['blip_caption']}]"
                turns.append(
                    Turn(
                        dia_id=turn["dia_id"],
                        seq=len(turns),
                        speaker=turn["speaker"],
                        text=body,
                        created_at=start + timedelta(minutes=offset),
                    )
                )
            session += 1
        questions = []
        for index, qa in enumerate(item["qa"]):
            if qa.get("category") not in CATEGORIES:
                continue
            questions.append(
                Question(
                    sample=number,
                    index=index,
                    category=int(qa["category"]),
                    question=str(qa["question"]),
                    evidence=normalize_evidence(qa.get("evidence", [])),
                    corrected=corrections.get((number, index)),
                )
            )
        sample = Sample(number, f"locomo-{number}", speakers, turns, questions)
        sample.by_dia = {turn.dia_id: turn for turn in turns}
        samples.append(sample)
    return samples


def as_message(sample: Sample, turn: Turn) -> dict[str, Any]:
    role = "user" if turn.speaker == sample.speakers[0] else "assistant"
    name = re.sub(r"[^A-Za-z0-9_-]", "_", turn.speaker)[:64]
    return {"role": role, "name": name, "content": turn.text}


# -- baselines -------------------------------------------------------------------------------


def _line(turn: Turn) -> str:
    return f"[{turn.created_at:%Y-%m-%d %H:%M} {turn.speaker}] {turn.text}"


def fill_lines(turns: Sequence[Turn], question: str, budget: int) -> list[dict[str, Any]]:
    """One memory message of `[date speaker] text` lines, in rank order, within `budget`."""
    ask = {"role": "user", "content": question}
    chosen: list[Turn] = []
    used = tokens.count_messages([{"role": "system", "content": ""}, ask], model=MODEL)
    for turn in turns:
        cost = tokens.count_text(_line(turn), model=MODEL) + 1
        if used + cost > budget:
            continue
        chosen.append(turn)
        used += cost
    content = "\n".join(_line(turn) for turn in sorted(chosen, key=lambda t: t.seq))
    messages = [{"role": "system", "content": content}, ask]
    while tokens.count_messages(messages, model=MODEL) > budget and chosen:
        chosen.pop()
        content = "\n".join(_line(turn) for turn in sorted(chosen, key=lambda t: t.seq))
        messages = [{"role": "system", "content": content}, ask]
    return messages


def newest(sample: Sample, question: str, budget: int) -> list[dict[str, Any]]:
    ask = {"role": "user", "content": question}
    kept: list[dict[str, Any]] = []
    for turn in reversed(sample.turns):
        trial = [as_message(sample, turn), *kept]
        if tokens.count_messages([*trial, ask], model=MODEL) > budget:
            break
        kept = trial
    return [*kept, ask]


async def fulltext_ranked(engine: AsyncEngine, sample: Sample, question: str) -> list[Turn]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT seq FROM nodes WHERE conversation_id = :c AND level = 0 "
                "AND tsv @@ websearch_to_tsquery('english', :q) "
                "ORDER BY ts_rank_cd(tsv, websearch_to_tsquery('english', :q)) DESC, seq"
            ),
            {"c": sample.conversation_id, "q": retrieval.websearch_query(question)},
        )
        return [sample.turns[row.seq] for row in rows]


def embedding_ranked(sample: Sample, vector: Sequence[float]) -> list[Turn]:
    scores = sample.embeddings @ np.asarray(vector, dtype=np.float32)
    return [sample.turns[int(i)] for i in np.argsort(-scores, kind="stable")]


# -- the run -------------------------------------------------------------------------------


def present(messages: Sequence[dict[str, Any]], turns: Sequence[Turn]) -> list[bool]:
    prompt = "\n".join(tokens.message_text(m) for m in messages)
    # Surrounding whitespace is not part of what a turn says; the memory message's lines drop it.
    return [turn.text.strip() in prompt for turn in turns]


async def replay(engine: AsyncEngine, tenant: int, sample: Sample, embedder: LocalEmbedder) -> None:
    messages = [as_message(sample, turn) for turn in sample.turns]
    await importer.import_messages(
        engine,
        tenant_id=tenant,
        external_id=sample.external_id,
        messages=messages,
        created_at=[turn.created_at for turn in sample.turns],
        model=MODEL,
        batch=1000,
    )
    async with engine.connect() as conn:
        sample.conversation_id = int(
            await conn.scalar(
                text("SELECT id FROM conversations WHERE tenant_id = :t AND external_id = :e"),
                {"t": tenant, "e": sample.external_id},
            )
        )
    config = tree.TreeConfig(embedder=embedder, summarizer=ExtractiveSummarizer())
    await tree.build(
        engine, tenant_id=tenant, conversation_id=sample.conversation_id, config=config, final=True
    )
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(nodes.c.seq, nodes.c.embedding)
            .where(nodes.c.conversation_id == sample.conversation_id, nodes.c.level == 0)
            .order_by(nodes.c.seq)
        )
        sample.embeddings = np.asarray([list(row.embedding) for row in rows], dtype=np.float32)


async def dry(
    state: State, sample: Sample, question: Question, budget: int
) -> tuple[list[dict[str, Any]], int]:
    assembled = await chat.dry_run(
        state,
        tenant_id=state.default_tenant_id,
        external_id=sample.external_id,
        query=question.question,
        budget=budget,
        model=MODEL,
    )
    return assembled.messages, assembled.tokens


async def evaluate(
    state: State,
    tenant: int,
    samples: Sequence[Sample],
    budgets: Sequence[int],
    with_tools: State | None = None,
    systems: Collection[str] = METHODS,
) -> dict[str, Any]:
    # scores[variant][method][budget][category] → per-question recalls
    scores: dict[str, Any] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    )
    prompt_tokens: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    latency: dict[int, list[float]] = defaultdict(list)
    dropped = 0
    tools_reserved = tools.tool_tokens(MODEL)
    for sample in samples:
        for question in sample.questions:
            variants = {"cited": question.evidence, "corrected": question.corrected}
            resolved = {
                name: [sample.by_dia[d] for d in ids if d in sample.by_dia]
                for name, ids in variants.items()
                if ids is not None
            }
            dropped += len(question.evidence) - len(resolved["cited"])
            if "corrected" not in resolved:
                resolved["corrected"] = resolved["cited"]
            [vector] = await state.embedder.embed([question.question])
            by_embedding = embedding_ranked(sample, vector)
            by_fulltext = await fulltext_ranked(state.engine, sample, question.question)
            for budget in budgets:
                began = time.perf_counter()
                built, count = await dry(state, sample, question, budget)
                latency[budget].append((time.perf_counter() - began) * 1000)
                prompts = {"memstrata": built}
                if with_tools is not None and "memstrata_tools" in systems:
                    tooled, _ = await dry(with_tools, sample, question, budget)
                    prompts["memstrata_tools"] = tooled
                if "newest" in systems:
                    prompts["newest"] = newest(sample, question.question, budget)
                if "flat_embedding" in systems:
                    prompts["flat_embedding"] = fill_lines(by_embedding, question.question, budget)
                if "flat_fulltext" in systems:
                    prompts["flat_fulltext"] = fill_lines(by_fulltext, question.question, budget)
                for method, messages in prompts.items():
                    used = tokens.count_messages(messages, model=MODEL)
                    if method == "memstrata":
                        assert used == count, (used, count)
                    limit = budget - (tools_reserved if method == "memstrata_tools" else 0)
                    assert used <= limit, (method, used, limit)
                    prompt_tokens[method][budget].append(used)
                    for variant, turns in resolved.items():
                        if not turns:
                            continue
                        hits = present(messages, turns)
                        scores[variant][method][budget][question.category].append(
                            sum(hits) / len(hits)
                        )
        print(f"sample {sample.number} done", file=sys.stderr, flush=True)
    table: dict[str, Any] = {}
    for variant, methods in scores.items():
        table[variant] = {}
        for method in (m for m in METHODS if m in methods):
            table[variant][method] = {}
            for budget in budgets:
                per = methods[method][budget]
                everything = [v for values in per.values() for v in values]
                table[variant][method][str(budget)] = {
                    "overall": round(statistics.fmean(everything), 4) if everything else None,
                    "questions": len(everything),
                    **{
                        f"{c}_{CATEGORIES[c]}": round(statistics.fmean(per[c]), 4)
                        for c in sorted(per)
                    },
                }
    return {
        "recall": table,
        "prompt_tokens_mean": {
            method: {str(b): round(statistics.fmean(v), 1) for b, v in per.items()}
            for method, per in prompt_tokens.items()
        },
        "build_latency_ms": {
            str(b): {
                "p50": round(percentile(v, 50) or 0.0, 2),
                "p95": round(percentile(v, 95) or 0.0, 2),
                "mean": round(statistics.fmean(v), 2),
            }
            for b, v in latency.items()
        },
        "evidence_ids_unresolved": dropped,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    samples = load(args.data, args.audit, 2 if args.quick else None)
    if args.conversations:
        wanted = _numbers(args.conversations)
        samples = [sample for sample in samples if sample.number in wanted]
    budgets = [4000] if args.quick else [int(b) for b in args.budgets.split(",")]
    embedder = LocalEmbedder()
    await embedder.warmup()
    started = time.perf_counter()
    # Nothing else runs on the event loop: starting and stopping the server may block it.
    with throwaway_postgres(prefix="memstrata-locomo-", folder=args.data_dir) as server:
        engine = connect(server.url)
        await migrate(engine)
        async with engine.begin() as conn:
            found = await conn.scalar(select(tenants.c.id).where(tenants.c.name == "locomo"))
            if found is None:
                found = await conn.scalar(
                    insert(tenants).values(name="locomo").returning(tenants.c.id)
                )
            tenant = int(found)
        for sample in samples:
            await replay(engine, tenant, sample, embedder)
        replayed = time.perf_counter() - started
        print(f"replayed {len(samples)} conversations in {replayed:.0f}s", file=sys.stderr)
        state = State(
            settings=Settings(_env_file=None, memory_tools="never"),
            engine=engine,
            upstream=cast(Any, None),
            embedder=embedder,
            default_tenant_id=tenant,
        )
        with_tools = State(
            settings=Settings(_env_file=None, memory_tools="auto"),
            engine=engine,
            upstream=cast(Any, None),
            embedder=embedder,
            default_tenant_id=tenant,
        )
        systems = args.systems.split(",") if args.systems else METHODS
        report = await evaluate(state, tenant, samples, budgets, with_tools, systems)
        report["memory_tool_definition_tokens"] = tools.tool_tokens(MODEL)
        await engine.dispose()
    return {
        "benchmark": "locomo evidence recall",
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": round(os.getloadavg()[0], 1),
        "data": args.data.name,
        "conversations": len(samples),
        "turns": sum(len(s.turns) for s in samples),
        "questions": sum(len(s.questions) for s in samples),
        "budgets": budgets,
        "model_tokenizer": MODEL,
        "replay_seconds": round(replayed, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        **report,
    }


def _numbers(spec: str) -> set[int]:
    """`0-4,7` → {0, 1, 2, 3, 4, 7}."""
    found: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        found.update(range(int(first), int(last or first) + 1))
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--audit", type=Path, default=AUDIT)
    parser.add_argument("--budgets", default="1000,2000,4000,8000")
    parser.add_argument("--quick", action="store_true", help="2 conversations, 4k only")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="keep the database here and reuse it"
    )
    parser.add_argument("--conversations", default=None, help="e.g. 0-4 (default: all)")
    parser.add_argument("--systems", default=None, help="methods to score (default: all)")
    parser.add_argument(
        "--report-only", action="store_true", help="redraw docs/benchmarks.md from the results"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        update_docs(render(json.loads(RESULTS.read_text(encoding="utf-8"))))
        return
    report = asyncio.run(main_async(args))
    partial = args.quick or args.conversations is not None or args.systems is not None
    output = args.output or (RESULTS.with_name("locomo-quick.json") if partial else RESULTS)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    if not partial and args.output is None:
        update_docs(render(report))
    for variant, methods in report["recall"].items():
        print(f"evidence recall ({variant} evidence)")
        for method, per_budget in methods.items():
            cells = "  ".join(f"{b}: {v['overall']}" for b, v in per_budget.items())
            print(f"  {method:>15}  {cells}")
    print("build latency ms", report["build_latency_ms"])
    print("prompt tokens", report["prompt_tokens_mean"])


if __name__ == "__main__":
    main()
