"""The `## Prompt caching` section of docs/benchmarks.md and its plots, drawn from the results
of `bench.cache` (`python -m bench.cache --report-only` redraws them), and the table that
compares narrowed runs (`python -m bench.cache --grid FILE ...`). Reads results as
`bench.cache` writes them: a summary per scenario and every turn's figures."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.evidence_report import ROOT

IMAGES = ROOT / "docs" / "img"
BEGIN, END = "<!-- cache:begin -->", "<!-- cache:end -->"


def plot(report: dict[str, Any], images: Path) -> None:
    """`cache-share.png` and `cache-billed.png`: one panel per conversation, turn by turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conversations = report["conversations"]
    columns = min(3, len(conversations))
    rows = -(-len(conversations) // columns)
    for name, key, label in (
        ("share", "share", "cacheable share of the prompt"),
        ("billed", "billed_10", "billed input, cached at 10 %"),
    ):
        figure, axes = plt.subplots(
            rows, columns, figsize=(4.4 * columns, 3.2 * rows), squeeze=False
        )
        for axis, conversation in zip(axes.flat, conversations, strict=False):
            turns = conversation["turns"]
            x = [t["turn"] for t in turns]
            for system, style in (("gateway", "-o"), ("full_history", "--")):
                axis.plot(x, [t[system][key] for t in turns], style, markersize=3, label=system)
            if key == "share":
                axis.set_ylim(-0.03, 1.03)
            else:
                # The first turn has nothing cached: its spike would flatten the rest.
                warm = [t[s][key] for t in turns[1:] for s in ("gateway", "full_history")]
                axis.set_ylim(0, 1.25 * max(warm or [1]))
            axis.set_title(conversation["external_id"], fontsize=9)
            axis.set_xlabel("turn")
            axis.set_ylabel(label, fontsize=8)
            axis.grid(alpha=0.3)
        for axis in list(axes.flat)[len(conversations) :]:
            axis.set_visible(False)
        axes[0][0].legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(images / f"cache-{name}.png", dpi=100)
        plt.close(figure)


def _mean_share(turns: Sequence[dict[str, Any]]) -> str:
    return f"{statistics.fmean(t['gateway']['share'] for t in turns):.2f}" if turns else "-"


def breakdown(report: dict[str, Any]) -> list[str]:
    """Where the gateway's share goes, per scenario: compaction turns, and the other turns with
    and without a recall note (new on its turn, so never cached)."""
    lines = [
        "**Where the share goes** (the gateway, turns after the first): a compaction rebuilds "
        "the prefix after the system prompt (or after the stable memory it keeps); on the other "
        "turns the recall note, new each turn, is the uncached part beside the new messages.",
        "",
        "| scenario | compactions per 100 turns | share on compaction turns | share on other "
        "turns with a note | share on other turns without | turns with a note | note tokens "
        "(mean, when sent) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in report["summary"]:
        turns = [t for c in report["conversations"] if c["kind"] == kind for t in c["turns"][1:]]
        rebuilt = [t for t in turns if t.get("rebuilt")]
        noted = [t for t in turns if not t.get("rebuilt") and t.get("note_tokens")]
        plain = [t for t in turns if not t.get("rebuilt") and not t.get("note_tokens")]

        sent = [t for t in turns if t.get("note_tokens")]
        lines.append(
            f"| {kind} | {100 * len(rebuilt) / max(len(turns), 1):.1f} | "
            f"{_mean_share(rebuilt)} | {_mean_share(noted)} | {_mean_share(plain)} | "
            f"{len(sent)} of {len(turns)} | "
            + (f"{statistics.fmean(t['note_tokens'] for t in sent):,.0f}" if sent else "-")
            + " |"
        )
    return lines


def targets(report: dict[str, Any]) -> list[str]:
    """Issue #13's targets, met or not."""
    warm = [t for c in report["conversations"] for t in c["turns"][1:]]
    past = [t for t in warm if t["history_over_budget"] > 3]
    share = statistics.fmean(t["gateway"]["share"] for t in warm)
    rows = [
        ("mean cacheable share per turn", "≥ 0.85", f"{share:.2f}", share >= 0.85),
    ]
    for kind, part in report["summary"].items():
        g, f = part["gateway"]["billed_50"], part["full_history"]["billed_50"]
        rows.append(
            (f"billed input at 50 %, {kind}", "≤ full history", f"{g:,.0f} vs {f:,.0f}", g <= f)
        )
    even = report["break_even_over_budget"]["billed_10"]
    worse = sum(t["gateway"]["billed_10"] > t["full_history"]["billed_10"] for t in past)
    spans = sorted(
        {
            (p["history_over_budget"][0], p["history_over_budget"][1])
            for p in report["summary"].values()
        }
    )
    rows.append(
        (
            "billed input at 10 %, past 3x the budget",
            "≤ full history",
            f"break-even at {even}x the budget; the turns replayed span "
            + " and ".join(f"{a}-{b}x" for a, b in spans)
            + f" (higher than the full history on {worse} of {len(past)} turns past 3x)",
            even is not None and even <= 3 and worse == 0,
        )
    )
    lines = ["| target (issue #13) | wanted | measured | met |", "|---|---|---|---|"]
    for name, wanted, measured, met in rows:
        lines.append(f"| {name} | {wanted} | {measured} | {'yes' if met else '**no**'} |")
    return lines


def render(report: dict[str, Any]) -> str:
    budget = report["budget"]
    lines = [
        "## Prompt caching",
        "",
        f"Measured {report['measured']} at commit `{report['machine']['git_commit'][:10]}`; "
        f"`python -m bench.cache` ({report['total_seconds']:.0f} s here). Raw figures, turn by "
        "turn: `bench/results/cache.json`.",
        "",
        "**What is measured.** A client resends its whole history with every new message, with "
        "no conversation header, to a real `memstrata serve` (budget "
        f"{budget:,}, default settings otherwise, extractive summaries); the fake upstream "
        "records every prompt and answers with the dataset's next assistant turn. LoCoMo: "
        f"each conversation's first {report['imported']} turns imported, then up to "
        f"{report['turns_per_locomo']} requests (one per run of user turns). LongMemEval: "
        f"{len(report['summary'].get('longmemeval', {}).get('conversations', []))} haystacks, "
        "all imported but their last sessions, which are then resent turn by turn "
        f"({report['turns_per_haystack']} user turns each). Each prompt is tokenized with "
        "o200k_base (the gateway's with its `tools` first, three framing tokens a message); "
        "cacheable = the prefix shared with the previous prompt, 0 below 1,024 tokens, else "
        "1,024 + 128·⌊(common - 1,024)/128⌋ (OpenAI's rule); billed input = uncached tokens + "
        "the cached ones at 10 % (Anthropic's cache reads) or 50 % (OpenAI), in uncached-token "
        "equivalents. The first replayed turn of each conversation (nothing before it to "
        "cache) is left out of the means.",
        "",
        "| scenario | system | prompt tokens | cacheable tokens | cacheable share | billed at "
        "10 % | billed at 50 % |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, part in report["summary"].items():
        for system in ("gateway", "full_history"):
            m = part[system]
            lines.append(
                f"| {kind} ({part['turns']} turns, {part['user_messages']} user messages, "
                f"history {part['history_over_budget'][0]}-"
                f"{part['history_over_budget'][1]}x the budget) | "
                f"{system.replace('_', ' ')} | {m['tokens']:,.0f} | {m['cacheable']:,.0f} | "
                f"{m['share']:.2f} | {m['billed_10']:,.0f} | {m['billed_50']:,.0f} |"
            )
    lines += [
        "",
        "Prompt tokens include the memory tools' definitions the gateway adds (its `tools`, "
        "billed as input); its own count of the messages alone (what the budget bounds) is "
        + ", ".join(
            f"{part['gateway_message_tokens']:,.0f} ({kind})"
            for kind, part in report["summary"].items()
        )
        + ".",
    ]
    longest = max(
        t["gateway"]["common_prefix"] for c in report["conversations"] for t in c["turns"]
    )
    lines += [
        "",
        f"Two consecutive gateway prompts shared at most {longest:,} tokens (the memory tools' "
        "definitions, the system prompt and what follows them unchanged); below 1,024 nothing "
        "is cacheable.",
    ]
    lines += ["", *breakdown(report)]
    lines += ["", "Gateway ÷ full history, billed input per turn:", ""]
    lines += ["| scenario | at 10 % | at 50 % |", "|---|---|---|"]
    for kind, part in report["summary"].items():
        g, f = part["gateway"], part["full_history"]
        lines.append(
            f"| {kind} | {g['billed_10'] / f['billed_10']:.2f}x | "
            f"{g['billed_50'] / f['billed_50']:.2f}x |"
        )
    lines += [
        "",
        "**From which turn the gateway is cheaper** (billed input at or below the "
        "full history's on that turn and every later one):",
        "",
    ]
    lines += ["| conversation | at 10 % | at 50 % |", "|---|---|---|"]
    for part in report["summary"].values():
        for conversation, cheaper in part["gateway_cheaper_from"].items():
            cells = [
                "never in the replay"
                if c is None
                else f"turn {c['turn']} (history {c['history_over_budget']}x the budget)"
                for c in (cheaper["billed_10"], cheaper["billed_50"])
            ]
            lines.append(f"| {conversation} | " + " | ".join(cells) + " |")
    lines += ["", *targets(report)]
    even = report["break_even_over_budget"]
    lines += [
        "",
        "Break-even history size (the full history's billed input, the history cached and "
        "the new turn not, against the gateway's mean billed input): "
        + ", ".join(
            f"at {key.split('_')[1]} % {'-' if v is None else f'{v}x the budget'}"
            for key, v in even.items()
        )
        + ".",
        "",
        "![cacheable share per turn](img/cache-share.png)",
        "",
        "![billed input per turn at 10 %](img/cache-billed.png)",
        "",
    ]
    return "\n".join(lines)


def grid(paths: Sequence[Path]) -> list[str]:
    """A Markdown table comparing runs (`--output` files of narrowed runs with `--set`): per
    scenario, the mean cacheable share, the share on turns without a compaction, compactions
    per 100 turns, the note's mean tokens and the billed input beside the full history's."""
    lines = [
        "| settings | scenario | share | share, no compaction | compactions / 100 turns | "
        "note tokens | billed at 10 % (full history) | billed at 50 % (full history) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in paths:
        report = json.loads(path.read_text(encoding="utf-8"))
        name = ", ".join(f"{k}={v}" for k, v in report["settings"].items()) or "defaults"
        warm = [t for c in report["conversations"] for t in c["turns"][1:]]
        pooled = statistics.fmean(t["gateway"]["share"] for t in warm)
        for kind, part in report["summary"].items():
            g, f = part["gateway"], part["full_history"]
            lines.append(
                f"| {name} (pooled {pooled:.3f}) | {kind} | {g['share']:.3f} | "
                f"{part['share_without_rebuilds']:.3f} | {part['rebuilt_per_100_turns']} | "
                f"{part['note_tokens']:,.0f} | {g['billed_10']:,.0f} ({f['billed_10']:,.0f}) | "
                f"{g['billed_50']:,.0f} ({f['billed_50']:,.0f}) |"
            )
    return lines
