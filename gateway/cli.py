"""The `memstrata` command: serve, worker, migrate, import, db.

Each command builds `Settings` from the environment (flags override), so the CLI, Docker and
tests configure the same way. Commands that need a database use `MEMSTRATA_DATABASE_URL` or
start the embedded server under `MEMSTRATA_DATA_DIR`, and migrate it first.

A command that cannot do its work says why in one paragraph (`Error: ...`, exit status 1), never
in a traceback: settings refused, the domain's errors (`MemstrataError`: an embedded Postgres
that did not start, a database unreachable or refusing us, a migration that failed, each
worded where it is raised) and, for `serve`, a port it cannot listen on all become a
`click.ClickException`. `serve` finds them before uvicorn starts the app, whose start-up
would only log them as a traceback.
"""

import asyncio
import errno
import gc
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path

import click
import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from pydantic_core import ErrorDetails
from sqlalchemy.ext.asyncio import AsyncEngine
from tqdm import tqdm

from gateway import background, importer, logs
from gateway.settings import Settings
from memory.build import backlog
from memory.build.worker import Worker
from memory.db import connect, migrate, transaction
from memory.errors import MemstrataError, NotFound
from memory.postgres import EmbeddedPostgres
from memory.write import identity, store

log = logging.getLogger(__name__)


def _settings(**overrides: object) -> Settings:
    values = {key: value for key, value in overrides.items() if value is not None}
    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValidationError as exc:
        # Each setting refused and why, never its value: a database URL holds a password, and
        # a command's output ends up in logs.
        reasons = "; ".join(_refused(error) for error in exc.errors())
        raise click.ClickException(f"invalid settings: {reasons}") from exc


def _refused(error: ErrorDetails) -> str:
    """A refused setting's variable and why (a validator's reason may name it already)."""
    reason = error["msg"].removeprefix("Value error, ")
    name = f"MEMSTRATA_{str(error['loc'][0]).upper()}" if error["loc"] else ""
    return reason if name in reason else f"{name}: {reason}"


def _logging(settings: Settings) -> None:
    # JSON lines (or plain text) with request ids; see `gateway.logs`.
    logs.configure(level=settings.log_level, format=settings.log_format)


@contextmanager
def _database(settings: Settings) -> Iterator[str]:
    """The database URL: the configured one, or the embedded server's (stopped after use
    if this command started it)."""
    if settings.database_url is not None:
        yield settings.database_url
        return
    server = EmbeddedPostgres(settings.data_dir)
    try:
        server.start()
    except MemstrataError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        yield server.url
    finally:
        server.stop_if_started()


@click.group()
@click.version_option(package_name="memstrata")
def main() -> None:
    """memstrata: an OpenAI-compatible gateway with unbounded, hierarchical memory."""


@main.command()
@click.option("--host", help="Address to listen on (MEMSTRATA_HOST, default 127.0.0.1).")
@click.option("--port", type=int, help="Port to listen on (MEMSTRATA_PORT, default 8080).")
def serve(host: str | None, port: int | None) -> None:
    """Serve the gateway (HTTP API and, unless MEMSTRATA_WORKERS=0, background workers)."""
    from gateway.app import create_app

    settings = _settings(host=host, port=port)
    _logging(settings)
    # What keeps the gateway from starting is found here, before uvicorn, and refused in words:
    # the port taken, the embedded Postgres not starting, the database unreachable, its
    # migration failing. In the app's start-up each was a traceback logged by uvicorn (exit
    # status 3), found after the model and the worker process had started. The port first,
    # held from here on: the cheapest to find taken. The app migrates again as it starts (it
    # is also run without this command): by then nothing is left to do.
    with _listening(settings) as sockets, _database(settings) as url:
        _on_database(settings, url, _nothing)
        _serve(create_app(settings), settings, sockets)


def _serve(app: FastAPI, settings: Settings, sockets: list[socket.socket]) -> None:
    _collect_less()
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # Our handler and format (`gateway.logs`), and our access line (with the request id).
        log_config=None,
        access_log=False,
        # Longer than the idle limits of the clients and proxies in front (the openai SDKs
        # keep a connection 5 s, as long as uvicorn's default; load balancers 60 s): the side
        # that closes first must be the client, or a request sent as the server closes is lost.
        timeout_keep_alive=settings.keep_alive_seconds,
        timeout_graceful_shutdown=10,
    )
    # Stopped by Ctrl-C, uvicorn raises the signal again once it has shut down: as
    # `uvicorn.run` does, there is nothing left to do.
    with suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=sockets)


LISTEN_BACKLOG = 2048
"""Connections the kernel queues for `serve` until they are accepted (uvicorn's default)."""


@contextmanager
def _listening(settings: Settings) -> Iterator[list[socket.socket]]:
    """Sockets listening on `MEMSTRATA_HOST`:`MEMSTRATA_PORT`, one for each address the host
    resolves to, made as asyncio's `create_server` (which uvicorn used) makes them; closed on
    exit. A port that is taken, or an address that is not this machine's, is refused in words.
    Connections made while the app starts wait in the backlog instead of being refused."""
    host, port = settings.host, settings.port
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise click.ClickException(
            f"cannot listen on {host}: the host name is unknown ({exc.strerror}). Set "
            "MEMSTRATA_HOST (or --host) to an address of this machine: 127.0.0.1, or 0.0.0.0 "
            "for all of them."
        ) from exc
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # As asyncio binds: a port whose last server just stopped (connections in
            # TIME_WAIT) is free again, and an IPv6 socket leaves IPv4 to its own socket.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise click.ClickException(_cannot_listen(host, port, exc)) from exc
    where = ", ".join(_url(sock) for sock in sockets)
    log.info("listening on %s", where)
    try:
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def _cannot_listen(host: str, port: int, exc: OSError) -> str:
    """Why `serve` cannot listen on `host`:`port`, and what to do."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} is in use on {host}: another program listens on it (another "
            "memstrata serve?). Stop that program, or set MEMSTRATA_PORT (or --port) to a free "
            "port."
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"cannot listen on {host}:{port}: {host} is not an address of this machine. Set "
            "MEMSTRATA_HOST (or --host) to one of its addresses: 127.0.0.1, or 0.0.0.0 for all "
            "of them."
        )
    if exc.errno == errno.EACCES:
        return (
            f"cannot listen on {host}:{port}: permission denied (a port below 1024 needs root "
            "or CAP_NET_BIND_SERVICE). Set MEMSTRATA_PORT (or --port) to a port from 1024 up."
        )
    return (
        f"cannot listen on {host}:{port}: {exc.strerror or exc}. Check MEMSTRATA_HOST and "
        "MEMSTRATA_PORT (or --host and --port)."
    )


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


YOUNG_COLLECTION_THRESHOLD = 20_000
"""Net allocations of container objects between two collections of the youngest generation in
`serve` (Python's default: 700). A turn holds thousands of them until it ends (candidates,
rows, messages): at 700 the collector ran ~4 times a turn and traversed what the turn still
held; at 20,000 it runs about once in 50 turns, and most of a turn's objects are freed by then."""


def _collect_less() -> None:
    """Tune the garbage collector for the request path: the heap built at start (modules, the
    app, its schemas) is frozen, so the oldest generation's collections never traverse it, and
    young collections run less often (`YOUNG_COLLECTION_THRESHOLD`). Measured over 100 turns
    of `bench.overhead`'s 10k varied conversation: 375 young and 34 middle collections taking
    66 ms and one full collection taking 130 ms (a single request's latency), before; 2 young
    collections taking 12 ms, after. Cycles are still collected, only later."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, old)


@main.command("migrate")
def migrate_command() -> None:
    """Apply pending database migrations and exit."""
    settings = _settings()
    _logging(settings)
    _with_database(settings, _nothing)
    click.echo("migrations applied")


@main.command()
def db() -> None:
    """Run the embedded Postgres and print its URL (until Ctrl-C if this command started it)."""
    settings = _settings()
    _logging(settings)
    if settings.database_url is not None:
        raise click.ClickException("MEMSTRATA_DATABASE_URL is set: there is no embedded server")
    server = EmbeddedPostgres(settings.data_dir)
    try:
        started = server.start()
    except MemstrataError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(server.url.replace("postgresql+asyncpg://", "postgresql://"))
    if not started:
        return
    stop = asyncio.Event()

    async def wait() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()

    try:
        asyncio.run(wait())
    finally:
        server.stop()


@main.command()
@click.option("--concurrency", type=int, default=1, show_default=True, help="Jobs run at once.")
def worker(concurrency: int) -> None:
    """Run background workers only (any number of processes may share one database)."""
    settings = _settings()
    _logging(settings)

    async def run(engine: AsyncEngine) -> None:
        async with _worker(engine, settings, concurrency=concurrency) as runner:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            click.echo(f"worker {runner.worker_id} running; Ctrl-C to stop", err=True)
            await runner.run(stop)

    _with_database(settings, run)


@main.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--conversation", help="Conversation id (default: the file's name).")
@click.option(
    "--tenant",
    help="Name of the tenant that owns the conversation (`POST /admin/tenants` makes one; "
    "default: the default tenant).",
)
@click.option("--model", default="gpt-4o", show_default=True, help="Tokenizer for counting.")
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Messages per commit.",
)
@click.option(
    "--wait",
    is_flag=True,
    help="Also build the imported conversation's summary tree here (its jobs only), then exit "
    "(with an error if a job failed).",
)
def import_command(
    file: Path, conversation: str | None, tenant: str | None, model: str, batch: int, wait: bool
) -> None:
    """Import messages from FILE: JSONL (one OpenAI message a line) or JSON (a list of
    messages, or {"messages": [...]}); each message may carry `created_at`. Importing the same
    file again adds nothing."""
    settings = _settings()
    _logging(settings)
    try:
        read = importer.read_messages(file)
        external_id = identity.validate_conversation_id(
            conversation or importer.conversation_id_for(file)
        )
    except MemstrataError as exc:
        raise click.ClickException(str(exc)) from exc

    async def run(engine: AsyncEngine) -> None:
        try:
            async with transaction(engine) as conn:
                named = {} if tenant is None else {"name": tenant}
                tenant_id = await store.tenant_id_by_name(conn, **named)
        except NotFound as exc:
            raise click.ClickException(str(exc)) from exc
        with tqdm(total=len(read.messages), unit="msg", desc=f"import {external_id}") as bar:
            imported = await importer.import_messages(
                engine,
                tenant_id=tenant_id,
                external_id=external_id,
                messages=read.messages,
                created_at=read.created_at,
                system_prompts=read.system_prompts,
                model=model,
                batch=batch,
                progress=bar.update,
            )
        click.echo(f"{imported} messages imported into {external_id}", err=True)
        if wait:
            imported_id = await _imported(engine, tenant_id=tenant_id, external_id=external_id)
            async with _worker(engine, settings, concurrency=1) as runner:
                started = time.perf_counter()
                # Only this conversation's: the rest of the queue is the workers' to run.
                ran = await runner.run_until_idle(conversations=[imported_id])
            click.echo(f"{ran} jobs run in {time.perf_counter() - started:.1f}s", err=True)
            failed = await _failed_jobs(engine, tenant_id=tenant_id, conversation_id=imported_id)
            if failed:
                raise click.ClickException(
                    f"the summary tree of {external_id} is not built: {len(failed)} of its jobs "
                    f"failed ({failed[0].kind}: {failed[0].last_error}); they are retried by "
                    "`memstrata worker` or `memstrata serve`, and listed by GET /admin/jobs"
                )

    _with_database(settings, run)


async def _imported(engine: AsyncEngine, *, tenant_id: int, external_id: str) -> int:
    """The id of the tenant's conversation `external_id`, imported into."""
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=external_id)
    return ref.id


async def _failed_jobs(
    engine: AsyncEngine, *, tenant_id: int, conversation_id: int
) -> list[backlog.JobRecord]:
    """The conversation's jobs that failed: dead, or queued to try again later (a worker
    stops when no job is due, so `--wait` left them), also those deferred by an upstream
    outage (no attempt spent, but an error recorded)."""
    async with transaction(engine) as conn:
        found = await backlog.list_jobs(
            conn, status=None, tenant_id=tenant_id, conversation_id=conversation_id, limit=1000
        )
    return [
        job
        for job in found
        if job.status == "dead" or (job.status == "queued" and (job.attempts or job.last_error))
    ]


def _with_database(settings: Settings, work: Callable[[AsyncEngine], Awaitable[None]]) -> None:
    """Run `work` on a migrated engine (starting the embedded server if needed); domain
    errors become the command's error message."""
    with _database(settings) as url:
        _on_database(settings, url, work)


def _on_database(
    settings: Settings, url: str, work: Callable[[AsyncEngine], Awaitable[None]]
) -> None:
    """Run `work` on a migrated engine on `url`; domain errors become the command's error
    message (an unusable database or a failed migration is one paragraph saying what to do:
    `memory.db`)."""

    async def run() -> None:
        engine = connect(url, pool_size=settings.db_pool_size)
        try:
            await migrate(engine)
            await work(engine)
        finally:
            await engine.dispose()

    try:
        asyncio.run(run())
    except MemstrataError as exc:
        raise click.ClickException(str(exc)) from exc


async def _nothing(_: AsyncEngine) -> None:
    """No work: the database migrated is all a command asked for."""


@asynccontextmanager
async def _worker(
    engine: AsyncEngine, settings: Settings, *, concurrency: int
) -> AsyncIterator[Worker]:
    """A job worker configured from the settings, with its upstream client."""
    upstream = background.provider(settings)
    try:
        config = background.tree_config(settings, upstream, background.embedder(settings, upstream))
        yield background.worker(engine, settings, config, concurrency=concurrency)
    finally:
        await upstream.aclose()
