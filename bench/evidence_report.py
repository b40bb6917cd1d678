"""The markdown both evidence-recall reports share (`bench.locomo_report`,
`bench.longmemeval`), and the one way a benchmark's section of docs/benchmarks.md is replaced.

`recall_table()` is one row per method, one column per budget; `group_table()` one row per
group (a LoCoMo category, a LongMemEval question type), each cell every method's score;
`size_table()` the prompts' mean size and the dry run's time. `update_docs()` puts a section
between its begin and end markers (appended when absent) and leaves the rest of the file as
it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.evidence import METHODS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
LABELS = {
    "memstrata": "memstrata (memory tools off)",
    "memstrata_tools": "memstrata, memory tools offered (their definitions reserved)",
    "newest": "newest turns only",
    "flat_embedding": "flat MiniLM top-k",
    "flat_fulltext": "flat full-text top-k",
}


def _head(first: str, budgets: Sequence[str]) -> list[str]:
    return [
        f"| {first} | " + " | ".join(f"{int(b) // 1000}k" for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]


def recall_table(table: dict[str, Any], budgets: Sequence[str], key: str = "overall") -> list[str]:
    """One row per method (memstrata's figures in bold): `table[method][budget][key]`."""
    lines = _head("method", budgets)
    for method in METHODS:
        cells = [f"{table[method][b][key]:.3f}" for b in budgets]
        if method == "memstrata":
            cells = [f"**{c}**" for c in cells]
        lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
    return lines


def group_table(
    table: dict[str, Any],
    budgets: Sequence[str],
    groups: Sequence[tuple[str, str]],
    first: str,
) -> list[str]:
    """One row per `(key, label)` group; a cell holds every method's score, `-` where none."""
    lines = _head(first, budgets)
    for key, label in groups:
        cells = []
        for b in budgets:
            values = [table[m][b].get(key) for m in METHODS]
            cells.append(" / ".join("-" if v is None else f"{v:.2f}" for v in values))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def size_table(report: dict[str, Any], budgets: Sequence[str]) -> list[str]:
    """The `### Prompt size and build time` subsection."""
    tokens_mean = report["prompt_tokens_mean"]
    latency = report["build_latency_ms"]
    lines = [
        "### Prompt size and build time",
        "",
        "| budget | memstrata prompt tokens (mean) | flat MiniLM | build p50 ms | build p95 ms |",
        "|---|---|---|---|---|",
    ]
    for b in budgets:
        lines.append(
            f"| {int(b):,} | {tokens_mean['memstrata'][b]:,.0f} | "
            f"{tokens_mean['flat_embedding'][b]:,.0f} | {latency[b]['p50']:.1f} | "
            f"{latency[b]['p95']:.1f} |"
        )
    return [
        *lines,
        "",
        "Build time is the whole `dry_run`: finding the conversation, embedding the question "
        "(MiniLM on the CPU), both retrieval legs, loading and laying out the prompt, and exact "
        f"token counting, on a machine shared with other work (load average "
        f"{report.get('load_average', '?')} when the run ended).",
        "",
    ]


def update_docs(section: str, *, begin: str, end: str, path: Path = DOCS) -> None:
    """Put `section` between the markers `begin` and `end` of `path` (appended if absent);
    the rest of the file is left as it is."""
    block = f"{begin}\n{section}{end}\n"
    current = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        updated = head + block + ("\n" + tail if tail else "")
    else:
        updated = current.rstrip("\n") + "\n\n" + block
    path.write_text(updated, encoding="utf-8")
