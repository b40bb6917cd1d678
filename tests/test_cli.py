"""The `memstrata` command as a user runs it: `python -m gateway ...` in a process of its own,
on the session's Postgres (`MEMSTRATA_DATABASE_URL`), its exit status and what it writes.

A command that fails says why in a line (`Error: ...`) and exits non-zero; it never ends in a
Python traceback. What `import` stored is read back from the database.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.postgres import drop_database, fresh_database
from devkit.service import child_env, free_port
from devkit.service import memstrata as run_memstrata
from memory import schema
from memory.build import jobs, tree
from memory.db import connect, migrate
from memory.errors import NotFound
from memory.postgres import EmbeddedPostgres
from memory.write import store, tenants, tree_nodes


@pytest.fixture(scope="module")
def database_url(module_database_url: str) -> str:
    """This module's own database (see `module_database_url`): `import --wait` runs its
    conversation's jobs, one test with embeddings that fail, and one leaves jobs queued."""
    return module_database_url


@pytest.fixture(scope="module")
def engine(module_engine: AsyncEngine) -> AsyncEngine:
    return module_engine


def memstrata(
    *args: str, database_url: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`memstrata ARGS` run to its end on `database_url`, with what it wrote to stdout and
    stderr."""
    environment = child_env({"database_url": database_url, "log_level": "warning"})
    environment.update(env or {})
    return run_memstrata(*args, env=environment)


def refused(run: subprocess.CompletedProcess[str]) -> str:
    """The one-line reason a run that failed gave, checked to be no traceback."""
    assert run.returncode != 0, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert "Error: " in run.stderr, run.stderr
    return run.stderr


def write_jsonl(path: Path, messages: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(message) + "\n" for message in messages))
    return path


async def stored(engine: AsyncEngine, conversation: str) -> list[store.MessageRecord]:
    """The messages the default tenant's conversation holds, every branch, in order."""
    async with engine.connect() as conn:
        tenant = await store.tenant_id_by_name(conn)
        ref = await store.find_conversation(conn, tenant_id=tenant, external_id=conversation)
        return await store.list_messages(conn, tenant_id=tenant, conversation_id=ref.id)


def conversation_id() -> str:
    return f"cli-{uuid.uuid4().hex[:12]}"


TURNS = [
    {"role": "user", "content": "Which hotel did we book in Lisbon?"},
    {"role": "assistant", "content": "The Alfama Patio, from the 3rd to the 7th."},
    {"role": "user", "content": "And the flight?"},
    {"role": "assistant", "content": "TP 1351, leaving at 07:40."},
]


def test_a_file_that_is_not_utf8_is_refused_in_words(tmp_path: Path, database_url: str) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"role": "user", "content": "caf\u00e9"}\n'.encode("latin-1"))
    said = refused(memstrata("import", str(path), database_url=database_url))
    assert "UTF-8" in said


async def test_a_file_written_with_a_byte_order_mark_imports(
    tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    # As Windows tools write UTF-8 (PowerShell 5's `Out-File -Encoding utf8`).
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + write_jsonl(tmp_path / "plain", TURNS).read_bytes())
    conversation = conversation_id()
    run = memstrata("import", str(path), "--conversation", conversation, database_url=database_url)
    assert run.returncode == 0, run.stderr
    assert [m.content for m in await stored(engine, conversation)] == [t["content"] for t in TURNS]


@pytest.mark.parametrize("name", ["broken.jsonl", "broken.txt"])
def test_a_malformed_line_of_a_jsonl_file_is_named(
    tmp_path: Path, database_url: str, name: str
) -> None:
    path = write_jsonl(tmp_path / name, TURNS)
    lines = path.read_text().splitlines()
    lines.insert(2, '{"role": "user", "content": "unterminated}')
    path.write_text("\n".join(lines) + "\n")
    said = refused(memstrata("import", str(path), database_url=database_url))
    assert "line 3 is not valid JSON" in said


@pytest.mark.parametrize(
    "text",
    [
        # `{"messages": [` then one message a line: JSON, though lines start with `{`.
        '{"messages": [\n' + ",\n".join(json.dumps(turn) for turn in TURNS) + "\n]}\n",
        # JSONL by another name.
        "".join(json.dumps(turn) + "\n" for turn in TURNS),
    ],
    ids=["json", "jsonl"],
)
async def test_json_and_jsonl_are_told_apart_by_what_they_hold(
    tmp_path: Path, database_url: str, engine: AsyncEngine, text: str
) -> None:
    path = tmp_path / "history.json"
    path.write_text(text)
    conversation = conversation_id()
    run = memstrata("import", str(path), "--conversation", conversation, database_url=database_url)
    assert run.returncode == 0, run.stderr
    assert [m.content for m in await stored(engine, conversation)] == [t["content"] for t in TURNS]


def test_a_batch_of_no_messages_is_refused(tmp_path: Path, database_url: str) -> None:
    path = write_jsonl(tmp_path / "turns.jsonl", TURNS)
    # -1 said "4 messages imported" and stored none; 0 ended in a ValueError traceback.
    for batch in ("-1", "0"):
        run = memstrata(
            "import",
            str(path),
            "--conversation",
            conversation_id(),
            "--batch",
            batch,
            database_url=database_url,
        )
        assert run.returncode == 2, run.stderr  # a usage error, before anything is read
        assert "--batch" in run.stderr and "Traceback" not in run.stderr, run.stderr


async def test_times_without_a_zone_are_utc_whatever_the_machines_zone(
    tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    # As the admin API's bulk import reads them (and as every time it shows is written).
    path = write_jsonl(
        tmp_path / "naive.jsonl",
        [
            {**TURNS[0], "created_at": "2024-03-01T10:00:00"},
            {**TURNS[1], "created_at": "2024-03-01T10:01:00+00:00"},
        ],
    )
    conversation = conversation_id()
    run = memstrata(
        "import",
        str(path),
        "--conversation",
        conversation,
        database_url=database_url,
        env={"TZ": "America/New_York"},
    )
    assert run.returncode == 0, run.stderr
    times = [m.created_at.isoformat() for m in await stored(engine, conversation)]
    assert times == ["2024-03-01T10:00:00+00:00", "2024-03-01T10:01:00+00:00"]


async def test_a_file_imported_again_after_the_conversation_went_on_adds_nothing(
    tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    conversation = conversation_id()
    first = write_jsonl(tmp_path / "first.jsonl", TURNS[:2])
    later = write_jsonl(tmp_path / "later.jsonl", TURNS[2:])
    for path in (first, later, first):
        run = memstrata(
            "import", str(path), "--conversation", conversation, database_url=database_url
        )
        assert run.returncode == 0, run.stderr
    assert [m.content for m in await stored(engine, conversation)] == [t["content"] for t in TURNS]
    assert "0 messages imported" in run.stderr

    # The first file, grown since: only what it gained is new.
    grown = [*TURNS[:2], {"role": "user", "content": "Book a taxi for the 3rd."}]
    run = memstrata(
        "import",
        str(write_jsonl(first, grown)),
        "--conversation",
        conversation,
        database_url=database_url,
    )
    assert run.returncode == 0, run.stderr
    assert "1 messages imported" in run.stderr
    contents = [m.content for m in await stored(engine, conversation)]
    assert contents == [t["content"] for t in [*TURNS, grown[-1]]]


async def test_a_file_imported_again_into_a_conversation_it_did_not_open_adds_nothing(
    tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    """A file imported into a conversation that held messages before it follows them, so its
    messages' chain hashes are not the file's own from the start: run again, the import found
    none of them held and stored them all again."""
    conversation = conversation_id()
    earlier = write_jsonl(tmp_path / "earlier.jsonl", TURNS[:2])
    later = write_jsonl(tmp_path / "later.jsonl", TURNS[2:])
    for path in (earlier, later):
        run = memstrata(
            "import", str(path), "--conversation", conversation, database_url=database_url
        )
        assert run.returncode == 0, run.stderr
    before = [m.content for m in await stored(engine, conversation)]
    assert before == [t["content"] for t in TURNS]
    for path in (later, earlier, later):
        run = memstrata(
            "import", str(path), "--conversation", conversation, database_url=database_url
        )
        assert run.returncode == 0, run.stderr
        assert "0 messages imported" in run.stderr
    assert [m.content for m in await stored(engine, conversation)] == before


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://localhost:abc/memstrata", "MEMSTRATA_DATABASE_URL"),
        ("postgresql://localhost:5432:5432/memstrata", "MEMSTRATA_DATABASE_URL"),
        ("postgresql://localhost:99999/memstrata", "MEMSTRATA_DATABASE_URL"),
        ("postgresql://[::1/memstrata", "MEMSTRATA_DATABASE_URL"),
    ],
)
def test_a_database_url_that_cannot_serve_is_refused_in_words(url: str, reason: str) -> None:
    said = refused(memstrata("migrate", database_url=url))
    assert reason in said


def test_a_refused_setting_is_named_without_echoing_its_value() -> None:
    # A command's output ends up in logs (docker, CI): a database password must not.
    said = refused(memstrata("migrate", database_url="mysql://memstrata:hunter2-secret@db/x"))
    assert "MEMSTRATA_DATABASE_URL must be a postgresql:// URL" in said
    assert "hunter2-secret" not in said


def test_a_message_refused_names_its_field(tmp_path: Path, database_url: str) -> None:
    path = write_jsonl(tmp_path / "turns.jsonl", [TURNS[0], {"content": "no role"}])
    said = refused(memstrata("import", str(path), database_url=database_url))
    assert "message 2: role: Field required" in said
    # A part of a content is named as OpenAI names it, without pydantic's union member.
    part = {"role": "user", "content": [{"type": "text", "text": "a"}, 5]}
    path = write_jsonl(tmp_path / "parts.jsonl", [part])
    said = refused(memstrata("import", str(path), database_url=database_url))
    assert "message 1: content: " in said and "content.str" not in said


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400"])
async def test_numbers_json_cannot_hold_are_refused_before_anything_is_stored(
    tmp_path: Path, database_url: str, engine: AsyncEngine, number: str
) -> None:
    # Postgres refused them as the third message's batch was stored, after the first batch.
    path = write_jsonl(tmp_path / "turns.jsonl", TURNS)
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:-1] + f', "temperature": {number}}}'
    path.write_text("\n".join(lines) + "\n")
    conversation = conversation_id()
    said = refused(
        memstrata(
            "import",
            str(path),
            "--conversation",
            conversation,
            "--batch",
            "2",
            database_url=database_url,
        )
    )
    assert "line 3" in said
    async with engine.connect() as conn:
        tenant = await store.tenant_id_by_name(conn)
        with pytest.raises(NotFound):
            await store.find_conversation(conn, tenant_id=tenant, external_id=conversation)


def test_wait_fails_when_the_tree_could_not_be_built(tmp_path: Path, database_url: str) -> None:
    # Embeddings from an upstream nothing answers: the build cannot run.
    path = write_jsonl(tmp_path / "turns.jsonl", TURNS)
    run = memstrata(
        "import",
        str(path),
        "--conversation",
        conversation_id(),
        "--wait",
        database_url=database_url,
        env={
            "MEMSTRATA_EMBEDDING_PROVIDER": "upstream",
            "MEMSTRATA_UPSTREAM_BASE_URL": "http://127.0.0.1:1/v1",
            "MEMSTRATA_UPSTREAM_API_KEY": "sk-test",
            "MEMSTRATA_BACKGROUND_RETRIES": "0",
        },
    )
    said = refused(run)
    assert "4 messages imported" in said


async def test_wait_builds_what_the_import_queued_and_nothing_else(
    tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    """`--wait` builds what it imported, and leaves the rest of the queue to the workers: another
    tenant's job and another conversation's stay queued. It ran every job in the database."""
    async with engine.begin() as conn:
        others = []
        default = await store.tenant_id_by_name(conn)
        tenant = await tenants.create_tenant(conn, name=f"other-{uuid.uuid4().hex[:8]}")
        for tenant_id in (default, tenant.id):
            ref, _ = await store.open_conversation(
                conn, tenant_id=tenant_id, external_id=conversation_id()
            )
            job_id = await jobs.enqueue(
                conn, kind=tree.JOB_KIND, tenant_id=tenant_id, conversation_id=ref.id
            )
            assert job_id is not None
            others.append(job_id)
    path = write_jsonl(tmp_path / "turns.jsonl", TURNS)
    conversation = conversation_id()
    run = memstrata(
        "import", str(path), "--conversation", conversation, "--wait", database_url=database_url
    )
    assert run.returncode == 0, run.stderr
    async with engine.connect() as conn:
        for message in await stored(engine, conversation):
            node = await tree_nodes.get_node(conn, tenant_id=default, node_id=message.node_id)
            assert node.embedded
        statuses = await conn.execute(
            select(schema.jobs.c.status).where(schema.jobs.c.id.in_(others))
        )
        assert [status for (status,) in statuses] == ["queued", "queued"]
        imported = await store.find_conversation(conn, tenant_id=default, external_id=conversation)
        left = await conn.scalar(
            select(func.count()).where(
                schema.jobs.c.conversation_id == imported.id, schema.jobs.c.status != "done"
            )
        )
    assert left == 0


def paragraph(run: subprocess.CompletedProcess[str]) -> str:
    """The reason a command that could not start gave: one paragraph (a line), exit status 1,
    without a traceback or SQLAlchemy's documentation link."""
    said = refused(run)
    assert run.returncode == 1, (run.returncode, said)
    [line] = [line for line in said.splitlines() if line.strip()]
    assert line.startswith("Error: ") and "sqlalche.me" not in line, said
    return line


COMMANDS = ["serve", "worker", "migrate"]


def start(command: str, database_url: str) -> subprocess.CompletedProcess[str]:
    """`memstrata COMMAND` (`serve` on a free port, without background work) on `database_url`."""
    serving = {"MEMSTRATA_PORT": str(free_port()), "MEMSTRATA_WORKERS": "0"}
    return memstrata(command, database_url=database_url, env=serving if command == "serve" else {})


@pytest.mark.parametrize("command", COMMANDS)
def test_a_database_nothing_listens_at_is_refused_saying_what_to_do(command: str) -> None:
    # Found in serve's start-up (the app's lifespan), it was a traceback in a log line.
    said = paragraph(start(command, "postgresql://127.0.0.1:1/memstrata"))
    assert "cannot reach Postgres at 127.0.0.1:1 (Connection refused)" in said, said
    assert "is Postgres running" in said and "MEMSTRATA_DATABASE_URL" in said, said


@pytest.fixture(scope="module")
def server_url(postgres: EmbeddedPostgres) -> str:
    """The session's server, as a `postgresql://` URL without its database."""
    return postgres.url.replace("postgresql+asyncpg://", "postgresql://").rsplit("/", 1)[0]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("postgres@{host}/no_such_database", ["no database 'no_such_database'", "CREATE DATABASE"]),
        ("no_such_user@{host}/postgres", ["refused user 'no_such_user'", "user name and password"]),
    ],
)
def test_a_database_the_server_refuses_is_named_with_what_to_do(
    server_url: str, command: str, where: str, said: list[str]
) -> None:
    """A database that does not exist, a user the server refuses (as a wrong password is): the
    reason was Postgres' own after SQLAlchemy's class name, with its documentation link on a
    line of its own, and nothing to do."""
    host = server_url.removeprefix("postgresql://").split("@")[-1]
    line = paragraph(start(command, f"postgresql://{where.format(host=host)}"))
    assert all(words in line for words in said) and "MEMSTRATA_DATABASE_URL" in line, line


def test_serve_says_in_a_paragraph_that_its_port_is_in_use(database_url: str) -> None:
    """It was a JSON log line of uvicorn's, exit status 3, once the database was migrated,
    the model loaded and the worker process started."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"MEMSTRATA_PORT": str(port), "MEMSTRATA_WORKERS": "0"}
        line = paragraph(memstrata("serve", database_url=database_url, env=env))
    assert f"port {port} is in use on 127.0.0.1" in line and "MEMSTRATA_PORT" in line, line


@contextlib.asynccontextmanager
async def own_database(server_url: str, *, migrated: bool) -> AsyncIterator[str]:
    """A database of the test's own on the session's server (migrated or empty), its URL."""
    name = f"cli_{uuid.uuid4().hex[:12]}"
    server = server_url.replace("://", "+asyncpg://", 1) + "/postgres"
    url = await fresh_database(server, name)
    try:
        if migrated:
            engine = connect(url)
            try:
                await migrate(engine)
            finally:
                await engine.dispose()
        yield url
    finally:
        await drop_database(server, name)


@pytest.mark.parametrize("command", COMMANDS)
async def test_a_database_a_newer_memstrata_migrated_is_refused_in_words(
    server_url: str, command: str
) -> None:
    """Alembic's "Can't locate revision" was a traceback (in serve's, a log line's)."""
    async with own_database(server_url, migrated=True) as url:
        await execute(url, "UPDATE alembic_version SET version_num = '0099_from_the_future'")
        line = paragraph(start(command, url))
    assert "is at migration '0099_from_the_future'" in line and "newer" in line, line
    assert "MEMSTRATA_DATABASE_URL" in line, line


@pytest.mark.parametrize("command", COMMANDS)
async def test_a_user_who_may_not_migrate_is_told_so(server_url: str, command: str) -> None:
    """The reason (Postgres' "permission denied") was hidden by a second error: the unlock that
    followed ran in the aborted transaction, and its traceback said only that."""
    user = f"cli_{uuid.uuid4().hex[:12]}"
    async with own_database(server_url, migrated=False) as url:
        await execute(url, f"CREATE ROLE {user} LOGIN")
        try:
            line = paragraph(start(command, url.replace("postgres@", f"{user}@", 1)))
        finally:
            await execute(url, f"DROP ROLE {user}")
    assert f"user '{user}' may not change its schema" in line, line
    assert "permission denied for schema public" in line and "MEMSTRATA_DATABASE_URL" in line


async def execute(url: str, statement: str) -> None:
    engine = connect(url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(statement))
    finally:
        await engine.dispose()


def serve_embedded(data_dir: Path) -> subprocess.CompletedProcess[str]:
    """`memstrata serve` with the embedded Postgres under `data_dir` (no database URL)."""
    return run_memstrata(
        "serve",
        env=child_env({"data_dir": data_dir, "port": free_port(), "log_level": "warning"}),
    )


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A folder Postgres can reach even when it runs as its own user (as root)."""
    where = Path(tempfile.mkdtemp(prefix="memstrata-cli-"))
    where.chmod(0o755)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_serve_says_in_a_paragraph_that_a_data_dir_it_cannot_create_is_unusable(
    reachable_dir: Path,
) -> None:
    """A data directory that cannot be made (a file is in its place) was a traceback."""
    (reachable_dir / "taken").write_text("not a folder")
    said = refused(serve_embedded(reachable_dir / "taken"))
    [line] = [line for line in said.splitlines() if line.strip()]
    assert str(reachable_dir / "taken") in line and "MEMSTRATA_DATA_DIR" in line, said


def test_serve_says_in_a_paragraph_that_the_embedded_postgres_did_not_start(
    reachable_dir: Path,
) -> None:
    """A damaged data directory: Postgres does not start. Found in the app's start-up, it was a
    traceback logged by uvicorn; it is the reason, where to look and what to do."""
    (reachable_dir / "postgres").mkdir()
    (reachable_dir / "postgres" / "PG_VERSION").write_text("18\n")
    said = refused(serve_embedded(reachable_dir))
    [line] = [line for line in said.splitlines() if line.strip()]
    assert "the embedded Postgres did not start" in line, said
    assert "postgresql.conf" in line and "move it away" in line, said
    assert str(reachable_dir / "postgres" / "server.log") in line, said


async def test_a_file_is_imported_into_the_tenant_named(
    tmp_path: Path, database_url: str, engine: AsyncEngine
) -> None:
    """`--tenant` names the tenant that owns the conversation (it went to the default one
    always); a tenant that does not exist is refused in words, storing nothing."""
    name = f"imports-{uuid.uuid4().hex[:8]}"
    async with engine.begin() as conn:
        tenant = await tenants.create_tenant(conn, name=name)
    path = write_jsonl(tmp_path / "turns.jsonl", TURNS)
    conversation = conversation_id()
    missing = memstrata(
        "import",
        str(path),
        "--conversation",
        conversation,
        "--tenant",
        f"{name}-missing",
        database_url=database_url,
    )
    assert f"tenant '{name}-missing' does not exist" in refused(missing)
    run = memstrata(
        "import",
        str(path),
        "--conversation",
        conversation,
        "--tenant",
        name,
        "--wait",
        database_url=database_url,
    )
    assert run.returncode == 0, run.stderr
    async with engine.connect() as conn:
        owned = await store.find_conversation(conn, tenant_id=tenant.id, external_id=conversation)
        count = select(func.count()).where(
            schema.nodes.c.conversation_id == owned.id, schema.nodes.c.level == 0
        )
        assert await conn.scalar(count) == len(TURNS)
        default = await store.tenant_id_by_name(conn)
        with pytest.raises(NotFound):
            await store.find_conversation(conn, tenant_id=default, external_id=conversation)
