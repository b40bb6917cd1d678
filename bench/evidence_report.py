"""The markdown both evidence-recall reports share (`bench.locomo_report`,
`bench.longmemeval`), and the one way a benchmark's section of docs/benchmarks.md is replaced.

`recall_table()` is one row per method, one column per budget; `group_table()` one row per
group (a LoCoMo category, a LongMemEval question type), each cell every method's score;
`size_table()` the prompts' mean size and the dry run's time; `layout()` how the working
context's prompt is laid out, with the settings a run measured. `update_docs()` puts a section
between its begin and end markers (appended when absent) and leaves the rest of the file as
it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.evidence import METHODS
from memory.recall import compaction
from memory.recall.working_context import Policy

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
LABELS = {
    "memstrata": "memstrata, working context (memory tools off)",
    "memstrata_rebuild": "memstrata, per-query rebuild (memory tools off)",
    "memstrata_graph": "memstrata, working context with the graph leg (memory tools off)",
    "memstrata_tools": "memstrata, memory tools offered (their definitions reserved)",
    "newest": "newest turns only",
    "flat_embedding": "flat MiniLM top-k",
    "flat_fulltext": "flat full-text top-k",
}


LAYOUT = """**How the prompt is laid out here.** With the working context (the default, \
`MEMSTRATA_CONTEXT_MODE=working`), a conversation imported at once has no working context yet, \
so the question's turn builds it as the first turn past the budget does \
(`memory.recall.compaction.build`): the newest turns verbatim down to the low-water mark \
({low:.0%} of the budget with the question), one stable-memory message before them (a frontier \
of the summary tree over everything older, {stable} of the budget), then the question's recall \
note (`memory.recall.recall_note`: past messages outside the context, verbatim, best fused \
score first, at most {note:.0%} of the budget) and the question; nothing is saved, and the \
next real turn sends the same prompt byte for byte (`tests/test_working_context.py`). The \
prompt is {share} of the budget. This is the note's best point of the context's cycle: turn \
after turn the context grows toward the high-water mark ({high:.0%} of the budget) and the \
note gets what is left below the budget, at most its share, until a compaction brings the \
context back to the low-water mark. The per-query rebuild \
(`MEMSTRATA_CONTEXT_MODE=rebuild`, the layout every figure here had before issue #13) fills the \
whole budget for each question."""


def layout(report: dict[str, Any], budgets: list[str]) -> list[str]:
    """The working context's layout, with the settings the run measured (none recorded: the
    run predates the working context, and every figure is the rebuild's)."""
    settings = report.get("context_settings")
    if not settings:
        return []
    sizes = report["prompt_tokens_mean"].get("memstrata", {})
    share = ", ".join(
        f"{sizes[b] / int(b):.0%} at {int(b) // 1000}k" for b in budgets if b in sizes
    )
    return [
        LAYOUT.format(
            low=settings["context_low_water"],
            high=settings["context_high_water"],
            note=settings["note_share"],
            stable=f"{compaction.CONSOLIDATED * Policy().stable:.1%}",
            share=share or "less than the budget",
        ),
        "",
    ]


def _head(first: str, budgets: Sequence[str]) -> list[str]:
    return [
        f"| {first} | " + " | ".join(f"{int(b) // 1000}k" for b in budgets) + " |",
        "|---|" + "---|" * len(budgets),
    ]


def recall_table(table: dict[str, Any], budgets: Sequence[str], key: str = "overall") -> list[str]:
    """One row per method measured (memstrata's figures in bold): `table[method][budget][key]`."""
    lines = _head("method", budgets)
    for method in (m for m in METHODS if m in table):
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
    """One row per `(key, label)` group; a cell holds every measured method's score (in the
    order `methods_named` gives), `-` where none."""
    lines = _head(first, budgets)
    for key, label in groups:
        cells = []
        for b in budgets:
            values = [table[m][b].get(key) for m in METHODS if m in table]
            cells.append(" / ".join("-" if v is None else f"{v:.2f}" for v in values))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


SHORT = {
    "memstrata": "working context",
    "memstrata_rebuild": "per-query rebuild",
    "memstrata_graph": "with the graph leg",
    "memstrata_tools": "with memory tools",
    "newest": "newest",
    "flat_embedding": "flat MiniLM",
    "flat_fulltext": "flat full-text",
}


SIZED = ("memstrata", "memstrata_rebuild", "flat_embedding")
"""The methods whose mean prompt size the size table gives."""


def methods_named(table: dict[str, Any]) -> str:
    """The measured methods in a `group_table` cell's order, `a / b / c`."""
    return " / ".join(SHORT[m] for m in METHODS if m in table)


def size_table(report: dict[str, Any], budgets: Sequence[str]) -> list[str]:
    """The `### Prompt size and build time` subsection: the mean prompt of each measured
    method of `SIZED`, and the dry run's time (the working context's)."""
    tokens_mean = report["prompt_tokens_mean"]
    latency = report["build_latency_ms"]
    sized = [m for m in SIZED if m in tokens_mean]
    lines = [
        "### Prompt size and build time",
        "",
        "| budget | "
        + " | ".join(f"{SHORT[m]} prompt tokens (mean)" for m in sized)
        + " | build p50 ms | build p95 ms |",
        "|---|" + "---|" * (len(sized) + 2),
    ]
    for b in budgets:
        cells = [f"{tokens_mean[m][b]:,.0f}" for m in sized]
        lines.append(
            f"| {int(b):,} | "
            + " | ".join(cells)
            + f" | {latency[b]['p50']:.1f} | {latency[b]['p95']:.1f} |"
        )
    return [
        *lines,
        "",
        "Build time is the whole `dry_run` of the first method (the working context when "
        "measured): finding the conversation, embedding the question "
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
