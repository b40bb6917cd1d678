"""Faults, fuzz and soak at full scale: the counts behind "never a 5xx, never a lost message".

    python -m bench.faults [--only restart,fuzz,healthz,soak] [--quick]
                           [--restart-seconds 60] [--rate 20] [--fuzz-examples 2000]
                           [--soak-minutes 30] [--soak-rate 50]

Every scenario starts its own throw-away Postgres, the fake upstream and real `memstrata serve`
processes (devkit), and counts:

* `restart`: two gateways, one failing open and one closed, take `--rate` chat requests per
  second (stream and not, each message unique, each conversation named) for
  `--restart-seconds`, while Postgres is stopped for 5 s in the middle. Counted: answers by
  status, 5xx other than the fail-closed 503 (must be 0), answers acknowledged without
  `X-Memstrata-Degraded` whose message is not stored (must be 0), degraded answers whose
  message was stored and whose reply was stored once the database was back, and the recovery
  time (restart to the first answer with memory again).
* `fuzz`: `--fuzz-examples` hypothesis examples from `devkit.hostile` against one gateway:
  5xx answers and rows written by refused requests (both must be 0).
* `healthz`: the largest bodies a client may send (a 7 MB message; 100,000 empty messages;
  1,000 levels of nesting) while `/healthz` is polled every 20 ms: its worst latency (goal:
  under 100 ms).
* `soak`: the default `serve` (in-process worker, extractive summaries) under `--soak-rate`
  requests per second for `--soak-minutes`, over 32 conversations that grow (each request
  sends its new message with the conversation header): errors (must be 0), the gateway's RSS
  each minute (goal: under 10% growth after the first minute) and p95 latency per minute
  (its drift).

Results go to `bench/results/faults.json` (`--quick`: a scaled-down run into
`bench/results/quick/faults.json`), and the `## Faults, fuzz and soak` section of
docs/benchmarks.md is redrawn from them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import harness as h
from bench.evidence_report import update_docs
from devkit import hostile
from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.stats import percentile
from devkit.upstream import UpstreamServer
from memory.postgres import EmbeddedPostgres

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "faults.json"
QUICK_RESULTS = ROOT / "bench" / "results" / "quick" / "faults.json"
BEGIN, END = "<!-- faults:begin -->", "<!-- faults:end -->"


@contextmanager
def _stack(
    **gateway: Any,
) -> Iterator[tuple[EmbeddedPostgres, UpstreamServer, list[GatewayProcess]]]:
    """Postgres, the fake upstream, and one gateway per settings dict in `gateway["each"]`."""
    with ExitStack() as stack:
        postgres = stack.enter_context(throwaway_postgres(prefix="memstrata-faults-"))
        upstream = stack.enter_context(UpstreamServer())
        gateways = []
        for extra in gateway.pop("each", [{}]):
            process = GatewayProcess(
                database_url=postgres.url, upstream_url=upstream.url, **gateway, **extra
            )
            stack.callback(process.stop)
            gateways.append(process)
        yield postgres, upstream, gateways


# -- restart under load ------------------------------------------------------------------------


@dataclass
class Answer:
    gateway: int
    conversation: str
    text: str
    started: float
    status: int
    degraded: bool


async def _chat(
    client: httpx.AsyncClient, url: str, gateway: int, number: int, origin: float
) -> Answer:
    conversation = f"restart-{number}-{uuid.uuid4().hex[:8]}"
    text = f"message {number} {uuid.uuid4().hex}"
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "stream": number % 3 == 0,
    }
    started = time.perf_counter() - origin
    try:
        async with client.stream(
            "POST", url, json=body, headers={"X-Memstrata-Conversation": conversation}
        ) as response:
            await response.aread()
        status, degraded = response.status_code, response.headers.get("x-memstrata-degraded") == "1"
    except httpx.HTTPError:
        status, degraded = 0, False  # no answer at all: counted as an error
    return Answer(gateway, conversation, text, started, status, degraded)


async def _stored(client: httpx.AsyncClient, root: str, conversation: str) -> list[Any]:
    response = await client.get(f"{root}/admin/conversations/{conversation}/messages")
    if response.status_code == 404:
        return []
    messages: list[Any] = response.json()["messages"]
    return messages


def restart(*, seconds: float, rate: float, down: float = 5.0) -> dict[str, Any]:
    with _stack(
        workers=0, memory_tools="never", each=[{"fail_open": "on"}, {"fail_open": "off"}]
    ) as (
        postgres,
        _upstream,
        gateways,
    ):
        h.log(f"restart: {rate:g} requests/s for {seconds:g} s, Postgres down {down:g} s")

        async def run() -> tuple[list[Answer], float]:
            origin = time.perf_counter()
            restarted = 0.0

            def outage() -> None:
                nonlocal restarted
                time.sleep(seconds / 3)
                postgres.stop()
                time.sleep(down)
                postgres.start()
                restarted = time.perf_counter() - origin

            thread = threading.Thread(target=outage)
            thread.start()
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = []
                number = 0
                while time.perf_counter() - origin < seconds:
                    index = number % 2
                    url = f"{gateways[index].url}/chat/completions"
                    tasks.append(asyncio.create_task(_chat(client, url, index, number, origin)))
                    number += 1
                    await asyncio.sleep(1 / rate)
                answers = list(await asyncio.gather(*tasks))
                await asyncio.to_thread(thread.join)
                return answers, restarted

        answers, restarted = asyncio.run(run())

        async def verify() -> dict[str, int]:
            counts = {
                "acknowledged_unstored": 0,
                "degraded_stored_later": 0,
                "degraded_not_stored": 0,
            }
            root = gateways[0].root_url
            async with httpx.AsyncClient(timeout=30) as client:
                deadline = time.monotonic() + 150
                for answer in (a for a in answers if a.status == 200):
                    messages = await _stored(client, root, answer.conversation)
                    if answer.degraded and not messages:
                        counts["degraded_not_stored"] += 1
                        continue
                    if not messages or messages[0]["content"] != answer.text:
                        counts["acknowledged_unstored"] += 1
                        continue
                    while len(messages) < 2 and time.monotonic() < deadline:
                        await asyncio.sleep(1)
                        messages = await _stored(client, root, answer.conversation)
                    if answer.degraded and len(messages) >= 2:
                        counts["degraded_stored_later"] += 1
                    if len(messages) < 2:
                        counts["acknowledged_unstored"] += 1
            return counts

        counts = asyncio.run(verify())
    statuses: dict[str, int] = {}
    for answer in answers:
        statuses[str(answer.status)] = statuses.get(str(answer.status), 0) + 1
    server_errors = sum(
        1
        for a in answers
        if a.status == 0 or (a.status >= 500 and not (a.status == 503 and a.gateway == 1))
    )
    back = [
        a.started for a in answers if a.started >= restarted and a.status == 200 and not a.degraded
    ]
    return {
        "requests": len(answers),
        "rate": rate,
        "seconds": seconds,
        "down_seconds": down,
        "statuses": statuses,
        "server_errors": server_errors,
        "degraded": sum(1 for a in answers if a.degraded),
        **counts,
        "recovery_seconds": round(min(back) - restarted, 2) if back else None,
    }


# -- fuzz --------------------------------------------------------------------------------------


def fuzz(*, examples: int) -> dict[str, Any]:
    found = {"examples": 0, "server_errors": 0, "refused": 0, "refused_with_writes": 0}
    with _stack(workers=0) as (postgres, _upstream, [gateway]):
        h.log(f"fuzz: {examples} examples")
        runner = asyncio.Runner()
        connection = runner.run(asyncpg.connect(postgres.url.replace("+asyncpg", "")))

        def rows() -> int:
            query = "SELECT (SELECT count(*) FROM nodes) + (SELECT count(*) FROM conversations)"
            return int(runner.run(connection.fetchval(query)))

        client = httpx.Client(timeout=60)

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(payload=hostile.payloads, extra=hostile.header_sets, stream=st.booleans())
        def one(payload: bytes, extra: dict[str, str], stream: bool) -> None:
            before = rows()
            headers = {
                k.encode("latin-1"): v.encode("latin-1")
                for k, v in {"content-type": "application/json", **extra}.items()
            }
            with client.stream(
                "POST", f"{gateway.url}/chat/completions", content=payload, headers=headers
            ) as response:
                response.read()
            found["examples"] += 1
            if response.status_code >= 500:
                found["server_errors"] += 1
            if response.status_code >= 400:
                found["refused"] += 1
                if rows() != before:
                    found["refused_with_writes"] += 1

        try:
            one()
        finally:
            client.close()
            runner.run(connection.close())
            runner.close()
    return found


# -- healthz while huge bodies are processed ---------------------------------------------------


def healthz() -> dict[str, Any]:
    bodies: dict[str, Callable[[], bytes]] = {
        "7 MB message": lambda: json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "word " * 1_400_000}]}
        ).encode(),
        "100,000 empty messages": lambda: json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": ""}] * 100_000}
        ).encode(),
        "1,000 levels of nesting": lambda: hostile.nested(1000),
    }
    results: dict[str, Any] = {}
    with _stack() as (_postgres, _upstream, [gateway]), httpx.Client(timeout=120) as client:
        for name, make in bodies.items():
            body = make()
            latencies: list[float] = []
            done = threading.Event()

            probe = (f"{gateway.root_url}/healthz", done, latencies)
            poller = threading.Thread(target=_probe, args=probe)
            poller.start()
            began = time.perf_counter()
            response = client.post(
                f"{gateway.url}/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
            took = time.perf_counter() - began
            done.set()
            poller.join()
            results[name] = {
                "bytes": len(body),
                "status": response.status_code,
                "seconds": round(took, 2),
                "healthz_polls": len(latencies),
                "healthz_max_ms": round(max(latencies), 1) if latencies else None,
                "healthz_p99_ms": round(percentile(latencies, 99) or 0, 1),
            }
            h.log(f"healthz: {name}: {results[name]}")
    return results


def _probe(url: str, done: threading.Event, latencies: list[float]) -> None:
    """GET `url` every 20 ms until `done`, recording each answer's latency in ms."""
    with httpx.Client(timeout=30) as prober:
        while not done.is_set():
            began = time.perf_counter()
            prober.get(url)
            latencies.append((time.perf_counter() - began) * 1000)
            time.sleep(0.02)


# -- soak --------------------------------------------------------------------------------------


def soak(*, minutes: float, rate: float, conversations: int = 32) -> dict[str, Any]:
    with _stack(summary_mode="extractive") as (_postgres, _upstream, [gateway]):
        h.log(f"soak: {rate:g} requests/s for {minutes:g} min")
        per_minute: list[dict[str, Any]] = []

        async def run() -> None:
            origin = time.perf_counter()
            latencies: list[float] = []
            errors: dict[str, int] = {}
            minute_start = origin

            async def one(number: int, client: httpx.AsyncClient) -> None:
                conversation = f"soak-{number % conversations}"
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"turn {number}: {uuid.uuid4().hex}"}],
                    "stream": number % 4 == 0,
                }
                began = time.perf_counter()
                try:
                    async with client.stream(
                        "POST",
                        f"{gateway.url}/chat/completions",
                        json=body,
                        headers={"X-Memstrata-Conversation": conversation},
                    ) as response:
                        await response.aread()
                    if response.status_code != 200:
                        key = str(response.status_code)
                        errors[key] = errors.get(key, 0) + 1
                except httpx.HTTPError as exc:
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                latencies.append((time.perf_counter() - began) * 1000)

            async with httpx.AsyncClient(
                timeout=120, limits=httpx.Limits(max_connections=256)
            ) as client:
                tasks: set[asyncio.Task[None]] = set()
                number = 0
                while time.perf_counter() - origin < minutes * 60:
                    task = asyncio.create_task(one(number, client))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    number += 1
                    await asyncio.sleep(1 / rate)
                    if time.perf_counter() - minute_start >= 60:
                        memory = h.process_memory(gateway.pid)
                        per_minute.append(
                            {
                                "minute": len(per_minute) + 1,
                                "requests": len(latencies),
                                "errors": dict(errors),
                                "p95_ms": round(percentile(latencies, 95) or 0, 1),
                                "rss_mib": memory["rss_mib"],
                            }
                        )
                        h.log(f"soak: {per_minute[-1]}")
                        latencies.clear()
                        errors.clear()
                        minute_start = time.perf_counter()
                await asyncio.gather(*tasks)

        asyncio.run(run())
    rss = [m["rss_mib"] for m in per_minute if m["rss_mib"] is not None]
    p95 = [m["p95_ms"] for m in per_minute]
    return {
        "minutes": minutes,
        "rate": rate,
        "requests": sum(m["requests"] for m in per_minute),
        "errors": sum(sum(m["errors"].values()) for m in per_minute),
        "error_kinds": {
            kind: sum(m["errors"].get(kind, 0) for m in per_minute)
            for kind in {kind for m in per_minute for kind in m["errors"]}
        },
        "rss_growth_pct": round(100 * (rss[-1] - rss[0]) / rss[0], 1) if len(rss) > 1 else None,
        "p95_first_ms": p95[0] if p95 else None,
        "p95_last_ms": p95[-1] if p95 else None,
        "p95_median_ms": statistics.median(p95) if p95 else None,
        "per_minute": per_minute,
    }


# -- report ------------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> str:
    lines = [
        "## Faults, fuzz and soak",
        "",
        "Measured by `python -m bench.faults` (see its docstring).",
        "",
    ]
    if restart_ := results.get("restart"):
        lines += [
            f"**Postgres restarted under load**: {restart_['requests']} requests at "
            f"{restart_['rate']:g}/s over {restart_['seconds']:g} s, the server down "
            f"{restart_['down_seconds']:g} s.",
            "",
            "| count | value | must be |",
            "|---|---|---|",
            f"| answers by status | {restart_['statuses']} | |",
            f"| 5xx (but fail-closed 503) or no answer | {restart_['server_errors']} | 0 |",
            f"| acknowledged, not stored | {restart_['acknowledged_unstored']} | 0 |",
            f"| degraded, nothing stored | {restart_['degraded_not_stored']} | |",
            "| degraded, message stored, reply stored later | "
            f"{restart_['degraded_stored_later']} | |",
            f"| recovery (restart → memory again) | {restart_['recovery_seconds']} s | |",
            "",
        ]
    if fuzz_ := results.get("fuzz"):
        lines += [
            f"**Fuzz** (`devkit.hostile`, {fuzz_['examples']} examples, "
            f"{fuzz_['refused']} refused): {fuzz_['server_errors']} answers 5xx, "
            f"{fuzz_['refused_with_writes']} refused requests that wrote rows (both must be 0).",
            "",
        ]
    if health := results.get("healthz"):
        lines += ["**`/healthz` while the largest bodies are processed** (goal: under 100 ms):", ""]
        lines += ["| body | bytes | status | seconds | healthz polls | worst ms | p99 ms |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for name, row in health.items():
            lines.append(
                f"| {name} | {row['bytes']:,} | {row['status']} | {row['seconds']} | "
                f"{row['healthz_polls']} | {row['healthz_max_ms']} | {row['healthz_p99_ms']} |"
            )
        lines.append("")
    if soak_ := results.get("soak"):
        lines += [
            f"**Soak**: {soak_['requests']:,} requests at {soak_['rate']:g}/s for "
            f"{soak_['minutes']:g} min, default `serve` (in-process worker): {soak_['errors']} "
            f"errors {soak_['error_kinds'] or ''} (must be 0); RSS growth after the first "
            f"minute {soak_['rss_growth_pct']}% "
            f"(goal < 10%); p95 {soak_['p95_first_ms']} ms in the first minute, "
            f"{soak_['p95_last_ms']} ms in the last (median {soak_['p95_median_ms']} ms).",
            "",
        ]
    lines.append(f"Machine: {results['machine'].get('cpu_model')}, load {results['load_average']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="restart,fuzz,healthz,soak")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--restart-seconds", type=float, default=60)
    parser.add_argument("--rate", type=float, default=20)
    parser.add_argument("--fuzz-examples", type=int, default=2000)
    parser.add_argument("--soak-minutes", type=float, default=30)
    parser.add_argument("--soak-rate", type=float, default=50)
    args = parser.parse_args()
    if args.quick:
        args.restart_seconds, args.fuzz_examples, args.soak_minutes = 20, 200, 2
    wanted = set(args.only.split(","))
    results: dict[str, Any] = {"benchmark": "faults", "machine": h.machine_info()}
    if "restart" in wanted:
        results["restart"] = restart(seconds=args.restart_seconds, rate=args.rate)
    if "fuzz" in wanted:
        results["fuzz"] = fuzz(examples=args.fuzz_examples)
    if "healthz" in wanted:
        results["healthz"] = healthz()
    if "soak" in wanted:
        results["soak"] = soak(minutes=args.soak_minutes, rate=args.soak_rate)
    results["load_average"] = round(__import__("os").getloadavg()[0], 2)
    target = QUICK_RESULTS if args.quick else RESULTS
    h.write_results(target, results)
    print(render(results))
    if not args.quick:
        update_docs(render(results), begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
