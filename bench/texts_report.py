"""The request path on both texts, for `docs/benchmarks.md` (`bench.report` calls `render`).

From `bench.overhead`'s results: at concurrency 1, non-stream, the prompt build (the gateway's
`X-Memstrata-Overhead-Ms`: from the request's arrival to its forwarding) and the added latency
on the varied and the repetitive conversation, with `MEMSTRATA_WORKERS=0`, with the default
`serve` and with the default `serve` rebuilding every prompt (`MEMSTRATA_CONTEXT_MODE=rebuild`:
every leg of retrieval on every turn); `memory_search` through `/mcp`; and the targets they
are held to, each figure beside the load average it was measured at (on a shared machine,
times follow its load).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from bench import harness as h
from bench.overhead import DEFAULT_SERVE, REBUILD_SERVE

TARGET_ADDED_P50: Final = 25.0
TARGET_ADDED_P95: Final = 40.0
TARGET_BUILD_P95: Final = 25.0
TARGET_SEARCH_P95: Final = 25.0
WORKERS_OFF: Final = "workers=0"
VARIANTS: Final = (WORKERS_OFF, DEFAULT_SERVE, REBUILD_SERVE)


def _pair(figures: Mapping[str, Any] | None) -> str:
    if not figures or figures.get("p50") is None:
        return "-"
    return f"{figures['p50']:.1f} / {figures['p95']:.1f}"


def _at_c1(cells: Sequence[Mapping[str, Any]]) -> dict[tuple[int, str, str], Mapping[str, Any]]:
    """The c=1 non-stream cells by (size, text, variant)."""
    return {
        (c["size"], c.get("text", "varied"), c.get("variant", WORKERS_OFF)): c
        for c in cells
        if c["concurrency"] == 1 and c["mode"] == "non-stream"
    }


def _met(value: float | None, target: float) -> str:
    return "-" if value is None else ("yes" if value <= target else "**no**")


def render(data: Mapping[str, Any]) -> list[str]:
    """The tables (none when the run measured no repetitive conversation)."""
    sizes = data.get("settings", {}).get("repetitive") or []
    cells = _at_c1(data["cells"])
    rows = []
    for size in sizes:
        for text in h.TEXTS:
            measured = [cells.get((size, text, variant)) for variant in VARIANTS]
            if not any(measured):
                continue
            rows.append(
                [
                    f"{size:,}",
                    text,
                    *(
                        value
                        for cell in measured
                        for value in (
                            _pair(cell["targets"]["gateway"].get("overhead_header_ms"))
                            if cell
                            else "-",
                            _pair(cell["added_ms"]["gateway"]) if cell else "-",
                        )
                    ),
                    " / ".join(
                        f"{cell['load_average_1min']:.1f}" if cell else "-" for cell in measured
                    ),
                ]
            )
    if not rows:
        return []
    lines = [
        "Both texts at concurrency 1, non-stream: the varied conversations above, and one "
        'whose few words repeat as logs, support threads and agent transcripts do ("message '
        '412 about topic 10 with number 2884", asked "new question 7 about topic 3"). Prompt '
        "build = `X-Memstrata-Overhead-Ms` (identify, store and assemble: the request's arrival "
        "to its forwarding); added = latency minus the upstream's. With `MEMSTRATA_WORKERS=0` "
        "and with the default `serve`, whose child process embeds and summarizes what the "
        "requests store meanwhile; most of its turns reuse the working context and what was "
        "prepared for them. The default `serve` with `MEMSTRATA_CONTEXT_MODE=rebuild` runs "
        "every leg of retrieval on every turn, as a compaction, a topic change and the dry run "
        "do (the full path):",
        "",
        *h.markdown_table(
            [
                "stored",
                "text",
                "workers=0: build p50 / p95",
                "workers=0: added p50 / p95",
                "default serve: build p50 / p95",
                "default serve: added p50 / p95",
                "rebuild: build p50 / p95",
                "rebuild: added p50 / p95",
                "load average (workers=0 / default / rebuild)",
            ],
            rows,
        ),
    ]
    searches = data.get("searches") or []
    if searches:
        lines += [
            "",
            "`memory_search` (limit 8) called through `/mcp` one at a time on the default "
            "`serve`, the query's embedding included, right after the cells above: its worker "
            "is still embedding and summarizing what the concurrency-32 cell stored:",
            "",
            *h.markdown_table(
                ["stored", "text", "n", "p50 / p95 ms", "errors", "load average"],
                [
                    [
                        f"{s['size']:,}",
                        s["text"],
                        s["latency_ms"]["n"],
                        _pair(s["latency_ms"]),
                        s["latency_ms"]["errors"],
                        f"{s['load_average_1min']:.1f}",
                    ]
                    for s in searches
                ],
            ),
        ]
    lines += ["", *_targets(max(sizes), cells, searches)]
    return lines


def _targets(
    size: int,
    cells: Mapping[tuple[int, str, str], Mapping[str, Any]],
    searches: Sequence[Mapping[str, Any]],
) -> list[str]:
    rows = []
    for text in h.TEXTS:
        for variant, path in ((DEFAULT_SERVE, ""), (REBUILD_SERVE, ", rebuild")):
            cell = cells.get((size, text, variant))
            if cell is None:
                continue
            added = cell["added_ms"]["gateway"]
            build = cell["targets"]["gateway"].get("overhead_header_ms") or {}
            load = f"{cell['load_average_1min']:.1f}"
            rows += [
                [f"added p50, {text}{path}", f"≤ {TARGET_ADDED_P50:.0f} ms", added["p50"], load],
                [f"added p95, {text}{path}", f"≤ {TARGET_ADDED_P95:.0f} ms", added["p95"], load],
                [
                    f"prompt build p95, {text}{path}",
                    f"≤ {TARGET_BUILD_P95:.0f} ms",
                    build.get("p95"),
                    load,
                ],
            ]
        for search in searches:
            if search["size"] == size and search["text"] == text:
                rows.append(
                    [
                        f"`memory_search` p95, {text}",
                        f"≤ {TARGET_SEARCH_P95:.0f} ms",
                        search["latency_ms"]["p95"],
                        f"{search['load_average_1min']:.1f}",
                    ]
                )
    return [
        f"Targets at {size:,} stored messages, default `serve` (and rebuilding every prompt), c=1:",
        "",
        *h.markdown_table(
            ["figure", "target", "measured", "met", "load average"],
            [
                [
                    name,
                    target,
                    "-" if value is None else f"{value:.1f}",
                    _met(value, float(target.split()[1])),
                    load,
                ]
                for name, target, value, load in rows
            ],
        ),
    ]
