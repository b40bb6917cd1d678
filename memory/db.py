"""Connecting to Postgres: the async engine, the start-up checks, and migrations.

`connect(url)` builds the SQLAlchemy async engine (asyncpg); `check(engine)` refuses a server
without pgvector or btree_gin with a message saying so; `migrate(engine)` applies Alembic
migrations under a Postgres advisory lock, so any number of processes may start at once. Errors
of the driver are translated to `StorageUnavailable` / `SchemaMismatch` here (a transaction
Postgres failed to break a deadlock is `StorageUnavailable`: a 503 a client retries, not a 500).

A server `check` cannot use (nothing listens at the URL's address, a user or password it
refuses, a database that does not exist) and a migration that fails (a user without the rights
to change the schema, a database migrated by a newer memstrata) are refused in one paragraph an
operator can act on: the server's address (never the password), Postgres' own reason, and what
to do. The CLI prints it as the command's error (`gateway.cli`).

`spare(conn)` lends a second pooled connection, when one is idle, for reads that may run beside
`conn`'s own statements (a request's two retrieval legs at once).

Pooled connections are not pinged before use (a round trip per transaction, on every request):
a connection the server has closed (a restart, a terminated backend) is known closed to the
driver without asking, and is replaced at checkout instead (`_replace_closed`).
"""

import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeAlias

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import REAL, Row, event, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    InterfaceError,
    OperationalError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection, QueuePool

from memory.errors import SchemaMismatch, StorageUnavailable

ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"
AnyRow: TypeAlias = Row[*tuple[Any, ...]]
"""A result row of any shape (SQLAlchemy types rows by their columns)."""

FLOATS = ARRAY(REAL)
"""The type vectors travel as: float4 arrays, which asyncpg encodes and decodes in C (cast to
`vector` in SQL); pgvector's text form costs ~0.3 ms of Python per vector each way, as much as
the rest of a message's processing outside the model."""

_MIGRATION_LOCK = 7_240_311  # arbitrary, constant advisory-lock key for migrations


def connect(url: str, *, pool_size: int = 10, pool_timeout: float = 30) -> AsyncEngine:
    """The engine for `url`; no connection is opened until first use. A transaction that
    waits `pool_timeout` seconds for a free connection fails with `StorageUnavailable`."""
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=pool_timeout,
        pool_recycle=1800,
        # Errors must not quote statement parameters: they hold message contents and key hashes.
        hide_parameters=True,
        # A statement that hangs must not hold a request forever.
        connect_args={"command_timeout": 60, "server_settings": {"application_name": "memstrata"}},
    )
    event.listen(engine.sync_engine, "checkout", _replace_closed)
    return engine


def port_of(url: str) -> int | None:
    """The port the database URL `url` names (None: the driver's default); `ValueError` when
    it cannot be read or names no port a connection could use, its message never quoting the
    URL (it holds the password)."""
    try:
        port = make_url(url).port
    except ArgumentError as exc:
        raise ValueError("it cannot be read as a URL") from exc
    except ValueError as exc:  # a port that is no number: the message quotes the port only
        raise ValueError(f"it cannot be read as a URL: {exc}") from exc
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"it names port {port}, not one of 1-65535")
    return port


def _replace_closed(
    dbapi_connection: Any, _record: ConnectionPoolEntry, _proxy: PoolProxiedConnection
) -> None:
    """A pooled connection the server closed is replaced (the pool retries the checkout)."""
    if dbapi_connection.driver_connection.is_closed():
        raise DisconnectionError("the server closed this pooled connection")


async def check(engine: AsyncEngine) -> None:
    """Fail with a clear message unless the server is reachable and offers pgvector and
    btree_gin (a contrib extension of every Postgres distribution: full text by conversation)."""
    try:
        async with engine.connect() as conn:
            available = set(
                await conn.scalars(
                    text(
                        "SELECT name FROM pg_available_extensions "
                        "WHERE name IN ('vector', 'btree_gin')"
                    )
                )
            )
    except (OSError, DBAPIError) as exc:
        raise StorageUnavailable(_unusable(engine, exc)) from exc
    if "vector" not in available:
        raise SchemaMismatch(
            f"the Postgres server at {_safe(engine)} does not have the pgvector extension; "
            "install pgvector (https://github.com/pgvector/pgvector) or use the pgvector/pgvector "
            "image, or unset MEMSTRATA_DATABASE_URL to use the embedded server"
        )
    if "btree_gin" not in available:
        raise SchemaMismatch(
            f"the Postgres server at {_safe(engine)} does not have the btree_gin extension; "
            "install Postgres's contrib modules (the postgresql-contrib package), or unset "
            "MEMSTRATA_DATABASE_URL to use the embedded server"
        )


async def ping(engine: AsyncEngine) -> None:
    """One round trip to the server; `StorageUnavailable` when it cannot be made."""
    async with transaction(engine) as conn:
        await conn.execute(text("SELECT 1"))


async def migrate(engine: AsyncEngine) -> None:
    """Apply every pending migration; safe to call from many processes at once."""
    await check(engine)
    try:
        async with engine.connect() as conn:
            await conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": _MIGRATION_LOCK})
            try:
                await conn.run_sync(_upgrade)
                await conn.commit()
            finally:
                # A migration that failed left the transaction aborted: without the rollback
                # the unlock failed too ("current transaction is aborted"), and its error hid
                # the migration's own. The lock is the session's: it outlives the rollback.
                await conn.rollback()
                await conn.execute(
                    text("SELECT pg_advisory_unlock(:key)"), {"key": _MIGRATION_LOCK}
                )
                await conn.commit()
    except CommandError as exc:
        raise SchemaMismatch(f"migrating {_database(engine)} failed: {exc}") from exc
    except DBAPIError as exc:
        raise _failed_migration(engine, exc) from exc


def _upgrade(connection: Connection) -> None:
    config = Config(str(ALEMBIC_INI))
    config.attributes["connection"] = connection
    try:
        command.upgrade(config, "head")
    except CommandError:
        # Looked into only once Alembic failed: a revision it cannot find is raised before any
        # statement, so the transaction can still read which one the database is at.
        _refuse_unknown_revisions(connection, ScriptDirectory.from_config(config))
        raise


def _refuse_unknown_revisions(connection: Connection, scripts: ScriptDirectory) -> None:
    """Refuse a database at a migration this code does not have: a newer memstrata migrated
    it, and this one would not know its tables (Alembic said only "Can't locate revision")."""
    current = MigrationContext.configure(connection).get_current_heads()
    known = {script.revision for script in scripts.walk_revisions()}
    unknown = [revision for revision in current if revision not in known]
    if unknown:
        url = connection.engine.url
        raise SchemaMismatch(
            f"the database {url.database!r} at {_address(url)} is at migration {unknown[0]!r}, "
            f"which this memstrata does not have (its newest is {scripts.get_current_head()!r}): "
            "a newer version of memstrata migrated it. Run that version or a newer one, or set "
            "MEMSTRATA_DATABASE_URL to another database (migrations are never undone "
            "automatically)."
        )


def _failed_migration(engine: AsyncEngine, exc: DBAPIError) -> StorageUnavailable:
    """A migration the server refused, or could not run, in words."""
    if unavailable(exc):
        return StorageUnavailable(
            f"migrating {_database(engine)} failed, the server could not go on: {_said(exc)}"
        )
    if _sqlstate(exc) == "42501":  # insufficient_privilege
        return SchemaMismatch(
            f"migrating {_database(engine)} failed: user {engine.url.username!r} may not "
            f"change its schema ({_said(exc)}). Set MEMSTRATA_DATABASE_URL to a user that may "
            "create tables and extensions in it (its owner; a superuser the first time, as the "
            f"vector extension needs one), or grant {engine.url.username!r} these rights."
        )
    return SchemaMismatch(f"migrating {_database(engine)} failed: {_said(exc)}")


def _unusable(engine: AsyncEngine, exc: OSError | DBAPIError) -> str:
    """Why the server at `engine`'s URL cannot be used, and what to do, in one paragraph."""
    url = engine.url
    where = _address(url)
    if isinstance(exc, socket.gaierror):
        return (
            f"cannot reach Postgres at {where}: the host name {url.host!r} is unknown "
            f"({exc.strerror}). Check the host in MEMSTRATA_DATABASE_URL."
        )
    if isinstance(exc, TimeoutError):
        return (
            f"cannot reach Postgres at {where}: it did not answer in time. Is the host right, "
            "and does no firewall stand between? Check the host and port in "
            "MEMSTRATA_DATABASE_URL."
        )
    if isinstance(exc, OSError):
        # asyncio's own strerror quotes the address again ("Connect call failed (...)").
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        return (
            f"cannot reach Postgres at {where} ({reason}): is Postgres running, "
            "and listening on that address? Check the host and port in MEMSTRATA_DATABASE_URL, "
            "or unset it to use the embedded Postgres."
        )
    sqlstate = _sqlstate(exc)
    if sqlstate == "3D000":  # invalid_catalog_name
        return (
            f"the Postgres server at {where} has no database {url.database!r}: create it "
            f'(CREATE DATABASE "{url.database}"), or name one it has in MEMSTRATA_DATABASE_URL.'
        )
    if sqlstate.startswith("28"):  # invalid_authorization_specification, invalid_password
        return (
            f"the Postgres server at {where} refused user {url.username!r}: {_said(exc)}. Check "
            "the user name and password in MEMSTRATA_DATABASE_URL (and that the server's "
            "pg_hba.conf lets this user connect from here)."
        )
    if sqlstate == "53300":  # too_many_connections
        return (
            f"the Postgres server at {where} has no connection left: {_said(exc)}. Raise its "
            "max_connections, or lower MEMSTRATA_DB_POOL_SIZE of the processes that share it."
        )
    return f"cannot use Postgres at {where}: {_said(exc)}. Check MEMSTRATA_DATABASE_URL."


def _address(url: URL) -> str:
    """`host:port` of a database URL, as an operator would look for the server."""
    host = url.host or "localhost"
    return f"[{host}]:{url.port or 5432}" if ":" in host else f"{host}:{url.port or 5432}"


def _database(engine: AsyncEngine) -> str:
    return f"the database {engine.url.database!r} at {_address(engine.url)}"


def _sqlstate(exc: DBAPIError) -> str:
    return getattr(exc.orig, "sqlstate", None) or ""


def _said(exc: DBAPIError) -> str:
    """What Postgres said, without SQLAlchemy's wrapping (the statement, its documentation
    link: lines of their own that broke the one paragraph)."""
    return str(exc.orig or exc).strip().rstrip(".")


def _safe(engine: AsyncEngine) -> str:
    return engine.url.render_as_string(hide_password=True)


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A transaction that commits on success; a lost or refused database becomes
    `StorageUnavailable`, so callers handle one error whatever the driver said."""
    try:
        async with engine.begin() as conn:
            yield conn
    except (OperationalError, InterfaceError, OSError, TimeoutError) as exc:
        raise StorageUnavailable(f"the database is unavailable: {type(exc).__name__}") from exc
    except PoolTimeout as exc:
        # Every pooled connection busy for the whole wait: an overloaded process, which a
        # client should retry (503), not a fault of its request (it was a 500).
        raise StorageUnavailable("no database connection came free in time") from exc
    except DBAPIError as exc:
        if unavailable(exc):
            raise StorageUnavailable(f"the database is unavailable: {_reason(exc)}") from exc
        raise


@asynccontextmanager
async def spare(conn: AsyncConnection) -> AsyncIterator[AsyncConnection | None]:
    """Another connection of `conn`'s pool while fewer than the pool's size are in use (an idle
    one, or a new one kept for next time), else None: a busy pool never waits for itself (every
    request holding one connection and waiting for a second) nor overflows for it. It sees what
    is committed, not `conn`'s transaction, and goes back to the pool rolled back. Its errors
    are the driver's: the caller runs inside `transaction`, which translates them."""
    pool = conn.engine.sync_engine.pool
    if not (isinstance(pool, QueuePool) and pool.checkedout() < pool.size()):
        yield None
        return
    async with conn.engine.connect() as aside:
        yield aside


# SQLSTATE classes that say the server, not the statement, failed: connection exceptions,
# insufficient resources, operator intervention (shutting down, restarting), system errors;
# and transaction rollback (a deadlock or a serialization failure the server broke by failing
# this transaction: the same work, run again, may succeed).
_SERVER_CLASSES = ("08", "40", "53", "57", "58")


def unavailable(exc: DBAPIError) -> bool:
    """Whether a driver error means the database cannot serve now (a restart, a lost or
    refused connection, a transaction it failed to break a deadlock), as opposed to a
    statement it refused."""
    if exc.connection_invalidated:
        return True
    return _sqlstate(exc)[:2] in _SERVER_CLASSES


def _reason(exc: DBAPIError) -> str:
    cause = exc.orig.__cause__ or exc.orig if exc.orig is not None else exc
    return f"{type(cause).__name__}: {cause}"
