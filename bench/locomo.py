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

The replay, the baselines and the scoring are `bench.evidence`'s (shared with
`bench.longmemeval`). The data is CC BY-NC: it is read from its path and never copied into the
repository. Results are printed and written to `bench/results/locomo.json`, and the `## Memory
quality (LoCoMo)` section of docs/benchmarks.md is redrawn (`bench.locomo_report`;
`--report-only` redraws it from the results alone). `--quick` runs 2 conversations at 4k into
`locomo-quick.json`, docs untouched; `--data-dir DIR` keeps the database there and reuses it on
the next run.
`--conversations` (`0-4`, `5-9`, `0,3`) and `--systems` (methods to score) narrow a run for
iterating on the policy; such runs write `locomo-quick.json` unless `--output` is given and
leave the docs untouched. `--merged` replays the conversations as one (~5,900 turns, each
question asked at its end over all of them: recall at the scale where retrieval's caps bind),
written the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import evidence
from bench.evidence import METHODS, MODEL, Replayed, Scores, Turn
from bench.evidence_report import ROOT
from bench.locomo_report import CATEGORIES, render, update_docs
from memory.embeddings import LocalEmbedder
from memory.recall import tools

RESULTS = ROOT / "bench" / "results" / "locomo.json"
DATA = ROOT.parent / "shared" / "data" / "locomo10.json"
AUDIT = ROOT.parent / "shared" / "data" / "locomo_audit_errors.json"
_EVIDENCE = re.compile(r"D\s*:?\s*(\d+)\s*[:\s]\s*(\d+)")


@dataclass
class Question:
    sample: int
    index: int
    category: int
    question: str
    evidence: list[str]
    corrected: list[str] | None = None


@dataclass(kw_only=True)
class Sample(Replayed):
    number: int
    speakers: tuple[str, str]
    questions: list[Question]
    by_dia: dict[str, Turn] = field(default_factory=dict)


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
                        key=turn["dia_id"],
                        seq=len(turns),
                        speaker=turn["speaker"],
                        role="user" if turn["speaker"] == speakers[0] else "assistant",
                        # The name goes in OpenAI's `name` field, out of the searched text.
                        name=re.sub(r"[^A-Za-z0-9_-]", "_", turn["speaker"])[:64],
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
        sample = Sample(
            number=number,
            external_id=f"locomo-{number}",
            speakers=speakers,
            turns=turns,
            questions=questions,
        )
        sample.by_dia = {turn.key: turn for turn in turns}
        samples.append(sample)
    return samples


def merged(samples: Sequence[Sample]) -> Sample:
    """The samples as one conversation, one after the other (`--merged`): every question asked
    at its end, over the others' turns too. LoCoMo's conversations hold 370-690 turns, where
    the full-text leg's cap on messages read (`memory.recall.retrieval.FULLTEXT_READS`) never
    binds; this one holds ~5,900, the size of a long-lived assistant's history."""
    turns: list[Turn] = []
    questions: list[Question] = []
    by_dia: dict[str, Turn] = {}
    for sample in samples:
        prefix = f"S{sample.number}/"
        for turn in sample.turns:
            moved = replace(turn, key=prefix + turn.key, seq=len(turns))
            turns.append(moved)
            by_dia[moved.key] = moved
        for question in sample.questions:
            corrected = question.corrected
            questions.append(
                replace(
                    question,
                    evidence=[prefix + d for d in question.evidence],
                    corrected=None if corrected is None else [prefix + d for d in corrected],
                )
            )
    return Sample(
        number=-1,
        external_id="locomo-merged-" + "-".join(str(sample.number) for sample in samples),
        speakers=samples[0].speakers,
        turns=turns,
        questions=questions,
        by_dia=by_dia,
    )


async def evaluate(
    scores: Scores, samples: Sequence[Sample], budgets: Sequence[int]
) -> dict[str, Any]:
    dropped = 0
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
            group = f"{question.category}_{CATEGORIES[question.category]}"
            await scores.measure(sample, question.question, group, resolved)
        print(f"sample {sample.number} done", file=sys.stderr, flush=True)
    return {
        "recall": {variant: scores.table(variant) for variant in scores.recall},
        **scores.figures(),
        "evidence_ids_unresolved": dropped,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    samples = load(args.data, args.audit, 2 if args.quick else None)
    if args.conversations:
        wanted = _numbers(args.conversations)
        samples = [sample for sample in samples if sample.number in wanted]
    if args.merged:
        samples = [merged(samples)]
    budgets = [4000] if args.quick else [int(b) for b in args.budgets.split(",")]
    embedder = LocalEmbedder()
    await embedder.warmup()
    started = time.perf_counter()
    async with evidence.database(
        prefix="memstrata-locomo-", tenant="locomo", folder=args.data_dir
    ) as (engine, tenant):
        for sample in samples:
            await evidence.replay(engine, tenant, sample, embedder)
        replayed = time.perf_counter() - started
        print(f"replayed {len(samples)} conversations in {replayed:.0f}s", file=sys.stderr)
        systems = args.systems.split(",") if args.systems else METHODS
        scores = Scores(evidence.states(engine, embedder, tenant), budgets, systems)
        report = await evaluate(scores, samples, budgets)
        report["memory_tool_definition_tokens"] = tools.tool_tokens(MODEL)
        report["context_settings"] = evidence.context_settings(scores.states)
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


def merge(report: dict[str, Any], earlier: dict[str, Any], name: str) -> None:
    """Put into `report` the methods it lacks from `earlier` results (the same questions) at
    the budgets both measured. Results from before the working context (no `context_settings`)
    measured the per-query rebuild as `memstrata`: it becomes `memstrata_rebuild`, and their
    `memstrata_tools` (the rebuild with the tools offered) is left out."""
    renamed = {} if "context_settings" in earlier else {"memstrata": "memstrata_rebuild"}
    skipped = set() if "context_settings" in earlier else {"memstrata_tools"}
    budgets = [str(b) for b in report["budgets"]]
    taken: set[str] = set()
    for variant, methods in report["recall"].items():
        for method, cells in earlier["recall"].get(variant, {}).items():
            now = renamed.get(method, method)
            if now in methods or method in skipped or not all(b in cells for b in budgets):
                continue
            methods[now] = {b: cells[b] for b in budgets}
            report["prompt_tokens_mean"][now] = {
                b: earlier["prompt_tokens_mean"][method][b] for b in budgets
            }
            taken.add(now)
    report["merged_from"] = {
        "file": name,
        "measured": earlier.get("measured"),
        "methods": sorted(taken, key=METHODS.index),
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
        "--merged",
        action="store_true",
        help="the conversations as one, every question asked at its end (recall at scale)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="take the methods this run does not measure from an earlier results file",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="redraw docs/benchmarks.md from the results"
    )
    args = parser.parse_args(argv)
    if args.report_only:
        update_docs(render(json.loads(RESULTS.read_text(encoding="utf-8"))))
        return
    report = asyncio.run(main_async(args))
    if args.merge is not None:
        merge(report, json.loads(args.merge.read_text(encoding="utf-8")), args.merge.name)
    partial = (
        args.quick
        or args.merged
        or args.conversations is not None
        or (args.systems is not None and args.merge is None)
    )
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
