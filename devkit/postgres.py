"""A throwaway embedded Postgres 18 + pgvector for tests and benchmarks.

`with throwaway_postgres() as server:` makes a folder in the temporary directory (/tmp unless
`TMPDIR` says otherwise), readable and traversable by everyone (as root, the server runs as the
`postgres` user, which must reach its data), starts a `memory.postgres.EmbeddedPostgres` on
`folder/"data"` and yields it (`server.url`; a test may stop and start it again). On exit it
stops the server and removes the folder. `durable=False` (the default) trades crash safety for
speed (fsync off); a benchmark of what `memstrata serve` runs passes `durable=True`. `folder`
uses that folder instead, and keeps it (and the data in it) on exit.

`await fresh_database(server_url, name)` makes an empty database `name` on a running server
(dropping one of that name first) and returns its SQLAlchemy URL: a test or benchmark whose
workers must see no other test's jobs gets a database of its own; `drop_database` removes it.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import asyncpg

from memory.postgres import EmbeddedPostgres


@contextlib.contextmanager
def throwaway_postgres(
    *, prefix: str = "memstrata-", durable: bool = False, folder: Path | None = None
) -> Iterator[EmbeddedPostgres]:
    """A started embedded Postgres on a folder of its own; see the module docstring."""
    own = folder is None
    where = Path(tempfile.mkdtemp(prefix=prefix)) if folder is None else folder
    where.mkdir(parents=True, exist_ok=True)
    where.chmod(0o755)
    server = EmbeddedPostgres(where / "data", durable=durable)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        if own:
            shutil.rmtree(where, ignore_errors=True)


async def _on_server(server_url: str, *statements: str) -> None:
    connection = await asyncpg.connect(server_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


async def fresh_database(server_url: str, name: str) -> str:
    """An empty database `name` on the server of `server_url` (a SQLAlchemy URL); its URL."""
    await _on_server(
        server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"'
    )
    return server_url.rsplit("/", 1)[0] + "/" + name


async def drop_database(server_url: str, name: str) -> None:
    """Drop database `name` from the server of `server_url`, closing its sessions."""
    await _on_server(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
