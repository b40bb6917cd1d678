"""The database layer: transactions over a pool whose connections may have died, the migrations'
indexes as the schema declares them, the migration that keeps each conversation's system prompt
fingerprint, and the ones that rehash chains."""

import asyncio
import hashlib
import importlib.util
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import Index, Table, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.postgres import drop_database, fresh_database
from memory.db import ALEMBIC_INI, connect, migrate, transaction
from memory.errors import StorageUnavailable
from memory.schema import conversations, metadata
from memory.write import chains, identity, store


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


async def test_a_pool_with_no_free_connection_is_storage_unavailable(database_url: str) -> None:
    own = connect(database_url, pool_size=1, pool_timeout=0.2)
    try:
        async with transaction(own) as first, transaction(own) as second:
            # Both connections of the pool (one and its overflow of one) are held.
            await first.execute(text("SELECT 1"))
            await second.execute(text("SELECT 1"))
            with pytest.raises(StorageUnavailable, match="no database connection"):
                async with transaction(own):
                    pass
        async with transaction(own) as conn:  # free again
            assert await conn.scalar(text("SELECT 1")) == 1
    finally:
        await own.dispose()


async def test_a_transaction_postgres_fails_to_break_a_deadlock_is_storage_unavailable(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """A deadlock (SQLSTATE 40P01), like a serialization failure (40001), fails one of the
    transactions in it: the same work, run again, may succeed. It was a `DBAPIError`, which the
    edge answers with a 500; as `StorageUnavailable` it is a 503 a client retries."""
    conversation_ids = []
    async with transaction(engine) as conn:
        for _ in range(2):
            ref, _ = await store.open_conversation(
                conn, tenant_id=tenant_id, external_id=f"deadlock-{uuid.uuid4().hex}"
            )
            conversation_ids.append(ref.id)
    touch = text("UPDATE conversations SET updated_at = now() WHERE id = :id")
    locked = [asyncio.Event(), asyncio.Event()]

    async def crossing(mine: int) -> None:
        async with transaction(engine) as conn:
            await conn.execute(touch, {"id": conversation_ids[mine]})
            locked[mine].set()
            await locked[1 - mine].wait()
            await conn.execute(touch, {"id": conversation_ids[1 - mine]})

    outcomes = await asyncio.gather(crossing(0), crossing(1), return_exceptions=True)
    failed = [outcome for outcome in outcomes if outcome is not None]
    assert len(failed) == 1, outcomes
    assert isinstance(failed[0], StorageUnavailable), repr(failed[0])
    assert "deadlock" in str(failed[0])


@pytest.fixture
async def empty_database(database_url: str) -> AsyncIterator[str]:
    """A database of its own on the session's server, nothing migrated."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    try:
        yield await fresh_database(database_url, name)
    finally:
        await drop_database(database_url, name)


def _upgrade_to(revision: str, *, down: bool = False) -> Callable[[Connection], None]:
    def upgrade(connection: Connection) -> None:
        config = Config(str(ALEMBIC_INI))
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, revision)

    return upgrade


async def test_the_migrated_tables_and_indexes_have_the_schemas_options(
    engine: AsyncEngine,
) -> None:
    """Every index `memory.schema` declares exists after the migrations, and every table and
    index has the storage options it declares (the full-text index's small pending list:
    migration 0012; the messages' frequent analyze: 0013; their rows kept whole up to ~4 kB:
    0014)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT c.relname, coalesce(c.reloptions, '{}') FROM pg_class c "
                "JOIN pg_namespace s ON s.oid = c.relnamespace "
                "WHERE c.relkind IN ('i', 'r') AND s.nspname = current_schema()"
            )
        )
        migrated = {name: set(options) for name, options in rows}
    declared: list[Table | Index] = [
        *metadata.tables.values(),
        *(index for table in metadata.tables.values() for index in table.indexes),
    ]
    assert declared
    for item in declared:
        assert item.name in migrated, f"{item.name} is declared but not migrated"
        options = item.dialect_options["postgresql"]["with"] or {}
        wanted = {f"{key}={value}" for key, value in options.items()}
        assert wanted <= migrated[str(item.name)], (item.name, migrated[str(item.name)])
    assert "gin_pending_list_limit=128" in migrated["ix_nodes_conversation_tsv"]
    assert "autovacuum_analyze_threshold=2000" in migrated["nodes"]
    assert "toast_tuple_target=4080" in migrated["nodes"]
    assert "ix_nodes_conversation_chain" in migrated


@pytest.mark.parametrize(("revision", "whole"), [("head", True), ("0013", False)])
async def test_a_messages_row_keeps_its_vector_and_its_text(
    empty_database: str, revision: str, whole: bool
) -> None:
    """A message's vector, written after the message as the worker writes it, stays in the
    message's row, and so do its text and search vector (migration 0014: the vector's storage
    MAIN, rows of up to ~4 kB whole). Before 0014 this row's vector went to the TOAST table:
    the row is large enough to tell."""
    engine = connect(empty_database)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(_upgrade_to(revision))
        async with transaction(engine) as conn:
            await conn.execute(
                text(
                    "WITH t AS (INSERT INTO tenants (name) VALUES ('t') RETURNING id), "
                    "c AS (INSERT INTO conversations (tenant_id, external_id) "
                    "SELECT id, 'c' FROM t RETURNING id, tenant_id) "
                    "INSERT INTO nodes (tenant_id, conversation_id, level, seq, span_start, "
                    "span_end, role, content, chain_hash, text) SELECT c.tenant_id, c.id, 0, "
                    "0, 0, 0, 'user', to_jsonb(CAST(:said AS text)), md5('0'), :said FROM c"
                ),
                # Words that do not repeat: compressed, a repetitive text would leave room.
                {"said": " ".join(hashlib.md5(str(i).encode()).hexdigest() for i in range(12))},
            )
            await conn.execute(
                text("UPDATE nodes SET embedding = CAST(:vector AS vector)"),
                {"vector": str([round(0.05 * (i % 7) - 0.15, 2) for i in range(384)])},
            )
            out_of_line = (
                await conn.execute(
                    text(
                        "SELECT pg_column_toast_chunk_id(embedding) IS NOT NULL, "
                        "pg_column_toast_chunk_id(tsv) IS NOT NULL, "
                        "pg_column_toast_chunk_id(text) IS NOT NULL FROM nodes"
                    )
                )
            ).one()
    finally:
        await engine.dispose()
    assert tuple(out_of_line) == ((False, False, False) if whole else (True, False, False))


@pytest.mark.parametrize("statement", [identity._PATH, identity._DEEPEST])
async def test_a_history_is_looked_up_through_a_chain_index_in_a_generic_plan(
    empty_database: str, statement: Any
) -> None:
    """Identifying a turn looks its history's chain hashes up through the partial chain
    indexes even in the generic plan a prepared statement settles on after five runs, in a
    database of large conversations (a `level` sent as a parameter kept them out: the plan
    read the conversation, or the tenant, whole)."""
    engine = connect(empty_database)
    try:
        await migrate(engine)
        async with engine.connect() as conn:
            await conn.execute(
                text(
                    "WITH t AS (INSERT INTO tenants (name) VALUES ('t') RETURNING id), "
                    "c AS (INSERT INTO conversations (tenant_id, external_id) "
                    "SELECT id, 'c' || g FROM t, generate_series(1, 4) g RETURNING id, tenant_id) "
                    "INSERT INTO nodes (tenant_id, conversation_id, level, seq, span_start, "
                    "span_end, role, content, chain_hash, text) SELECT c.tenant_id, c.id, 0, "
                    "s, s, s, 'user', '\"hi\"', md5(c.id || '.' || s), 'hi' "
                    "FROM c, generate_series(0, 2999) s"
                )
            )
            await conn.commit()
            await conn.execute(text("ANALYZE nodes"))
            compiled = statement.compile(dialect=engine.dialect)
            arguments = ", ".join("NULL" for _ in compiled.positiontup or ())
            await conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
            await conn.exec_driver_sql(f"PREPARE lookup AS {compiled}")
            explained = await conn.exec_driver_sql(f"EXPLAIN EXECUTE lookup({arguments})")
            plan = "\n".join(row[0] for row in explained)
    finally:
        await engine.dispose()
    assert re.search(r"Index Cond: \(.*chain_hash = ANY", plan), plan


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
        assert found == {"with": chains.content_hash([{"text": "new"}]), "without": None}
    finally:
        await engine.dispose()


def _migration_0009() -> ModuleType:
    return _migration("0009_branches")


def _migration(name: str) -> ModuleType:
    path = ALEMBIC_INI.parent / "migrations" / "versions" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"migration_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_migration_0009_rehashes_chains_so_old_conversations_keep_matching(
    empty_database: str,
) -> None:
    """A conversation stored with the old hashes is found by a history whose tool arguments
    and empty content a client re-serialized, after the migration; the downgrade puts the old
    hashes back."""
    old = _migration_0009()
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x":1}'}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "add"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "content": "two"},
    ]
    old_hashes: list[str] = []
    for message in messages:
        old_hashes.append(old._old_chain_hash(old_hashes[-1] if old_hashes else "", message))
    engine = connect(empty_database)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to("0006"))
            await conn.commit()
        async with transaction(engine) as conn:
            tenant = await conn.scalar(text("INSERT INTO tenants (name) VALUES ('t') RETURNING id"))
            conversation = await conn.scalar(
                text(
                    "INSERT INTO conversations (tenant_id, external_id, head_hash, next_seq) "
                    "VALUES (:tenant, 'old', :head, 4) RETURNING id"
                ),
                {"tenant": tenant, "head": old_hashes[-1]},
            )
            for seq, (message, digest) in enumerate(zip(messages, old_hashes, strict=True)):
                await conn.execute(
                    text(
                        "INSERT INTO nodes (tenant_id, conversation_id, level, seq, span_start, "
                        "span_end, role, content, tool_calls, tool_call_id, text, chain_hash) "
                        "VALUES (:tenant, :conversation, 0, :seq, :seq, :seq, :role, "
                        "CAST(:content AS jsonb), CAST(:calls AS jsonb), :call_id, '', :hash)"
                    ),
                    {
                        "tenant": tenant,
                        "conversation": conversation,
                        "seq": seq,
                        "role": message["role"],
                        "content": json.dumps(message["content"]),
                        "calls": json.dumps(message.get("tool_calls")),
                        "call_id": message.get("tool_call_id"),
                        "hash": digest,
                    },
                )
        await migrate(engine)
        resent = [
            {"role": "user", "content": "add"},
            {
                **messages[1],
                "content": "",
                "tool_calls": [{**call, "function": {"name": "add", "arguments": '{"x": 1}'}}],
            },
            *messages[2:],
            {"role": "user", "content": "and again"},
        ]
        async with transaction(engine) as conn:
            row = (
                await conn.execute(
                    select(conversations.c.head_hash, conversations.c.head_seq).where(
                        conversations.c.id == conversation
                    )
                )
            ).one()
            assert (row.head_hash, row.head_seq) == (chains.chain(messages)[-1], 3)
            found = await identity.identify(
                conn, tenant_id=tenant, external_id=None, user=None, messages=resent
            )
            assert (found.row.id, found.start, found.created) == (conversation, 4, False)
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to("0006", down=True))
            await conn.commit()
            hashes = await conn.scalars(
                text("SELECT chain_hash FROM nodes WHERE conversation_id = :c ORDER BY seq"),
                {"c": conversation},
            )
            assert list(hashes) == old_hashes
    finally:
        await engine.dispose()


async def test_migration_0015_rehashes_tool_arguments_numbers_across_branches(
    empty_database: str,
) -> None:
    """A conversation stored when `{"x": 2.0}` and `{"x":2}` hashed apart, with a regenerated
    answer (a branch) and a response ending at its head: after the migration a history that
    writes the arguments the other way extends it, and the response is still at the head; the
    downgrade puts the old hashes back."""
    old = _migration("0015_tool_argument_numbers")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x": 2.0}'}}
    # seq 3, the first answer, was regenerated: seq 4 follows seq 2.
    stored: list[tuple[dict[str, Any], int | None, bool]] = [
        ({"role": "user", "content": "add one to two"}, None, False),
        ({"role": "assistant", "content": None, "tool_calls": [call]}, None, False),
        ({"role": "tool", "tool_call_id": "c1", "content": "3"}, None, False),
        ({"role": "assistant", "content": "three"}, None, True),
        ({"role": "assistant", "content": "3!"}, 2, False),
    ]
    old_hashes: list[str] = []
    for message, follows, _ in stored:
        parent_seq = len(old_hashes) - 1 if follows is None else follows
        parent = old_hashes[parent_seq] if parent_seq >= 0 else ""
        old_hashes.append(old._hash(parent, old._canonical(message, doubles=False)))
    engine = connect(empty_database)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to("0014"))
            await conn.commit()
        async with transaction(engine) as conn:
            tenant = await conn.scalar(text("INSERT INTO tenants (name) VALUES ('t') RETURNING id"))
            conversation = await conn.scalar(
                text(
                    "INSERT INTO conversations (tenant_id, external_id, head_hash, head_seq, "
                    "next_seq) VALUES (:tenant, 'old', :head, 4, 5) RETURNING id"
                ),
                {"tenant": tenant, "head": old_hashes[-1]},
            )
            await conn.execute(
                text(
                    "INSERT INTO responses (tenant_id, response_id, conversation_id, last_seq, "
                    "head_hash, body, input_items) VALUES (:tenant, 'resp_1', :conversation, 4, "
                    "CAST(:head AS text), '{}', '[]')"
                ),
                {"tenant": tenant, "conversation": conversation, "head": old_hashes[-1]},
            )
            for seq, ((message, follows, superseded), digest) in enumerate(
                zip(stored, old_hashes, strict=True)
            ):
                await conn.execute(
                    text(
                        "INSERT INTO nodes (tenant_id, conversation_id, level, seq, span_start, "
                        "span_end, role, content, tool_calls, tool_call_id, text, chain_hash, "
                        "follows_seq, superseded_at) VALUES (:tenant, :conversation, 0, :seq, "
                        ":seq, :seq, :role, CAST(:content AS jsonb), CAST(:calls AS jsonb), "
                        ":call_id, '', :hash, :follows, CASE WHEN :superseded THEN now() END)"
                    ),
                    {
                        "tenant": tenant,
                        "conversation": conversation,
                        "seq": seq,
                        "role": message["role"],
                        "content": json.dumps(message["content"]),
                        "calls": json.dumps(message.get("tool_calls")),
                        "call_id": message.get("tool_call_id"),
                        "hash": digest,
                        "follows": follows,
                        "superseded": superseded,
                    },
                )
        await migrate(engine)
        branch = [stored[0][0], stored[1][0], stored[2][0], stored[4][0]]
        assert old_hashes[-1] != chains.chain(branch)[-1]  # the form did change
        javascript = {**call, "function": {"name": "add", "arguments": '{"x":2}'}}
        resent = [
            branch[0],
            {**branch[1], "tool_calls": [javascript]},
            *branch[2:],
            {"role": "user", "content": "and again"},
        ]
        async with transaction(engine) as conn:
            head = await conn.scalar(
                select(conversations.c.head_hash).where(conversations.c.id == conversation)
            )
            assert head == chains.chain(branch)[-1]
            abandoned = await conn.scalar(
                text("SELECT chain_hash FROM nodes WHERE conversation_id = :c AND seq = 3"),
                {"c": conversation},
            )
            assert abandoned == chains.chain([*branch[:3], stored[3][0]])[-1]
            found = await identity.identify(
                conn, tenant_id=tenant, external_id=None, user=None, messages=resent
            )
            assert (found.row.id, found.start, found.branch) == (conversation, 4, None)
            response_head = await conn.scalar(
                text("SELECT head_hash FROM responses WHERE response_id = 'resp_1'")
            )
            assert response_head == head
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to("0014", down=True))
            await conn.commit()
            hashes = await conn.scalars(
                text("SELECT chain_hash FROM nodes WHERE conversation_id = :c ORDER BY seq"),
                {"c": conversation},
            )
            assert list(hashes) == old_hashes
            response_head = await conn.scalar(
                text("SELECT head_hash FROM responses WHERE response_id = 'resp_1'")
            )
            assert response_head == old_hashes[-1]
    finally:
        await engine.dispose()


async def test_migration_0019_keeps_each_search_vector_and_bounds_the_new_ones(
    empty_database: str,
) -> None:
    """A message stored before 0019 keeps its search vector (no rewrite), one stored after gets
    one from its text's first `INDEXED_CHARS` characters, however long the text, and its
    lexemes are counted (the statement trigger sees what the row trigger wrote); the downgrade
    generates the vector from the whole text again."""
    limit = _migration("0019_bounded_search_vector").INDEXED_CHARS
    insert = text(
        "INSERT INTO nodes (tenant_id, conversation_id, level, seq, span_start, span_end, role, "
        "content, chain_hash, text) SELECT c.tenant_id, c.id, 0, :seq, :seq, :seq, 'user', "
        "to_jsonb(CAST(:said AS text)), md5(:said), :said FROM conversations c"
    )
    vector = text("SELECT tsv::text FROM nodes WHERE seq = :seq")
    engine = connect(empty_database)
    try:
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to("0018"))
            await conn.commit()
        async with transaction(engine) as conn:
            await conn.execute(
                text(
                    "WITH t AS (INSERT INTO tenants (name) VALUES ('t') RETURNING id) "
                    "INSERT INTO conversations (tenant_id, external_id) SELECT id, 'c' FROM t"
                )
            )
            await conn.execute(insert, {"seq": 0, "said": "kept lanterns"})
        await migrate(engine)
        # Distinct words past the limit, and a last one only the whole text holds.
        long = " ".join(f"w{i:06d}" for i in range(limit // 8 + 100)) + " zebra"
        async with transaction(engine) as conn:
            assert await conn.scalar(vector, {"seq": 0}) == "'kept':1 'lantern':2"
            await conn.execute(insert, {"seq": 1, "said": long})
            bounded = await conn.scalar(
                text(
                    "SELECT tsv = to_tsvector('english', left(text, :limit)) FROM nodes "
                    "WHERE seq = 1"
                ),
                {"limit": limit},
            )
            assert bounded is True
            held = await conn.scalar(
                text("SELECT count(*) FROM lexemes WHERE lexeme IN ('w000000', 'zebra')")
            )
            assert held == 1  # the first word only
        async with engine.connect() as conn:
            await conn.run_sync(_upgrade_to("0018", down=True))
            await conn.commit()
        async with transaction(engine) as conn:
            assert "'zebra'" in await conn.scalar(vector, {"seq": 1})
    finally:
        await engine.dispose()
