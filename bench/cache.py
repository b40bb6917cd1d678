"""The prompt-cache benchmark: how much of each prompt the gateway sends a provider could serve
from its prompt cache, and what the input then costs, beside sending the whole history as is.

    python -m bench.cache [--locomo ../shared/data/locomo10.json] [--conversations 0,2]
                          [--imported 300] [--turns 60]
                          [--longmemeval ../shared/data/longmemeval_s_dev] [--haystacks 3]
                          [--lme-turns 20] [--seed 13] [--budget 8000]
                          [--scenarios locomo,longmemeval] [--set NAME=VALUE ...]
                          [--output FILE] [--prompts DIR] [--report-only]
    python -m bench.cache --grid FILE [FILE ...]

A client is replayed as real ones behave: it keeps its whole history and resends it with every
new user message, with no conversation header, to a real `memstrata serve`
(`devkit.gateway.GatewayProcess`, `MEMSTRATA_CONTEXT_BUDGET` the budget, extractive summaries,
its in-process worker; `--set NAME=VALUE` adds any other `MEMSTRATA_*` setting, lower-case
without the prefix, to compare settings) in front of the fake upstream (`devkit.upstream`),
which records every prompt it receives and answers with the dataset's next assistant turn
(scripted per request), so the history the client resends is the dataset's. The start of each
conversation is imported first through the admin bulk import, and the background queue drained;
after each turn the queue is drained again (a person takes longer to type than the gateway to
build).

Scenarios (`scenarios()`):
* **LoCoMo** -- a conversation's first `--imported` turns (up to its next user turn) imported,
  then `--turns` requests, each with the speaker_a turns that follow as new user messages and
  the speaker_b turns after them (joined) as the reply; names kept in `name`, as
  `bench.locomo` stores them.
* **LongMemEval** -- `--haystacks` haystacks drawn by a seeded shuffle among those whose
  resent messages each fit in a quarter of the budget: all sessions imported but the last
  ones, which hold the `--lme-turns` last user turns; those are then resent turn by turn.

Every prompt (the gateway's as the upstream received it, `tools` first as providers place
them; the client's own messages for the full history) is tokenized with o200k_base
(`serialize()`: each message framed by three marker tokens, as OpenAI counts three tokens of
framing a message). Per turn: the common prefix with the previous prompt of the same
conversation, the cacheable part under OpenAI's rule (`cacheable()`: nothing below 1,024
tokens, then 1,024 plus whole 128-token steps), its share of the prompt, and the billed input
with cached tokens at 10 % and 50 % of the price (in uncached-token equivalents). A
conversation's first replayed turn has no previous prompt and is left out of the means. Each
turn also says whether the gateway's prompt was rebuilt (`rebuilt()`: it does not repeat the
previous prompt, whole or without that turn's recall note: a compaction), and how many tokens
its note and its stable memory take; the summary gives compactions per 100 turns and the share
on the other turns. `--prompts DIR` keeps every gateway prompt (one JSON file per turn).

Results: `bench/results/cache.json` (every turn's figures), plots `docs/img/cache-share.png`
(the share turn by turn: a compaction shows as a drop) and `docs/img/cache-billed.png`, and the
`## Prompt caching` section of docs/benchmarks.md (drawn by `bench.cache_report`). A narrowed
run (`--scenarios`, fewer turns, haystacks or conversations than the defaults) writes
`cache-quick.json`, docs untouched; `--grid` prints a table comparing such runs (how the marks'
defaults were chosen).

Quick, while tuning (one LoCoMo conversation, one haystack; ~5 min on a loaded machine):
`python -m bench.cache --conversations 0 --turns 30 --haystacks 1 --set context_low_water=0.5
--output /tmp/low50.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import harness
from bench.cache_report import BEGIN, END, IMAGES, grid, plot, render
from bench.evidence import Turn
from bench.evidence_report import ROOT, update_docs
from bench.locomo import DATA as LOCOMO_DATA
from bench.locomo import load as load_locomo
from bench.longmemeval import DATA as LME_DATA
from bench.longmemeval import load as load_haystack
from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.upstream import UpstreamServer
from memory import tokens
from memory.recall.recall_note import HEADER as NOTE_HEADER

RESULTS = ROOT / "bench" / "results" / "cache.json"
MODEL = "gpt-4o"
ENCODING = "o200k_base"
RATES = (0.1, 0.5)
MIN_PREFIX, STEP = 1024, 128
# Framing tokens no text encodes to: a message boundary is never mistaken for shared text.
_START, _SEP, _END = -1, -2, -3
DEFAULTS = {"conversations": "0,2", "imported": 300, "turns": 60, "haystacks": 3, "lme_turns": 20}


@dataclass
class Exchange:
    """One request: the new user messages, and the reply the upstream gives (None: its echo)."""

    new: list[dict[str, Any]]
    reply: str | None


@dataclass
class Scenario:
    kind: str
    external_id: str
    imported: list[dict[str, Any]]
    exchanges: list[Exchange]
    turns: list[dict[str, Any]] = field(default_factory=list)


def _stored(turn: Turn) -> dict[str, Any]:
    return {**turn.message(), "created_at": turn.created_at.isoformat()}


def _opening() -> dict[str, Any]:
    return {"role": "system", "content": harness.SYSTEM_PROMPT}


def exchanges(turns: Sequence[Turn], limit: int) -> list[Exchange]:
    """`turns` as requests: each run of user turns is one request's new messages, the run of
    assistant turns after it (joined by a blank line) its reply."""
    found: list[Exchange] = []
    index = 0
    while index < len(turns) and len(found) < limit:
        new = []
        while index < len(turns) and turns[index].role == "user":
            new.append(turns[index].message())
            index += 1
        replies = []
        while index < len(turns) and turns[index].role != "user":
            replies.append(turns[index].text)
            index += 1
        if new:
            found.append(Exchange(new, "\n\n".join(replies) if replies else None))
    return found


def locomo_scenarios(
    data: Path, numbers: Sequence[int], imported: int, turns: int
) -> list[Scenario]:
    found = []
    for sample in load_locomo(data, None, max(numbers) + 1):
        if sample.number not in numbers:
            continue
        start = imported
        while start < len(sample.turns) and sample.turns[start].role != "user":
            start += 1
        found.append(
            Scenario(
                kind="locomo",
                external_id=f"cache-locomo-{sample.number}",
                imported=[_opening(), *(_stored(t) for t in sample.turns[:start])],
                exchanges=exchanges(sample.turns[start:], turns),
            )
        )
    return found


def longmemeval_scenarios(
    folder: Path, count: int, turns: int, seed: int, budget: int
) -> list[Scenario]:
    ids = sorted(path.stem for path in folder.glob("*.json"))
    random.Random(seed).shuffle(ids)
    found: list[Scenario] = []
    for question_id in ids:
        if len(found) == count:
            break
        haystack = load_haystack(folder / f"{question_id}.json")
        sessions = [int(turn.key.split(":")[0]) for turn in haystack.turns]
        # The last sessions, back to the one that brings the user turns to `turns`.
        users, first = 0, len(haystack.turns)
        while first > 0 and users < turns:
            session = sessions[first - 1]
            while first > 0 and sessions[first - 1] == session:
                first -= 1
                users += haystack.turns[first].role == "user"
        resent = haystack.turns[first:]
        if users < turns or any(
            tokens.count_text(t.text, model=MODEL) > budget // 4 for t in resent
        ):
            continue
        found.append(
            Scenario(
                kind="longmemeval",
                external_id=f"cache-lme-{question_id}",
                imported=[_opening(), *(_stored(t) for t in haystack.turns[:first])],
                exchanges=exchanges(resent, turns),
            )
        )
    return found


# -- tokens and the caching rule -------------------------------------------------------------


@functools.cache
def _encoded(text: str) -> tuple[int, ...]:
    return tuple(tokens.get_encoding(ENCODING).encode(text, disallowed_special=()))


def _message_tokens(message: dict[str, Any]) -> list[int]:
    header = message["role"] + (f" {message['name']}" if message.get("name") else "")
    body = tokens.message_text(message)
    for key in ("tool_calls", "tool_call_id"):
        if message.get(key):
            body += json.dumps(message[key], separators=(",", ":"))
    return [_START, *_encoded(header), _SEP, *_encoded(body), _END]


def serialize(messages: Sequence[dict[str, Any]], tools: Any = None) -> np.ndarray[Any, Any]:
    """A prompt's tokens as a provider reads it: the tools' definitions, then each message."""
    found: list[int] = []
    if tools:
        found += [_START, *_encoded(json.dumps(tools, separators=(",", ":"))), _END]
    for message in messages:
        found += _message_tokens(message)
    return np.asarray(found, dtype=np.int64)


def common_prefix(first: np.ndarray[Any, Any], second: np.ndarray[Any, Any]) -> int:
    size = min(len(first), len(second))
    differ = np.flatnonzero(first[:size] != second[:size])
    return int(differ[0]) if len(differ) else size


def cacheable(common: int) -> int:
    """The tokens a provider serves from its cache for a prefix of `common` tokens already
    seen: none below 1,024, then 1,024 plus whole 128-token steps (OpenAI's rule)."""
    return 0 if common < MIN_PREFIX else MIN_PREFIX + STEP * ((common - MIN_PREFIX) // STEP)


def is_note(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return (
        message.get("role") == "system"
        and isinstance(content, str)
        and (content.startswith(NOTE_HEADER))
    )


def rebuilt(current: Sequence[dict[str, Any]], previous: Sequence[dict[str, Any]] | None) -> bool:
    """Whether the gateway's prompt does not repeat its previous one, whole or without the
    previous turn's note (a note dropped at the next turn): a compaction (or a rebuild)."""
    if previous is None:
        return False
    notes = [index for index, message in enumerate(previous) if is_note(message)]
    candidates = [list(previous)]
    if notes:
        candidates.append([m for i, m in enumerate(previous) if i != notes[-1]])
    return not any(list(current[: len(c)]) == c for c in candidates)


def figures(prompt: np.ndarray[Any, Any], previous: np.ndarray[Any, Any] | None) -> dict[str, Any]:
    """One prompt's size, cacheable part, share and billed input at each rate."""
    common = common_prefix(prompt, previous) if previous is not None else 0
    cached = cacheable(common)
    return {
        "tokens": len(prompt),
        "common_prefix": common,
        "cacheable": cached,
        "share": round(cached / len(prompt), 4),
        **{f"billed_{round(r * 100)}": round(len(prompt) - cached * (1 - r), 1) for r in RATES},
    }


# -- the replay ------------------------------------------------------------------------------


async def replay(
    client: httpx.AsyncClient,
    gateway: GatewayProcess,
    upstream: UpstreamServer,
    scenario: Scenario,
    budget: int,
    keep: Path | None = None,
) -> None:
    """Import the scenario's start, then send its exchanges as a client resending its whole
    history; every turn's figures go to `scenario.turns` (and, with `keep`, the gateway's
    prompt to `keep/<conversation>-<turn>.json`)."""
    harness.log(f"{scenario.external_id}: importing {len(scenario.imported)} messages")
    await harness.import_conversation(
        client, gateway.root_url, scenario.external_id, scenario.imported
    )
    await _drain(client, gateway)
    history = [{k: v for k, v in m.items() if k != "created_at"} for m in scenario.imported]
    previous: dict[str, np.ndarray[Any, Any] | None] = {"gateway": None, "full_history": None}
    sent_before: list[dict[str, Any]] | None = None
    for number, exchange in enumerate(scenario.exchanges, start=1):
        sent = [*history, *exchange.new]
        upstream.reset()
        if exchange.reply is not None:
            upstream.script({"reply": exchange.reply})
        began = time.perf_counter()
        response = await client.post(
            f"{gateway.url}/chat/completions", json={"model": MODEL, "messages": sent}
        )
        elapsed = time.perf_counter() - began
        if response.status_code != 200:
            raise RuntimeError(f"turn {number}: HTTP {response.status_code} {response.text[:300]}")
        found = response.headers.get("x-memstrata-conversation")
        if found != scenario.external_id:
            raise RuntimeError(
                f"turn {number} went to conversation {found!r}, not the imported one"
            )
        [recorded] = upstream.requests("/v1/chat/completions")
        body = recorded["body"]
        if keep is not None:
            _dump(keep / f"{scenario.external_id}-{number:03d}.json", body["messages"])
        prompts = {
            "gateway": serialize(body["messages"], body.get("tools")),
            "full_history": serialize(sent),
        }
        scenario.turns.append(
            {
                "turn": number,
                "history_tokens": len(prompts["full_history"]),
                "history_over_budget": round(len(prompts["full_history"]) / budget, 2),
                "latency_ms": round(elapsed * 1000, 1),
                # The gateway's own count (messages only, no tools): what its budget bounds.
                "gateway_message_tokens": tokens.count_messages(body["messages"], model=MODEL),
                "memory_tools_offered": bool(body.get("tools")),
                "rebuilt": rebuilt(body["messages"], sent_before),
                "note_tokens": sum(
                    tokens.count_message(m, model=MODEL) for m in body["messages"] if is_note(m)
                ),
                "stable_tokens": sum(
                    tokens.count_message(m, model=MODEL)
                    for m in body["messages"]
                    if m.get("role") == "system" and tokens.message_text(m).startswith("[Memory")
                ),
                **{name: figures(p, previous[name]) for name, p in prompts.items()},
            }
        )
        previous = dict(prompts)
        sent_before = body["messages"]
        history = [*sent, response.json()["choices"][0]["message"]]
        await _drain(client, gateway)
    harness.log(f"{scenario.external_id}: {len(scenario.exchanges)} turns replayed")


def _dump(path: Path, messages: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(messages, indent=1, ensure_ascii=False), encoding="utf-8")


async def _drain(client: httpx.AsyncClient, gateway: GatewayProcess) -> None:
    await harness.drain(client, gateway.root_url, limit=1800, poll=0.2)


# -- summaries -------------------------------------------------------------------------------


def _means(turns: Sequence[dict[str, Any]], system: str) -> dict[str, float]:
    return {
        key: round(statistics.fmean(t[system][key] for t in turns), 4 if key == "share" else 1)
        for key in ("tokens", "cacheable", "share", "billed_10", "billed_50")
    }


def _rebuilds(turns: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How often the prefix was rebuilt (compactions), the share on the other turns, and the
    notes' size (the share's other cost: a note is new on its turn)."""
    kept = [t for t in turns if not t.get("rebuilt")]
    return {
        "rebuilt_per_100_turns": round(100 * (len(turns) - len(kept)) / max(len(turns), 1), 1),
        "share_without_rebuilds": round(
            statistics.fmean(t["gateway"]["share"] for t in kept) if kept else 0.0, 4
        ),
        "note_tokens": round(statistics.fmean(t.get("note_tokens", 0) for t in turns), 1),
    }


def cheaper_from(turns: Sequence[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The first turn from which the gateway's billed input stays at or below the full
    history's, and the history's size then in budgets; None when it never does."""
    for index, turn in enumerate(turns):
        if all(t["gateway"][key] <= t["full_history"][key] for t in turns[index:]):
            return {"turn": turn["turn"], "history_over_budget": turn["history_over_budget"]}
    return None


def break_even(scenarios: Sequence[Scenario], key: str, rate: float, budget: int) -> float | None:
    """The history size, in budgets, at which the full history's billed input (about `rate`
    of the history plus the new turn's tokens) meets the gateway's mean billed input."""
    warm = [t for s in scenarios for t in s.turns[1:]]
    if not warm:
        return None
    gateway = statistics.fmean(t["gateway"][key] for t in warm)
    added = statistics.fmean(
        t["full_history"]["tokens"] - t["full_history"]["cacheable"] for t in warm
    )
    # billed = rate * cached + uncached, with everything but the new tokens cached
    return round((gateway - (1 - rate) * added) / rate / budget, 1)


def summary(scenarios: Sequence[Scenario]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for kind in sorted({s.kind for s in scenarios}):
        chosen = [s for s in scenarios if s.kind == kind]
        turns = [t for s in chosen for t in s.turns[1:]]
        found[kind] = {
            "conversations": [s.external_id for s in chosen],
            "turns": sum(len(s.turns) for s in chosen),
            "user_messages": sum(len(e.new) for s in chosen for e in s.exchanges),
            "history_over_budget": [
                min(t["history_over_budget"] for s in chosen for t in s.turns),
                max(t["history_over_budget"] for s in chosen for t in s.turns),
            ],
            **{system: _means(turns, system) for system in ("gateway", "full_history")},
            # A compaction (or any prompt rebuilt from the front) shows as a broken prefix.
            "gateway_turns_below_half_share": sum(t["gateway"]["share"] < 0.5 for t in turns),
            "gateway_message_tokens": round(
                statistics.fmean(t["gateway_message_tokens"] for t in turns), 1
            ),
            **_rebuilds(turns),
            "gateway_cheaper_from": {
                s.external_id: {k: cheaper_from(s.turns, k) for k in ("billed_10", "billed_50")}
                for s in chosen
            },
        }
    return found


# -- main ------------------------------------------------------------------------------------


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    chosen = args.scenarios.split(",")
    found: list[Scenario] = []
    if "locomo" in chosen:
        numbers = [int(n) for n in args.conversations.split(",")]
        found += locomo_scenarios(args.locomo, numbers, args.imported, args.turns)
    if "longmemeval" in chosen:
        found += longmemeval_scenarios(
            args.longmemeval, args.haystacks, args.lme_turns, args.seed, args.budget
        )
    return found


def settings(pairs: Sequence[str]) -> dict[str, Any]:
    """`["name=value", …]` as gateway settings."""
    found = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--set wants NAME=VALUE, got {pair!r}")
        found[name.strip().lower().removeprefix("memstrata_")] = value
    return found


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    chosen = scenarios(args)
    started = time.perf_counter()
    with (
        throwaway_postgres(prefix="memstrata-cache-") as postgres,
        UpstreamServer() as upstream,
        tempfile.TemporaryDirectory(prefix="memstrata-cache-gateway-") as data_dir,
        GatewayProcess(
            database_url=postgres.url,
            upstream_url=upstream.url,
            startup_timeout=120.0,
            log_level="warning",
            summary_mode="extractive",
            context_budget=args.budget,
            data_dir=data_dir,
            **settings(args.set),
        ) as gateway,
    ):
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            for scenario in chosen:
                await replay(client, gateway, upstream, scenario, args.budget, args.prompts)
    return {
        "benchmark": "prompt caching",
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": harness.machine_info(),
        "budget": args.budget,
        "settings": settings(args.set),
        "encoding": ENCODING,
        "imported": args.imported,
        "turns_per_locomo": args.turns,
        "turns_per_haystack": args.lme_turns,
        "seed": args.seed,
        "total_seconds": round(time.perf_counter() - started, 1),
        "summary": summary(chosen),
        "break_even_over_budget": {
            f"billed_{round(r * 100)}": break_even(
                chosen, f"billed_{round(r * 100)}", r, args.budget
            )
            for r in RATES
        },
        "conversations": [
            {
                "kind": s.kind,
                "external_id": s.external_id,
                "imported": len(s.imported),
                "turns": s.turns,
            }
            for s in chosen
        ],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--locomo", type=Path, default=LOCOMO_DATA)
    parser.add_argument("--conversations", default=DEFAULTS["conversations"])
    parser.add_argument("--imported", type=int, default=DEFAULTS["imported"])
    parser.add_argument("--turns", type=int, default=DEFAULTS["turns"])
    parser.add_argument("--longmemeval", type=Path, default=LME_DATA)
    parser.add_argument("--haystacks", type=int, default=DEFAULTS["haystacks"])
    parser.add_argument("--lme-turns", type=int, default=DEFAULTS["lme_turns"])
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--budget", type=int, default=8000)
    parser.add_argument("--scenarios", default="locomo,longmemeval")
    parser.add_argument(
        "--set", action="append", default=[], help="another gateway setting, NAME=VALUE"
    )
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument(
        "--prompts", type=Path, default=None, help="write every gateway prompt to this folder"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="redraw docs/benchmarks.md from the results"
    )
    parser.add_argument(
        "--grid", type=Path, nargs="+", help="print a table comparing these results files"
    )
    args = parser.parse_args(argv)
    if args.grid:
        print("\n".join(grid(args.grid)))
        return
    if args.report_only:
        report = json.loads(RESULTS.read_text(encoding="utf-8"))
    else:
        report = asyncio.run(main_async(args))
        narrowed = (
            args.scenarios != "locomo,longmemeval"
            or args.set
            or any(getattr(args, key) != value for key, value in DEFAULTS.items())
        )
        output = args.output or (RESULTS.with_name("cache-quick.json") if narrowed else RESULTS)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(report, indent=2) + "\n")
        print(
            json.dumps(
                {"summary": report["summary"], "break_even": report["break_even_over_budget"]},
                indent=1,
            )
        )
        if narrowed or args.output is not None:
            return
    plot(report, IMAGES)
    update_docs(render(report), begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
