"""Memory quality on LongMemEval-S dev: are a question's evidence turns in the prompt sent upstream?

    python -m bench.longmemeval [--data ../shared/data/longmemeval_s_dev]
                                [--sample 60] [--types multi-session,knowledge-update]
                                [--seed 13] [--budgets 2000,4000,8000]
                                [--systems memstrata,flat_embedding] [--output FILE]
                                [--data-dir DIR] [--report-only]

Each LongMemEval question has its own haystack (~50 sessions, ~490 turns of user ↔ AI-assistant
chat). A stratified sample of the questions is drawn (`sample()`: the same number of each
`question_type`, from a seeded shuffle of each type's ids, so a smaller sample is the start of a
bigger one), and each question's haystack is replayed as one conversation through the real
import path (`bench.evidence.replay`: sessions in order, each turn stamped with its session's
date, the dataset's roles as they are), its summary tree built, and the question asked as the
conversation's next user message through the gateway's dry run (`gateway.openai.chat.dry_run`).
The prompt is scored by the share of the question's evidence turns (`has_answer: true`) whose
whole text is in it verbatim, at each budget, beside the baselines LoCoMo has (newest turns,
flat MiniLM top-k, flat full-text top-k; `bench.evidence`).

Abstention questions (ids ending `_abs`) ask about something the haystack never says: they have
no evidence to find and are left out of the sample (how many is recorded). The question's date
(`question_date`) is recorded but reaches nothing: the dry run has no clock to set, and today's
retrieval reads none.

Results go to `bench/results/longmemeval.json` (with the sampled ids, per type, and every
question's recall per method and budget, to compare two versions question by question) and the
`## Memory quality (LongMemEval-S dev)` section of docs/benchmarks.md, between its markers. A run
narrowed by `--sample` below the default, `--types` or `--systems` writes
`longmemeval-quick.json` unless `--output` is given, and leaves the docs alone. `--data-dir DIR`
keeps the database there: a later run reuses the haystacks already replayed (the replay is most
of the time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import evidence
from bench.evidence import METHODS, MODEL, Replayed, Scores, Turn
from bench.evidence_report import (
    ROOT,
    group_table,
    layout,
    methods_named,
    recall_table,
    size_table,
    update_docs,
)
from bench.harness import machine_info
from memory import tokens
from memory.embeddings import LocalEmbedder
from memory.recall import tools

DATA = ROOT.parent / "shared" / "data" / "longmemeval_s_dev"
RESULTS = ROOT / "bench" / "results" / "longmemeval.json"
BEGIN, END = "<!-- longmemeval:begin -->", "<!-- longmemeval:end -->"
TYPES = (
    "single-session-user",
    "single-session-assistant",
    "single-session-preference",
    "multi-session",
    "knowledge-update",
    "temporal-reasoning",
)
SAMPLE = 60
SEED = 13
BUDGETS = "2000,4000,8000"
BEFORE = {"2000": 0.761, "4000": 0.871, "8000": 0.934}
"""The per-query rebuild's recall on this sample before issue #13 (measured 2026-11-24T04:59),
which the working context must not fall below."""


@dataclass(kw_only=True)
class Haystack(Replayed):
    """One question and the conversation it is asked at the end of."""

    question_id: str
    question_type: str
    question: str
    question_date: str
    evidence: list[Turn]


def parse_date(value: str) -> datetime:
    """LongMemEval's `2023/05/20 (Sat) 02:21`."""
    return datetime.strptime(value.split(" (")[0] + value.split(")")[1], "%Y/%m/%d %H:%M").replace(
        tzinfo=UTC
    )


def load(path: Path) -> Haystack:
    raw = json.loads(path.read_text(encoding="utf-8"))
    turns: list[Turn] = []
    for number, (date, session) in enumerate(
        zip(raw["haystack_dates"], raw["haystack_sessions"], strict=True)
    ):
        stamp = parse_date(date)
        for index, turn in enumerate(session):
            turns.append(
                Turn(
                    key=f"{number}:{index}",
                    seq=len(turns),
                    speaker=turn["role"],
                    role=turn["role"],
                    text=turn["content"],
                    created_at=stamp,
                )
            )
    flags = [t.get("has_answer", False) for s in raw["haystack_sessions"] for t in s]
    return Haystack(
        external_id=f"lme-{raw['question_id']}",
        turns=turns,
        question_id=raw["question_id"],
        question_type=raw["question_type"],
        question=raw["question"],
        question_date=raw["question_date"],
        evidence=[turn for turn, flag in zip(turns, flags, strict=True) if flag],
    )


def index(folder: Path) -> dict[str, list[str]]:
    """The ids of the questions that have evidence, by type (abstention questions excluded)."""
    found: dict[str, list[str]] = {name: [] for name in TYPES}
    for path in sorted(folder.glob("*.json")):
        if path.stem.endswith("_abs"):
            continue
        raw = json.loads(path.read_text(encoding="utf-8"))
        if any(t.get("has_answer") for s in raw["haystack_sessions"] for t in s):
            found[raw["question_type"]].append(raw["question_id"])
    return found


def sample(by_type: dict[str, list[str]], size: int, types: Sequence[str], seed: int) -> list[str]:
    """`size` ids, as many of each type in `types` as can be (the first types take the
    remainder), each type's drawn from its own seeded shuffle; in turn, one of each type, so
    that a run stopped half-way has measured every type alike."""
    share, extra = divmod(size, len(types))
    drawn: list[list[str]] = []
    for rank, name in enumerate(types):
        ids = sorted(by_type[name])
        random.Random(f"{seed}:{name}").shuffle(ids)
        drawn.append(ids[: share + (1 if rank < extra else 0)])
    return [ids[k] for k in range(share + 1) for ids in drawn if k < len(ids)]


async def main_async(args: argparse.Namespace, output: Path) -> dict[str, Any]:
    """Measure, writing the results to `output` after every question (`complete` false until
    the last), so that a run stopped early leaves what it measured."""
    types = args.types.split(",") if args.types else list(TYPES)
    if unknown := sorted(set(types) - set(TYPES)):
        raise SystemExit(f"unknown question types {unknown}; known: {', '.join(TYPES)}")
    by_type = index(args.data)
    abstentions = len(list(args.data.glob("*_abs.json")))
    ids = args.ids.split(",") if args.ids else sample(by_type, args.sample, types, args.seed)
    budgets = [int(b) for b in args.budgets.split(",")]
    systems = args.systems.split(",") if args.systems else METHODS
    # The dev set's own mix of types: the sample's per-type means weighted by it.
    weights = {name: float(len(by_type[name])) for name in TYPES}
    embedder = LocalEmbedder()
    await embedder.warmup()
    started = time.perf_counter()
    replay_seconds = 0.0
    turns = 0
    per_question: dict[str, Any] = {}
    report: dict[str, Any] = {}
    # Read once (it samples every process's CPU for half a second).
    machine = machine_info()

    def results(*, complete: bool) -> dict[str, Any]:
        return {
            "benchmark": "longmemeval-s dev evidence recall",
            "complete": complete,
            "measured": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_average": round(os.getloadavg()[0], 1),
            "machine": machine,
            "data": args.data.name,
            "seed": args.seed,
            "sample_size": len(ids),
            "types": types,
            "dev_set_questions_by_type": {name: len(by_type[name]) for name in TYPES},
            "abstention_questions_excluded": abstentions,
            "question_ids": {name: [i for i in ids if i in by_type[name]] for name in types},
            "questions_scored": len(per_question),
            "questions_by_type": dict(Counter(q["type"] for q in per_question.values())),
            "turns": turns,
            "evidence_turns": sum(q["evidence_turns"] for q in per_question.values()),
            "budgets": budgets,
            "model_tokenizer": MODEL,
            "replay_seconds": round(replay_seconds, 1),
            "total_seconds": round(time.perf_counter() - started, 1),
            "recall": scores.table("evidence", weights),
            **scores.figures(),
            "memory_tool_definition_tokens": tools.tool_tokens(MODEL),
            "context_settings": evidence.context_settings(scores.states),
            "per_question": per_question,
        }

    async with evidence.database(
        prefix="memstrata-longmemeval-",
        tenant="longmemeval",
        folder=args.data_dir,
        url=args.database_url,
    ) as (engine, tenant):
        scores = Scores(evidence.states(engine, embedder, tenant), budgets, systems)
        for number, question_id in enumerate(ids, start=1):
            haystack = load(args.data / f"{question_id}.json")
            began = time.perf_counter()
            await evidence.replay(engine, tenant, haystack, embedder)
            replay_seconds += time.perf_counter() - began
            turns += len(haystack.turns)
            await scores.measure(
                haystack,
                haystack.question,
                haystack.question_type,
                {"evidence": haystack.evidence},
                key=question_id,
            )
            per_question[question_id] = {
                "type": haystack.question_type,
                "turns": len(haystack.turns),
                "evidence_turns": len(haystack.evidence),
                # An evidence turn longer than a prompt's room for one message cannot count.
                "evidence_tokens": [
                    tokens.count_text(turn.text, model=MODEL) for turn in haystack.evidence
                ],
                "recall": scores.by_question[question_id],
            }
            report = results(complete=number == len(ids))
            await asyncio.to_thread(output.write_text, json.dumps(report, indent=2) + "\n")
            print(
                f"{number}/{len(ids)} {question_id} ({haystack.question_type}, "
                f"{len(haystack.turns)} turns) {time.perf_counter() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    return report


NOTES = """**Reading it.** LongMemEval's haystacks are user ↔ AI-assistant chats: long pasted \
documents and long assistant answers, the evidence one to six turns among ~490 (~120k tokens), \
the rest distractor sessions. A turn counts only when its whole text is in the prompt; the \
gateway puts a retrieved message in whole or not at all, so a long evidence turn takes much of \
a small budget (each question's evidence sizes are in the results, `evidence_tokens`); the \
baselines' lines keep every turn whole too and skip the ones that do not fit. \
`single-session-assistant` questions ask about what the assistant said, \
`single-session-preference` ones hinge on a preference the user stated in passing (the question \
does not name it), `knowledge-update` ones have evidence on the old value and the new one, \
`multi-session` and `temporal-reasoning` ones have evidence in several sessions. Abstention \
questions (ids ending `_abs`, {abstentions} in the dev set) have no evidence and are not \
sampled. The question's date reaches nothing: the dry run has no clock, and today's retrieval \
reads none."""


def _held(recall: dict[str, Any], budgets: Sequence[str]) -> list[str]:
    """Whether the working context holds the rebuild's recall from before issue #13."""
    if "memstrata" not in recall or "memstrata_rebuild" not in recall:
        return []
    lines = [
        "### Recall holds (issue #13)",
        "",
        "| budget | working context | per-query rebuild, this run | before issue #13 | held |",
        "|---|---|---|---|---|",
    ]
    for b in budgets:
        working = recall["memstrata"][b]["overall"]
        before = BEFORE.get(b)
        held = "-" if before is None else ("yes" if working >= before else "**no**")
        lines.append(
            f"| {int(b) // 1000}k | {working:.3f} | {recall['memstrata_rebuild'][b]['overall']:.3f}"
            f" | {'-' if before is None else f'{before:.3f}'} | {held} |"
        )
    return [*lines, ""]


def render(report: dict[str, Any]) -> str:
    """The `## Memory quality (LongMemEval-S dev)` section of docs/benchmarks.md."""
    budgets = [str(b) for b in report["budgets"]]
    per_type = report["questions_by_type"]
    recall = report["recall"]
    lines = [
        "## Memory quality (LongMemEval-S dev)",
        "",
        ("**Partial run**: " if not report.get("complete", True) else "")
        + f"Measured {report['measured']} on a stratified sample of {report['sample_size']} "
        f"questions of the {sum(report['dev_set_questions_by_type'].values())} with evidence "
        f"(seed {report['seed']}, "
        + ", ".join(f"{per_type.get(name, 0)} {name}" for name in report["types"])
        + f"; {report.get('questions_scored', report['sample_size'])} scored), "
        f"{report['turns']:,} turns replayed, {report['evidence_turns']} evidence turns; "
        f"`python -m bench.longmemeval` ({report['total_seconds']:.0f} s here, "
        f"{report['replay_seconds']:.0f} s of it replaying and building the haystacks). "
        "Raw figures and the sampled ids: `bench/results/longmemeval.json`.",
        "",
        # A note written into the results by hand, when the run itself needs one.
        *([report["run_note"], ""] if report.get("run_note") else []),
        "**What is measured.** As on LoCoMo (the section above): each question's haystack is "
        "replayed as one conversation through the import path (sessions in order, each turn "
        "stamped with its session's date, the dataset's roles), its summary tree built "
        "(extractive summaries, local MiniLM embeddings), and the question asked as the next "
        "user message through the gateway's dry run (gpt-4o's tokenizer). Evidence recall is "
        "the share of the question's `has_answer` turns whose whole text is in the prompt "
        "verbatim, averaged over questions. The baselines get the same budgets: the newest "
        "turns as chat messages; the turns ranked by MiniLM cosine or by Postgres "
        "`ts_rank_cd`, as `[date role] text` lines in one message.",
        "",
        *layout(report, budgets),
        "### Evidence recall",
        "",
        "Mean over the sample (as many questions of each type):",
        "",
        *recall_table(recall, budgets),
        "",
        "Weighted by the dev set's own mix of types "
        + "("
        + ", ".join(f"{n} {name}" for name, n in report["dev_set_questions_by_type"].items())
        + "):",
        "",
        *recall_table(recall, budgets, key="weighted"),
        "",
        f"Per question type ({methods_named(recall)}):",
        "",
        *group_table(
            recall,
            budgets,
            [(name, f"{name} ({per_type.get(name, 0)})") for name in report["types"]],
            "question type (questions)",
        ),
        "",
        *_held(recall, budgets),
        NOTES.format(abstentions=report["abstention_questions_excluded"]),
        "",
        *size_table(report, budgets),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--sample", type=int, default=SAMPLE, help="questions, stratified")
    parser.add_argument("--types", default=None, help="question types (default: all six)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--budgets", default=BUDGETS)
    parser.add_argument("--systems", default=None, help="methods to score (default: all)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="keep the database here and reuse it"
    )
    parser.add_argument("--ids", default=None, help="these question ids instead of a sample")
    parser.add_argument(
        "--database-url", default=None, help="a running Postgres (another run's) to use"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="redraw docs/benchmarks.md from the results"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        section = render(json.loads(RESULTS.read_text(encoding="utf-8")))
        update_docs(section, begin=BEGIN, end=END)
        return
    partial = (
        args.ids is not None
        or args.sample < SAMPLE
        or args.types is not None
        or args.systems is not None
        or args.budgets != BUDGETS
    )
    output = args.output or (RESULTS.with_name("longmemeval-quick.json") if partial else RESULTS)
    output.parent.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(main_async(args, output))
    if not partial and args.output is None:
        update_docs(render(report), begin=BEGIN, end=END)
    print(f"evidence recall, {report['sample_size']} questions ({report['total_seconds']:.0f}s)")
    for method, per_budget in report["recall"].items():
        cells = "  ".join(f"{b}: {v['overall']}" for b, v in per_budget.items())
        print(f"  {method:>15}  {cells}")
    print("build latency ms", report["build_latency_ms"])


if __name__ == "__main__":
    main()
