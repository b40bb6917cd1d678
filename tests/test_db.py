"""The database layer: transactions over a pool whose connections may have died, and the
migration that keeps each conversation's system prompt fingerprint."""

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import select, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.db import ALEMBIC_INI, connect, migrate, transaction
from memory.schema import conversations
from memory.write import identity


async def test_a_dead_pooled_connection_is_replaced_without_an_error(
    engine: AsyncEngine, database_url: str
) -> None:
    own = connect(database_url, pool_size=1)
    try:
        async with transaction(own) as conn:
            pid = await conn.scalar(text("SELECT pg_backend_pid()"))
        # The server drops the pooled connection (a restart, an idle timeout, a failover); it is
        # gone when the call returns, and the socket's end reaches the client soon after.
        async with transaction(engine) as conn:
            await conn.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})
        await asyncio.sleep(0.2)
        async with transaction(own) as conn:
            again = await conn.scalar(text("SELECT pg_backend_pid()"))
        assert again != pid
    finally:
        await own.dispose()


@pytest.fixture
async def empty_database(database_url: str) -> AsyncIterator[str]:
    """A database of its own on the session's server, nothing migrated."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    dsn = database_url.replace("postgresql+asyncpg://", "postgresql://")
    server = await asyncpg.connect(dsn)
    try:
        await server.execute(f'CREATE DATABASE "{name}"')
        yield database_url.rsplit("/", 1)[0] + "/" + name
    finally:
        await server.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await server.close()


def _upgrade_to(revision: str) -> Callable[[Connection], None]:
    def upgrade(connection: Connection) -> None:
        config = Config(str(ALEMBIC_INI))
        config.attributes["connection"] = connection
        command.upgrade(config, revision)

    return upgrade


async def test_migration_0005_fingerprints_the_newest_system_prompt(empty_database: str) -> None:
    engine = connect(empty_database)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to("0004"))
            await conn.commit()
        async with transaction(engine) as conn:
            await conn.execute(text("INSERT INTO tenants (name) VALUES ('t')"))
            await conn.execute(
                text(
                    "INSERT INTO conversations (tenant_id, external_id) "
                    "SELECT id, c FROM tenants, unnest(ARRAY['with', 'without']) AS c"
                )
            )
            contents = [("system", '"old"'), ("user", '"hi"'), ("developer", '[{"text": "new"}]')]
            for seq, (role, content) in enumerate(contents):
                await conn.execute(
                    text(
                        "INSERT INTO nodes (tenant_id, conversation_id, level, seq, span_start, "
                        "span_end, role, content, text, chain_hash) SELECT tenant_id, id, 0, "
                        ":seq, :seq, :seq, :role, CAST(:content AS jsonb), '', :hash "
                        "FROM conversations WHERE external_id = 'with'"
                    ),
                    {"seq": seq, "role": role, "content": content, "hash": f"h{seq}"},
                )
        await migrate(engine)
        async with transaction(engine) as conn:
            rows = await conn.execute(
                select(conversations.c.external_id, conversations.c.system_hash)
            )
            found = {external_id: system_hash for external_id, system_hash in rows}
        assert found == {"with": identity.content_hash([{"text": "new"}]), "without": None}
    finally:
        await engine.dispose()
