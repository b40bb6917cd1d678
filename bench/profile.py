"""A profile of the request path at 10,000 stored messages (pyinstrument, plus stage timers).

    python -m bench.profile serve     # the gateway with profiling controls (used by the scenario)

The scenario (`run`) starts the gateway through this module's `serve` command -- the app of
`memstrata serve`, unchanged, behind a small ASGI wrapper that answers `/_bench/profile/start`
and `/_bench/profile/stop` -- and, with background workers off, sends requests on a pre-stored
conversation of 10,000 messages:

1. at concurrency 1 (the latency view): a pyinstrument sampling profile of the event-loop thread
   (`profile-c1.txt`; `profile-c1.html` too with `--profile-html`, tens of MB), the wall time
   spent inside each instrumented function of `gateway` and `memory` per request (stages:
   parse, store, assemble, forward, record ...; inclusive, so nested functions count in their
   callers too), and every SQL statement with its count and time per request (SQLAlchemy
   cursor events); the stage timers and the sampler run in separate passes, so the wrappers
   are not in the sampled stacks;
2. at concurrency 32 (the throughput view): a second sampling profile (`profile-c32.*`) over
   the pool of the smallest conversations (one conversation would serialize on its row lock),
   where the CPU is saturated and self time shows what each request costs the process.

Both profiles are summarized by package (self time) and by function in `profile.json`. The
process's CPU time per request (all threads, `psutil`) is recorded for each run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import os
import re
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import harness as h
from bench import traffic

INSTRUMENTED_MODULES = (
    "gateway.openai.chat",
    "gateway.openai.relay",
    "gateway.openai.turn",
    "gateway.deps",
    "gateway.upstream",
    "gateway.openai.replies",
    "gateway.openai.degraded",
    "memory.write.store",
    "memory.recall.assemble",
    "memory.recall.context_prompt",
    "memory.recall.working_context",
    "memory.recall.compaction",
    "memory.recall.recall_note",
    "memory.recall.anticipation",
    "memory.recall.early",
    "memory.recall.fusion",
    "memory.recall.prompt",
    "memory.recall.retrieval",
    "memory.build.tree",
    "memory.build.summary_nodes",
    "memory.build.jobs",
    "memory.write.identity",
    "memory.tokens",
    "memory.embeddings",
    "memory.build.importance",
    "memory.build.facts",
    "memory.write.conversations",
    "memory.recall.tools",
)
IDLE_FUNCTIONS = frozenset({"select", "poll", "epoll", "run_forever", "_run_once"})
# Frames with these as the innermost sampled Python frame are the event loop waiting.
ROOT_REQUEST = "gateway.openai.chat.complete"


# -- inside the profiled gateway process ------------------------------------------------------


class Timers:
    """Calls and inclusive wall seconds per instrumented function."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)
        self.sql_calls: dict[str, int] = defaultdict(int)
        self.sql_seconds: dict[str, float] = defaultdict(float)
        self.lock = threading.Lock()
        self.enabled = False

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.seconds.clear()
            self.sql_calls.clear()
            self.sql_seconds.clear()

    def add(self, name: str, seconds: float) -> None:
        if not self.enabled:
            return
        self.calls[name] += 1
        self.seconds[name] += seconds

    def add_sql(self, statement: str, seconds: float) -> None:
        if not self.enabled:
            return
        with self.lock:
            self.sql_calls[statement] += 1
            self.sql_seconds[statement] += seconds

    def report(self) -> dict[str, Any]:
        requests = max(self.calls.get(ROOT_REQUEST, 0), 1)

        def table(calls: dict[str, int], seconds: dict[str, float]) -> list[dict[str, Any]]:
            rows = [
                {
                    "name": name,
                    "calls_per_request": round(calls[name] / requests, 2),
                    "ms_per_request": round(seconds[name] * 1000 / requests, 3),
                    "ms_per_call": round(seconds[name] * 1000 / calls[name], 3),
                }
                for name in calls
            ]
            return sorted(rows, key=lambda row: -row["ms_per_request"])

        sql = table(self.sql_calls, self.sql_seconds)
        return {
            "requests": self.calls.get(ROOT_REQUEST, 0),
            "functions": table(self.calls, self.seconds),
            "sql": sql,
            "sql_statements_per_request": round(sum(r["calls_per_request"] for r in sql), 2),
            "sql_ms_per_request": round(sum(r["ms_per_request"] for r in sql), 3),
        }


TIMERS = Timers()


def _wrap(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                TIMERS.add(name, time.perf_counter() - started)

        return timed_async

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TIMERS.add(name, time.perf_counter() - started)

    return timed


def _instrumentable(value: Any, module: str) -> bool:
    return (
        inspect.isfunction(value)
        and value.__module__ == module
        and not inspect.isgeneratorfunction(value)
        and not inspect.isasyncgenfunction(value)
    )


PATCHES: list[tuple[Any, str, Any, Any]] = []
"""(owner, attribute, original, wrapped) of every instrumented function."""


def instrument() -> list[str]:
    """Wrap the functions (and methods) defined in `INSTRUMENTED_MODULES` with timers; the
    names wrapped. Callers that imported a function by name keep the original. `patch(False)`
    puts the originals back (for a sampling profile without the wrappers in it)."""
    wrapped = []
    for module_name in INSTRUMENTED_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr, value in list(vars(module).items()):
            if _instrumentable(value, module_name):
                name = f"{module_name}.{attr}"
                PATCHES.append((module, attr, value, _wrap(name, value)))
                wrapped.append(name)
            elif inspect.isclass(value) and value.__module__ == module_name:
                for method_name, method in list(vars(value).items()):
                    if _instrumentable(method, module_name) and not method_name.startswith("__"):
                        name = f"{module_name}.{value.__name__}.{method_name}"
                        PATCHES.append((value, method_name, method, _wrap(name, method)))
                        wrapped.append(name)
    patch(True)
    return wrapped


def patch(on: bool) -> None:
    for owner, attr, original, wrapped in PATCHES:
        setattr(owner, attr, wrapped if on else original)


_SPACES = re.compile(r"\s+")
_NUMBERED = re.compile(r"\$\d+(::[A-Z0-9_\[\]]+)?")


def _statement_key(statement: str) -> str:
    text = _NUMBERED.sub("?", _SPACES.sub(" ", statement).strip())
    return text if len(text) <= 160 else text[:157] + "..."


def instrument_sql() -> None:
    """Time every statement SQLAlchemy sends (the await of the round trip included)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "before_cursor_execute")
    def before(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        conn.info.setdefault("bench_started", []).append(time.perf_counter())

    @event.listens_for(Engine, "after_cursor_execute")
    def after(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        started = conn.info["bench_started"].pop()
        TIMERS.add_sql(_statement_key(statement), time.perf_counter() - started)


class ProfilingApp:
    """The gateway's ASGI app with `/_bench/profile/{start,stop}` in front of it."""

    def __init__(self, app: Any, out_dir: Path) -> None:
        self.app = app
        self.out_dir = out_dir
        self.profiler: Any = None
        self.cpu_started = 0.0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/_bench/profile/"):
            action = scope["path"].rsplit("/", 1)[1]
            query = dict(
                part.split("=", 1) for part in scope["query_string"].decode().split("&") if part
            )
            if action == "start":
                payload = self.start(
                    timers=query.get("timers") == "1", sampler=query.get("sampler") == "1"
                )
            else:
                payload = self.stop(query.get("name", "x"), html=query.get("html") == "1")
            body = json.dumps(payload).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def start(self, *, timers: bool, sampler: bool) -> dict[str, Any]:
        from pyinstrument import Profiler

        TIMERS.reset()
        TIMERS.enabled = timers
        patch(timers)
        self.cpu_started = time.process_time()
        if sampler:
            self.profiler = Profiler(interval=0.0005, async_mode="disabled")
            self.profiler.start()
        return {"started": True}

    def stop(self, name: str, *, html: bool = False) -> dict[str, Any]:
        TIMERS.enabled = False
        cpu = time.process_time() - self.cpu_started
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return {"timers": TIMERS.report(), "process_cpu_seconds": round(cpu, 3)}
        session = profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if html:  # tens of MB: opt-in
            (self.out_dir / f"{name}.html").write_text(profiler.output_html())
        (self.out_dir / f"{name}.txt").write_text(
            profiler.output_text(unicode=False, color=False, short_mode=False)
        )
        flat = profiler.output_text(unicode=False, color=False, flat=True, flat_time="self")
        return {
            "timers": TIMERS.report(),
            "sampled_seconds": round(session.duration, 3),
            "process_cpu_seconds": round(cpu, 3),
            "by_package": by_package(session.root_frame()),
            "flat_self": flat.splitlines()[:60],
        }


def _package(path: str | None) -> str:
    if not path:
        return "(native / unknown)"
    marker = "site-packages/"
    if marker in path:
        return path.split(marker, 1)[1].split("/", 1)[0].removesuffix(".py")
    repo = str(h.REPO_ROOT) + "/"
    if path.startswith(repo):
        parts = path[len(repo) :].split("/")
        return "/".join(parts[:2]) if len(parts) > 1 else parts[0]
    if "/lib/python3" in path:
        rest = path.split("/lib/python3", 1)[1].split("/", 1)
        return "stdlib:" + (rest[1].split("/", 1)[0].removesuffix(".py") if len(rest) > 1 else "?")
    return path


def by_package(root: Any) -> dict[str, Any]:
    """Self time of the sampled frames, by package (repo files by module), idle apart."""
    selves: dict[str, float] = defaultdict(float)
    idle = 0.0

    def walk(frame: Any, parent: Any) -> None:
        nonlocal idle
        children = list(frame.children)
        own = frame.time - sum(child.time for child in children)
        # pyinstrument keeps a frame's own time in a synthetic "[self]" child.
        real = parent if frame.is_synthetic and parent is not None else frame
        if own > 0:
            if real.function in IDLE_FUNCTIONS or _is_loop_wait(real):
                idle += own
            else:
                selves[_package(real.file_path)] += own
        for child in children:
            walk(child, real)

    if root is not None:
        walk(root, None)
    busy = sum(selves.values())
    return {
        "idle_seconds": round(idle, 3),
        "busy_seconds": round(busy, 3),
        "packages": [
            {"package": name, "seconds": round(seconds, 3), "share": round(seconds / busy, 3)}
            for name, seconds in sorted(selves.items(), key=lambda item: -item[1])
            if busy > 0
        ][:25],
    }


def _is_loop_wait(frame: Any) -> bool:
    """The innermost Python frame is the event loop's (uvloop runs in C): waiting for I/O."""
    path = frame.file_path or ""
    return frame.function in {"run", "run_until_complete", "run_forever", "serve", "_serve"} and (
        "asyncio" in path or "uvicorn" in path
    )


def serve() -> None:
    """`memstrata serve`, with profiling controls and instrumented functions."""
    import uvicorn

    from gateway.app import create_app
    from gateway.cli import _collect_less, _logging
    from gateway.settings import Settings

    settings = Settings()
    _logging(settings)
    wrapped = instrument()
    instrument_sql()
    print(f"instrumented {len(wrapped)} functions", file=sys.stderr, flush=True)
    out_dir = Path(os.environ.get("BENCH_PROFILE_DIR", h.RESULTS_DIR))
    app = ProfilingApp(create_app(settings), out_dir)
    _collect_less()  # as `memstrata serve` tunes its collector
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )


# -- the scenario -----------------------------------------------------------------------------


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


async def run(
    client: traffic.Client,
    stack: h.Stack,
    *,
    conversation_id: str,
    size: int,
    requests: int,
    seconds: float,
    out_dir: Path,
    pool: list[str] | None = None,
    html: bool = False,
) -> dict[str, Any]:
    """Profile the request path on `conversation_id` (which holds about `size` messages) at
    concurrency 1, and at concurrency 32 over `pool` (small conversations: no lock waits)."""
    from bench.overhead import _factory

    with _env(BENCH_PROFILE_DIR=str(out_dir)):
        gateway = stack.gateway(
            name="profiled", argv=[sys.executable, "-m", "bench.profile", "serve"], workers=0
        )
    try:
        url = f"{gateway.root_url}/v1"
        runs: dict[str, Any] = {}
        offset = 50_000
        for label, concurrency, count, ids, timers, sampler in (
            ("stages", 1, requests, [conversation_id], True, False),
            ("c1", 1, requests, [conversation_id], False, True),
            ("c32", 32, requests * 2, list(pool or [conversation_id]), False, True),
        ):
            factory = _factory(
                url, stream=False, conversation_ids=ids, concurrency=concurrency, offset=offset
            )
            await traffic.run_load(
                client, factory, concurrency=concurrency, count=32, duration=min(seconds, 20.0)
            )
            offset += 32
            stored = await h.conversation_sizes(stack.dsn, ids)
            (
                await client.post(
                    f"{gateway.root_url}/_bench/profile/start",
                    params={"timers": int(timers), "sampler": int(sampler)},
                )
            ).raise_for_status()
            cpu_before = h.process_cpu_seconds(gateway.pid) or 0.0
            postgres_before = stack.postgres_cpu_seconds() or 0.0
            factory = _factory(
                url, stream=False, conversation_ids=ids, concurrency=concurrency, offset=offset
            )
            started = time.perf_counter()
            samples = await traffic.run_load(
                client, factory, concurrency=concurrency, count=count, duration=seconds
            )
            wall = time.perf_counter() - started
            offset += count
            cpu = (h.process_cpu_seconds(gateway.pid) or 0.0) - cpu_before
            postgres_cpu = (stack.postgres_cpu_seconds() or 0.0) - postgres_before
            answer = await client.post(
                f"{gateway.root_url}/_bench/profile/stop",
                params={"name": f"profile-{label}", "html": int(html)},
            )
            answer.raise_for_status()
            report = answer.json()
            report.update(
                {
                    "concurrency": concurrency,
                    "requests": len(samples),
                    "conversations": len(ids),
                    "stored_messages_before": stored,
                    "requests_per_second": round(len(samples) / wall, 1),
                    "gateway_cpu_ms_per_request": round(cpu * 1000 / max(len(samples), 1), 3),
                    "postgres_cpu_ms_per_request": round(
                        postgres_cpu * 1000 / max(len(samples), 1), 3
                    ),
                    "client_view": traffic.latency_figures(samples),
                }
            )
            if sampler:
                report["text"] = f"profile-{label}.txt"
                if html:
                    report["html"] = f"profile-{label}.html"
            timers_report = report.get("timers", {})
            h.log(
                f"profile {label}: {len(samples)} requests, {report['requests_per_second']} req/s, "
                f"gateway CPU {report['gateway_cpu_ms_per_request']} ms/request"
                + (
                    f", {timers_report['sql_statements_per_request']} SQL statements "
                    f"({timers_report['sql_ms_per_request']} ms)/request"
                    if timers
                    else ""
                )
            )
            runs[label] = report
    finally:
        gateway.stop()
    return {
        "size": size,
        "conversation": conversation_id,
        "instrumented_modules": list(INSTRUMENTED_MODULES),
        "runs": runs,
    }


async def standalone(args: argparse.Namespace) -> dict[str, Any]:
    """Import one conversation of `--size` messages, build its tree, profile."""
    with h.running_stack(h.StackConfig()) as stack:
        async with traffic.load_client(64) as client:
            builder = stack.gateway(name="builder", workers=1, worker_nice=0)
            conversation_id = f"bench-{args.size}-0"
            await h.import_conversation(
                client, builder.root_url, conversation_id, h.conversation(args.size, seed=1)
            )
            await h.wait_idle(client, builder.root_url, limit=3600, poll=2.0)
            builder.stop()
            result = await run(
                client,
                stack,
                conversation_id=conversation_id,
                size=args.size,
                requests=args.requests,
                seconds=60.0,
                out_dir=args.output.parent,
            )
    return {"benchmark": "profile", "machine": h.machine_info(), **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="serve the profiled gateway (MEMSTRATA_* settings)")
    scenario = sub.add_parser("run", help="import a conversation and profile (standalone)")
    scenario.add_argument("--size", type=int, default=10_000)
    scenario.add_argument("--requests", type=int, default=400)
    scenario.add_argument("--output", type=Path, default=h.RESULTS_DIR / "profile.json")
    args = parser.parse_args()
    if args.command == "serve":
        serve()
    elif args.command == "run":
        h.write_results(args.output, asyncio.run(standalone(args)))
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
