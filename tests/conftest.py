"""Shared fixtures: one real embedded Postgres + pgvector per test session, migrated once.

`make test` runs the files in parallel (pytest-xdist, `--dist loadfile`): each worker process is
a session of its own, with its own Postgres, and a file's module fixtures are set up once.

Tests isolate themselves by tenant: the `tenant_id` fixture makes a fresh tenant, so no test
sees another's rows and nothing needs truncating. `app` is the gateway's app in-process
(`tests.inprocess`) for a module's admin API tests, and `admin` a loopback client of it.
"""

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from sqlalchemy import delete, insert
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.postgres import drop_database, fresh_database, throwaway_postgres
from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from memory.db import connect, migrate
from memory.postgres import EmbeddedPostgres
from memory.schema import jobs, tenants
from tests.inprocess import App, running_app


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give each of schemathesis's tests (one per admin operation, `test[GET /admin/jobs]`) a
    node id of its own. Under pytest 9.2 they all get the test function's id, and pytest-xdist's
    `--dist loadfile` keys tests by id: it ran one of the 22 and counted the rest as nothing."""
    for item in items:
        if item.parent is not None and not item.nodeid.endswith(item.name):
            item._id = item.parent.id.child(item.name)  # what pytest's Node does without an id


@pytest.fixture(scope="session")
def postgres() -> Iterator[EmbeddedPostgres]:
    """A real Postgres 18 + pgvector server for the whole session, on a throwaway folder."""
    with throwaway_postgres(prefix="memstrata-test-") as server:
        yield server


@pytest.fixture(scope="session")
def database_url(postgres: EmbeddedPostgres) -> str:
    return postgres.url


@contextlib.asynccontextmanager
async def migrated(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on `database_url`, migrated; disposed on exit."""
    engine = connect(database_url)
    try:
        await migrate(engine)
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture(scope="session")
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """A migrated engine on the session's server."""
    async with migrated(database_url) as engine:
        yield engine


@pytest.fixture(scope="module")
async def module_database_url(postgres: EmbeddedPostgres) -> AsyncIterator[str]:
    """A database of the module's own on the session's server, dropped after the module.

    For modules whose workers run every queued job: the session's database holds the builds
    that other tests' apps (which run no workers) left queued. Such a module overrides
    `database_url` and `engine` with this and `module_engine`."""
    name = f"module_{uuid.uuid4().hex[:12]}"
    try:
        yield await fresh_database(postgres.url, name)
    finally:
        await drop_database(postgres.url, name)


@pytest.fixture(scope="module")
async def module_engine(module_database_url: str) -> AsyncIterator[AsyncEngine]:
    """A migrated engine on `module_database_url`."""
    async with migrated(module_database_url) as engine:
        yield engine


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamServer]:
    """The fake OpenAI upstream, a real HTTP server process, one per test module."""
    with UpstreamServer() as server:
        yield server


@pytest.fixture
def fresh_upstream(upstream: UpstreamServer) -> None:
    """Forget what earlier tests scripted and recorded on the module's upstream."""
    upstream.reset()


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    """A `memstrata serve` process on the module's upstream, without background work (a
    module that needs another defines its own)."""
    with GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as gw:
        yield gw


@pytest.fixture
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    """An HTTP client of `gateway`, from its root (`/v1/...`, `/admin/...`)."""
    with httpx.Client(base_url=gateway.root_url, timeout=30) as client:
        yield client


@pytest.fixture
async def tenant_id(engine: AsyncEngine) -> int:
    """A fresh tenant of this test's own."""
    async with engine.begin() as conn:
        created = await conn.scalar(
            insert(tenants).values(name=f"test-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
    assert created is not None
    return int(created)


@pytest.fixture
async def kind(engine: AsyncEngine) -> AsyncIterator[str]:
    """A job kind of this test's own; its jobs are deleted afterwards, so that no other test's
    worker (which may claim every kind) finds them."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    async with engine.begin() as conn:
        await conn.execute(delete(jobs).where(jobs.c.kind == name))


@pytest.fixture(scope="module")
async def app(database_url: str, upstream: UpstreamServer) -> AsyncIterator[App]:
    """The app in-process, without workers or memory tools, one per test module."""
    settings = Settings(
        database_url=database_url, upstream_base_url=upstream.url, workers=0, memory_tools="never"
    )
    async with running_app(settings) as running:
        yield running


@pytest.fixture
async def admin(app: App) -> AsyncIterator[httpx.AsyncClient]:
    """A loopback client of `app` (the admin API answers it without a token)."""
    async with app.client() as client:
        yield client
