"""The `### Performance: latency added by the gateway` part of docs/benchmarks.md's performance
section (`bench.report` puts it in place), drawn from `bench/results/overhead.json`: added
latency per size, text, mode and concurrency, the repetitive text beside the varied one
(`bench.texts_report`), the targets met or not, and the plot `perf-overhead.png`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import harness as h
from bench import texts_report
from bench.harness import met_cell, ms_cell

# Targets of the issue (milliseconds).
TARGET_P50 = 10.0
TARGET_P95 = 25.0
TARGET_TTFB = 15.0
TARGET_RELAY_FACTOR = 3.0


def render(data: Mapping[str, Any], images: Path, rel: str) -> list[str]:
    cells = data["cells"]
    failed = data.get("data", {}).get("dead_job_errors") or []
    lines = [
        *(
            [
                f"**Warning: background jobs failed during the set-up** (e.g. "
                f"`{failed[0][:160]}`): the conversations were not fully summarized.",
                "",
            ]
            if failed
            else []
        ),
        "Added latency = a target's percentile minus the upstream's, for the same requests "
        "sent back to back in rotating rounds (non-stream: whole answer; stream: time to the "
        "first event). Each request is a system prompt and one new user message on a "
        "pre-stored, fully summarized conversation (`X-Memstrata-Conversation`); the "
        "gateway stores both messages, so conversations grow while measured (`stored` is "
        "before → after). Concurrency-32 requests are spread over the size's pool of "
        "conversations; requests on one conversation wait for each other (row lock).",
        "",
    ]
    header = [
        "stored",
        "text",
        "mode",
        "conc.",
        "conv.",
        "n (gw)",
        "upstream p50 / p95",
        "relay added p50 / p95 / p99",
        "gateway added p50 / p95 / p99",
        "gw ÷ relay (p50)",
        "gw errors",
    ]
    rows = []
    for cell in cells:
        if cell.get("variant", "workers=0") != "workers=0":
            continue
        metric = cell["metric"]
        up = cell["targets"]["upstream"][metric]
        relay = cell["added_ms"]["relay"]
        gw = cell["added_ms"]["gateway"]
        rows.append(
            [
                f"{cell['stored_before']['max']:,} → {cell['stored_after']['max']:,}",
                cell.get("text", "varied"),
                cell["mode"],
                cell["concurrency"],
                cell["conversations"],
                cell["requests_per_target"].get("gateway", "?")
                if isinstance(cell["requests_per_target"], dict)
                else cell["requests_per_target"],
                f"{ms_cell(up['p50'])} / {ms_cell(up['p95'])}",
                f"{ms_cell(relay['p50'])} / {ms_cell(relay['p95'])} / {ms_cell(relay['p99'])}",
                f"{ms_cell(gw['p50'])} / {ms_cell(gw['p95'])} / {ms_cell(gw['p99'])}",
                ms_cell(cell.get("gateway_vs_relay_p50"), 1),
                cell["targets"]["gateway"][metric]["errors"],
            ]
        )
    lines += h.markdown_table(header, rows)
    variants = [c for c in cells if c.get("variant", "workers=0") != "workers=0"]
    if variants:
        lines += [
            "",
            "The same with the default `serve` (`MEMSTRATA_WORKERS=1`: one background job at a "
            "time, in `serve`'s child process), which embeds and summarizes the messages the "
            "requests store, on the same cores (measured once it has drained the backlog of "
            "messages the `MEMSTRATA_WORKERS=0` cells stored):",
            "",
        ]
        lines += h.markdown_table(
            ["stored", "text", "mode", "conc.", "gateway added p50 / p95 / p99", "gw errors"],
            [
                [
                    f"{c['stored_before']['max']:,}",
                    c.get("text", "varied"),
                    c["mode"],
                    c["concurrency"],
                    " / ".join(ms_cell(c["added_ms"]["gateway"][p]) for p in ("p50", "p95", "p99")),
                    c["targets"]["gateway"][c["metric"]]["errors"],
                ]
                for c in variants
            ],
        )
    lines += ["", *texts_report.render(data), ""]
    lines += ["", *_targets(cells), ""]
    _plot(cells, images / "perf-overhead.png")
    lines.append(f"![Added latency]({rel}/perf-overhead.png)")
    return lines


def _varied(cells: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The grid's cells: varied text, `MEMSTRATA_WORKERS=0`."""
    return [
        c
        for c in cells
        if c.get("variant", "workers=0") == "workers=0" and c.get("text", "varied") == "varied"
    ]


def _targets(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    main = _varied(cells)
    if not main:
        return []
    largest = max(c["size"] for c in main)

    def cell(mode: str, concurrency: int) -> Mapping[str, Any] | None:
        for c in main:
            if c["size"] == largest and c["mode"] == mode and c["concurrency"] == concurrency:
                return c
        return None

    def row(figure: str, target: float, value: float | None) -> list[str]:
        return [
            figure,
            f"≤ {target:.0f} ms",
            ms_cell(value),
            met_cell(value is not None and value <= target),
        ]

    rows = []
    ns, st = cell("non-stream", 1), cell("stream", 1)
    if ns:
        gw = ns["added_ms"]["gateway"]
        rows.append(row("p50 added, non-stream, c=1", TARGET_P50, gw["p50"]))
        rows.append(row("p95 added, non-stream, c=1", TARGET_P95, gw["p95"]))
    if st:
        rows.append(
            row(
                "first-byte added (p50), stream, c=1", TARGET_TTFB, st["added_ms"]["gateway"]["p50"]
            )
        )
    for c in (ns, st):
        if c and c.get("gateway_vs_relay_p50") is not None:
            ratio = c["gateway_vs_relay_p50"]
            rows.append(
                [
                    f"gateway ÷ relay floor (p50 added), {c['mode']}, c=1",
                    f"≤ {TARGET_RELAY_FACTOR:.0f}x",
                    f"{ratio:.1f}x",
                    met_cell(ratio <= TARGET_RELAY_FACTOR),
                ]
            )
    return [
        f"Targets at {largest:,} stored messages:",
        "",
        *h.markdown_table(["figure", "target", "measured", "met"], rows),
    ]


def _plot(cells: Sequence[Mapping[str, Any]], path: Path) -> None:
    main = _varied(cells)
    modes = sorted({c["mode"] for c in main}, key=lambda m: m != "non-stream")
    concurrencies = sorted({c["concurrency"] for c in main})
    sizes = sorted({c["size"] for c in main})
    fig, axes = plt.subplots(
        len(modes),
        len(concurrencies),
        figsize=(5.2 * len(concurrencies), 3.6 * len(modes)),
        squeeze=False,
    )
    width = 0.2
    for i, mode in enumerate(modes):
        for j, concurrency in enumerate(concurrencies):
            ax = axes[i][j]
            series = {
                "relay p50": ("relay", "p50", "#9ecae1"),
                "relay p95": ("relay", "p95", "#3182bd"),
                "gateway p50": ("gateway", "p50", "#fdae6b"),
                "gateway p95": ("gateway", "p95", "#e6550d"),
            }
            for k, (label, (target, p, color)) in enumerate(series.items()):
                values = []
                for size in sizes:
                    found = [
                        c
                        for c in main
                        if c["size"] == size
                        and c["mode"] == mode
                        and c["concurrency"] == concurrency
                    ]
                    value = found[0]["added_ms"][target][p] if found else None
                    values.append(max(value or 0.0, 0.5))
                xs = [x + (k - 1.5) * width for x in range(len(sizes))]
                ax.bar(xs, values, width, label=label, color=color)
            ax.set_xticks(range(len(sizes)), [f"{s:,}" for s in sizes])
            ax.set_yscale("log")
            ax.set_ylim(bottom=0.5)
            ax.set_xlabel("stored messages (values under 0.5 ms drawn at 0.5)")
            ax.set_ylabel("added ms (log)")
            what = "first byte" if mode == "stream" else "latency"
            ax.set_title(f"{mode}, concurrency {concurrency}: added {what}")
            if concurrency == 1:
                targets = [TARGET_TTFB] if mode == "stream" else [TARGET_P50, TARGET_P95]
                for level in targets:
                    ax.axhline(level, color="grey", linestyle="--", linewidth=0.8)
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
