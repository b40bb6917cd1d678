"""The performance report: `docs/benchmarks.md`'s `## Performance` section and its plots.

    python -m bench.report [--quick]

Reads `bench/results/{overhead,costs,load,scale,profile}.json` (whichever exist) and
`bench/closing_note.md` (written by hand), and writes the section (its part on added latency
drawn by `bench.overhead_report`) between the markers `<!-- performance:begin -->` and
`<!-- performance:end -->` of `docs/benchmarks.md`, leaving every other section of the file as
it is (a file without the markers gets the section appended), and PNG plots (matplotlib, Agg)
into `docs/img/`. With `--quick` it reads `bench/results/quick/` and writes
`bench/results/quick/benchmarks.md` and its plots there instead, so a quick run never replaces
the published figures.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import costs, overhead_report
from bench import harness as h
from bench.harness import met_cell, ms_cell

DOCS = h.REPO_ROOT / "docs" / "benchmarks.md"
IMAGES = h.REPO_ROOT / "docs" / "img"
BEGIN = "<!-- performance:begin -->"
END = "<!-- performance:end -->"

# Targets of the issue (requests per second, milliseconds).
TARGET_RPS = 200.0
TARGET_RETRIEVAL_P95 = 10.0

# Written by hand from the profile of the run it names, in Markdown; `make bench` copies it in
# and redraws the rest. Update it when the profile changes.
CLOSING_NOTE = Path(__file__).with_name("closing_note.md")


def _load(directory: Path, name: str) -> dict[str, Any] | None:
    path = directory / f"{name}.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# -- set-up -----------------------------------------------------------------------------------


def _setup(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    any_result = next(iter(results.values()))
    machine = any_result["machine"]
    settings = any_result.get("settings", {})
    versions = machine.get("versions", {})
    commit = (machine.get("git_commit") or "?")[:10] + (
        " (+ local changes)" if machine.get("git_dirty") else ""
    )
    lines = [
        f"Measured {machine.get('measured_at', '?')} at commit `{commit}` on "
        f"{machine.get('cpu_count')} x {machine.get('cpu_model')} ({machine.get('memory_gb')} GB), "
        f"Python {machine.get('python')}, "
        + ", ".join(
            f"{name} {versions[name]}"
            for name in ("fastapi", "uvicorn", "sqlalchemy", "asyncpg", "httpx")
            if name in versions
        )
        + ".",
        "",
        "- Everything runs on this one machine: the load generator (one Python process, "
        "httpx), the fake upstream (`devkit/upstream_server.py`), the relay floor "
        "(`bench/relay.py`), Postgres and the gateway share its cores, so figures at high "
        "concurrency are CPU-bound for all of them.",
        f"- Upstream latency {settings.get('upstream_latency_s', 0) * 1000:.0f} ms, "
        f"stream chunk delay {settings.get('upstream_chunk_delay_s', 0) * 1000:.0f} ms; "
        f"{settings.get('database', 'embedded Postgres')}; "
        f"{settings.get('gateway', 'memstrata serve')}.",
        *_runs(results),
        "- Reproduce with `make bench` (about 12 minutes here, a third of it waiting for the "
        "summary trees; `make bench-quick` is a small version in under 3). Raw figures: "
        "`bench/results/*.json`; a busy machine slows everything down, so compare targets "
        "run side by side rather than runs made at different times.",
    ]
    return lines


def _runs(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """One line per results file: when, at which commit, and how busy the machine was."""
    lines = []
    for name, data in results.items():
        machine = data["machine"]
        load = machine.get("load_average_1_5_15")
        others = machine.get("other_busy_processes") or []
        commit = (machine.get("git_commit") or "?")[:10]
        lines.append(
            f"- `{name}`: measured {machine.get('measured_at', '?')}, commit `{commit}`"
            + (" + local changes" if machine.get("git_dirty") else "")
            + (f", load average {load[0]:.1f}" if load else ", load average not recorded")
            + (f", {len(others)} other busy processes on the machine" if others else "")
            + "."
        )
    return lines


# -- load -------------------------------------------------------------------------------------


def _load_section(data: Mapping[str, Any], images: Path, rel: str) -> list[str]:
    config = data["config"]
    lines = [
        f"{config['concurrency']} virtual clients, each resending its short conversation's "
        f"whole history (up to {config['turns']} turns, no conversation header: the gateway "
        "matches the hash chain), non-stream; the gateway for "
        f"{config['duration']:.0f} s, the references for {config['reference_duration']:.0f} s. "
        "The gateway runs on an empty database of its own.",
        "",
    ]
    rows = []
    for target in data["targets"]:
        lat = target["latency_ms"]
        rows.append(
            [
                target["target"],
                target.get("settings", ""),
                f"{target['requests_per_second']:.1f}",
                target["ok"],
                target["errors"],
                f"{ms_cell(lat['p50'])} / {ms_cell(lat['p95'])} / {ms_cell(lat['p99'])}",
                ms_cell(target.get("cpu_ms_per_request"), 2),
                ms_cell(target.get("postgres_cpu_ms_per_request"), 2),
                ms_cell((target.get("memory_after") or {}).get("rss_mib")),
            ]
        )
    lines += h.markdown_table(
        [
            "target",
            "settings",
            "req/s",
            "ok",
            "errors",
            "latency p50 / p95 / p99 ms",
            "gateway CPU ms/request",
            "Postgres CPU ms/request",
            "RSS MiB after",
        ],
        rows,
    )
    gateway = next((t for t in data["targets"] if t["target"] == "gateway"), None)
    if gateway and gateway.get("cpu_ms_per_request"):
        cpu = gateway["cpu_ms_per_request"]
        lines += [
            "",
            f"The gateway used {cpu:.1f} ms of CPU per request ({gateway.get('cpu_cores_busy')} "
            "cores busy on average). One `serve` process runs one event loop, so at that cost "
            f"it cannot exceed about {1000 / cpu:.0f} requests/s on one core even on an idle "
            f"machine; {TARGET_RPS:.0f} requests/s needs at most {1000 / TARGET_RPS:.0f} ms "
            "per request.",
        ]
    if gateway:
        met = gateway["requests_per_second"] >= TARGET_RPS and gateway["errors"] == 0
        lines += [
            "",
            f"Target: ≥ {TARGET_RPS:.0f} requests/s with zero errors from one `serve` process — "
            f"measured {gateway['requests_per_second']:.1f} requests/s with "
            f"{gateway['errors']} errors: {'met' if met else '**not met**'}.",
        ]
    _plot_load(data["targets"], images / "perf-load.png")
    lines += ["", f"![Throughput over time]({rel}/perf-load.png)"]
    return lines


def _plot_load(targets: Sequence[Mapping[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for target in targets:
        series = target.get("per_second", [])[:-1] or target.get("per_second", [])
        ax.plot(range(len(series)), [max(v, 1) for v in series], label=target["target"])
    ax.axhline(TARGET_RPS, color="grey", linestyle="--", linewidth=0.8, label="target")
    ax.set_xlabel("second of the run")
    ax.set_ylabel("requests completed / s")
    ax.set_yscale("log")
    ax.set_ylim(bottom=1)
    ax.set_title("Sustained throughput at concurrency 64")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- scale ------------------------------------------------------------------------------------


def _scale(data: Mapping[str, Any], images: Path, rel: str) -> list[str]:
    one, many = data["conversation"], data["tenant"]
    retrieval, db = data["retrieval"], data["database"]

    def until(part: Mapping[str, Any]) -> str:
        if part.get("fully_summarized"):
            return f"{part['seconds_until_summarized']:.0f} s"
        projected = part.get("projected_seconds_until_embedded")
        extra = f"; about {projected / 60:.0f} min projected" if projected else ""
        final = part.get("final") or {}
        return (
            f"not within {part['waited_seconds']:.0f} s ({final.get('embedded', '?'):,} of "
            f"{final.get('messages', '?'):,} messages embedded{extra})"
        )

    rows = [
        [
            f"one conversation of {one['messages']:,}",
            f"{one['import_messages_per_second']:,.0f} msg/s",
            until(one),
            ms_cell(one.get("embedding_rate_per_second")),
            ms_cell((one.get("gateway_memory") or {}).get("rss_mib")),
        ],
        [
            f"tenant of {many['messages']:,} (+{many['messages_imported']:,} imported)",
            f"{many['import_messages_per_second'] or 0:,.0f} msg/s",
            until(many),
            ms_cell(many.get("embedding_rate_per_second")),
            ms_cell((many.get("gateway_memory") or {}).get("rss_mib"))
            + f" (peak {ms_cell((many.get('gateway_memory') or {}).get('peak_rss_mib'))})",
        ],
    ]
    failed = [*one.get("dead_job_errors", []), *many.get("dead_job_errors", [])]
    warning = (
        [
            f"**Warning: background jobs failed for good during this run** (e.g. "
            f"`{failed[0][:160]}`): the summary trees are incomplete and the figures below "
            "do not describe a working build.",
            "",
        ]
        if failed
        else []
    )
    lines = [
        *warning,
        "Bulk import through `POST /admin/conversations/{id}/messages` (1,000 messages a "
        "request) into `memstrata serve` with its in-process worker (local embeddings, "
        "extractive summaries); summarized = the job queue is empty.",
        "",
        *h.markdown_table(
            ["data", "import rate", "until fully summarized", "embedded msg/s", "gateway RSS MiB"],
            rows,
        ),
        "",
    ]
    if retrieval.get("status") == "measured":
        rrows = []
        for scope in ("conversation", "tenant"):
            part = retrieval.get(scope)
            if not part:
                continue
            s = part["search_ms"]
            met = s["p95"] is not None and s["p95"] <= TARGET_RETRIEVAL_P95
            rrows.append(
                [
                    f"{scope} ({part['conversations']} conversations)",
                    s["n"],
                    f"{ms_cell(s['p50'])} / {ms_cell(s['p95'])}",
                    met_cell(met) if scope == "tenant" else "-",
                ]
            )
        emb = retrieval["query_embedding_ms"]
        lines += [
            f"Retrieval (`memory.recall.retrieval.search`, limit 10, hybrid) over "
            f"{retrieval['tenant_messages']:,} stored messages "
            f"({retrieval['tenant_nodes_embedded']:,} nodes embedded); the query's embedding "
            f"(local model) costs {ms_cell(emb['p50'])} / {ms_cell(emb['p95'])} ms p50 / p95 "
            "on top:",
            "",
            *h.markdown_table(
                ["scope", "queries", "search p50 / p95 ms", f"p95 ≤ {TARGET_RETRIEVAL_P95:.0f} ms"],
                rrows,
            ),
            "",
        ]
    else:
        lines += [f"Retrieval latency: {retrieval.get('status', 'pending')}.", ""]
    lines += [
        f"Database: {db['bytes_per_message']:,} bytes per stored message in all "
        f"({db['messages']:,} messages, {db['summaries']:,} summaries, "
        f"{db['database_bytes'] / 2**20:,.0f} MiB); the `nodes` table holds "
        f"{db['nodes_heap_bytes_per_message']:,} B heap + {db['nodes_toast_bytes_per_message']:,} "
        f"B TOAST + {db['nodes_index_bytes_per_message']:,} B indexes per message. Largest "
        "indexes: "
        + ", ".join(
            f"`{name}` {size / 2**20:,.0f} MiB" for name, size in list(db["indexes"].items())[:4]
        )
        + ".",
        "",
    ]
    _plot_scale(one, many, images / "perf-scale.png")
    lines.append(f"![Summarization progress]({rel}/perf-scale.png)")
    return lines


def _plot_scale(one: Mapping[str, Any], many: Mapping[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, part, title in (
        (axes[0], one, f"one conversation of {one['messages']:,}"),
        (axes[1], many, f"tenant of {many['messages']:,}"),
    ):
        samples = part.get("progress") or []
        xs = [s["seconds"] for s in samples]
        for key, label in (
            ("messages", "stored"),
            ("embedded", "embedded"),
            ("summarized", "in a summary"),
            ("summaries", "summaries made (all levels)"),
        ):
            style = "--" if key == "summaries" else "-"
            ax.plot(xs, [s[key] for s in samples], style, label=label)
        ax.set_title(title)
        ax.set_xlabel("seconds from the start of the import")
        ax.set_ylabel("messages")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- profile ----------------------------------------------------------------------------------


def _profile(data: Mapping[str, Any], images: Path, rel: str, results_rel: str) -> list[str]:
    runs = data["runs"]
    stages = runs.get("stages", {}).get("timers", {})
    c1, c32 = runs.get("c1", {}), runs.get("c32", {})
    lines = [
        f"`bench/profile.py` runs `memstrata serve`'s app with profiling controls, background "
        f"workers off, on the conversation of {data['size']:,} messages (pyinstrument call "
        f"trees: `{results_rel}/profile-c1.txt`, `{results_rel}/profile-c32.txt`; all figures: "
        f"`{results_rel}/profile.json`).",
        "",
    ]
    for label, run in (("c=1", c1), ("c=32 (small conversations)", c32)):
        if not run:
            continue
        view = run["client_view"]["latency_ms"]
        lines.append(
            f"- {label}: {run['requests']} requests, {run['requests_per_second']} req/s, "
            f"latency p50 {ms_cell(view['p50'])} ms, "
            f"gateway CPU {run['gateway_cpu_ms_per_request']} ms per request (all threads)"
            + (
                f", Postgres CPU {run['postgres_cpu_ms_per_request']} ms per request."
                if run.get("postgres_cpu_ms_per_request") is not None
                else "."
            )
        )
    if stages:
        lines += [
            f"- {stages['sql_statements_per_request']} SQL statements per request, "
            f"{stages['sql_ms_per_request']} ms waiting for them.",
            "",
            "Wall time inside the instrumented functions, per request at c=1 (inclusive: a "
            "function's time contains its callees'; timers add a little):",
            "",
            *h.markdown_table(
                ["function", "calls / request", "ms / request"],
                [
                    [f"`{r['name']}`", r["calls_per_request"], ms_cell(r["ms_per_request"], 2)]
                    for r in stages["functions"][:14]
                ],
            ),
            "",
            "The most expensive SQL statements per request:",
            "",
            *h.markdown_table(
                ["statement", "calls / request", "ms / request"],
                [
                    [
                        f"`{r['name'][:110]}`",
                        r["calls_per_request"],
                        ms_cell(r["ms_per_request"], 2),
                    ]
                    for r in stages["sql"][:6]
                ],
            ),
        ]
    packages = (c32 or c1).get("by_package", {})
    if packages.get("packages"):
        lines += [
            "",
            "Where the event-loop thread spends its busy time at saturation (pyinstrument self "
            "time by package, c=32):",
            "",
            *h.markdown_table(
                ["package", "share of busy time"],
                [
                    [f"`{p['package']}`", f"{p['share'] * 100:.0f} %"]
                    for p in packages["packages"][:10]
                ],
            ),
        ]
        _plot_profile(stages, packages, images / "perf-profile.png")
        lines += ["", f"![Profile]({rel}/perf-profile.png)"]
    return lines


def _plot_profile(stages: Mapping[str, Any], packages: Mapping[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    rows = (stages.get("functions") or [])[:12][::-1]
    axes[0].barh([r["name"].split(".", 1)[1] for r in rows], [r["ms_per_request"] for r in rows])
    axes[0].set_xlabel("ms per request (inclusive wall time, c=1)")
    axes[0].tick_params(axis="y", labelsize=7)
    top = packages.get("packages", [])[:10][::-1]
    axes[1].barh([p["package"] for p in top], [p["share"] * 100 for p in top], color="#e6550d")
    axes[1].set_xlabel("% of busy event-loop time (c=32)")
    axes[1].tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the document -----------------------------------------------------------------------------


def section(directory: Path, images: Path, rel: str, results_rel: str) -> str:
    results = {
        name: data
        for name in ("overhead", "costs", "load", "scale", "profile")
        if (data := _load(directory, name)) is not None
    }
    lines = [BEGIN, "## Performance", ""]
    if not results:
        lines += ["No results yet: run `make bench`.", END]
        return "\n".join(lines) + "\n"
    lines += _setup(results)
    if "overhead" in results:
        lines += ["", "### Performance: latency added by the gateway", ""]
        lines += overhead_report.render(results["overhead"], images, rel)
    if "costs" in results:
        lines += ["", "### Performance: what a prompt build reads", ""]
        lines += costs.render(results["costs"])
    if "load" in results:
        lines += ["", "### Performance: throughput", ""]
        lines += _load_section(results["load"], images, rel)
    if "scale" in results:
        lines += ["", "### Performance: scale", ""]
        lines += _scale(results["scale"], images, rel)
    if "profile" in results:
        lines += ["", "### Performance: profile of the request path", ""]
        lines += _profile(results["profile"], images, rel, results_rel)
    lines += ["", "### Performance: closing note", "", CLOSING_NOTE.read_text().rstrip(), END]
    return "\n".join(lines) + "\n"


def splice(document: str, block: str) -> str:
    """`document` with its performance block replaced by `block` (appended if absent)."""
    if BEGIN in document and END in document:
        head, rest = document.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        return head + block.rstrip("\n") + tail
    if not document.strip():
        document = "# Benchmarks\n"
    return document.rstrip("\n") + "\n\n" + block


def write(directory: Path, *, quick: bool = False) -> Path:
    if quick:
        target, images, rel, results_rel = (
            directory / "benchmarks.md",
            directory / "img",
            "img",
            "bench/results/quick",
        )
    else:
        target, images, rel, results_rel = DOCS, IMAGES, "img", "bench/results"
    block = section(directory, images, rel, results_rel)
    existing = target.read_text() if target.exists() else ""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(splice(existing, block))
    h.log(f"report written to {target}")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    write(h.RESULTS_DIR / "quick" if args.quick else h.RESULTS_DIR, quick=args.quick)


if __name__ == "__main__":
    main()
