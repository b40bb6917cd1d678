"""The `memstrata` command: serve, worker, migrate, import, db.

Each command builds `Settings` from the environment (flags override), so the CLI, Docker and
tests configure the same way. Commands that need a database use `MEMSTRATA_DATABASE_URL` or
start the embedded server under `MEMSTRATA_DATA_DIR`.
"""

import asyncio
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import click
import uvicorn

from gateway.settings import Settings
from memory.db import connect, migrate
from memory.errors import MemstrataError
from memory.postgres import EmbeddedPostgres


def _settings(**overrides: object) -> Settings:
    values = {key: value for key, value in overrides.items() if value is not None}
    try:
        return Settings(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.ClickException(f"invalid settings: {exc}") from exc


def _logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # One line per upstream request is noise at INFO; our own logs say what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)


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
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.log_level == "debug",
        timeout_graceful_shutdown=10,
    )


@main.command("migrate")
def migrate_command() -> None:
    """Apply pending database migrations and exit."""
    settings = _settings()
    _logging(settings)

    async def run(url: str) -> None:
        engine = connect(url)
        try:
            await migrate(engine)
        finally:
            await engine.dispose()

    with _database(settings) as url:
        try:
            asyncio.run(run(url))
        except MemstrataError as exc:
            raise click.ClickException(str(exc)) from exc
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
