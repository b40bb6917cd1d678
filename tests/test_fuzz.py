"""Property-based: whatever a client sends to the chat endpoint, the gateway never answers 5xx,
and a request it refuses writes nothing and forwards nothing.

hypothesis draws chat bodies, raw bytes and headers from `devkit.hostile` (valid shapes, wrong
types, hostile text: NUL, unpaired surrogates, huge and non-finite numbers, deep nesting). The
app runs in-process, the upstream is the real fake server. CI runs a bounded number of
examples; `bench.faults` runs many more and reports the counts.
"""

import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import HealthCheck, given, settings
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import hostile
from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from memory.schema import conversations, jobs, nodes
from tests.inprocess import App, running_app

CHAT = "/v1/chat/completions"
EXAMPLES = 150


@pytest.fixture(scope="module")
async def app(database_url: str, upstream: UpstreamServer) -> AsyncIterator[App]:
    settings = Settings(
        database_url=database_url, upstream_base_url=upstream.url, workers=0, max_body_bytes=65536
    )
    async with running_app(settings) as running:
        yield running


async def counts(engine: AsyncEngine, tenant: int) -> tuple[int, ...]:
    found = []
    async with engine.connect() as conn:
        for table in (conversations, nodes, jobs):
            query = select(func.count()).select_from(table).where(table.c.tenant_id == tenant)
            found.append(int(await conn.scalar(query) or 0))
    return tuple(found)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=hostile.payloads, extra=hostile.header_sets)
async def test_no_body_or_header_gets_a_5xx_and_a_refusal_writes_nothing(
    app: App, engine: AsyncEngine, upstream: UpstreamServer, payload: bytes, extra: dict[str, str]
) -> None:
    upstream.reset()
    tenant = app.state.default_tenant_id
    before = await counts(engine, tenant)
    sent = {"content-type": "application/json", **extra}
    wire = {key.encode("latin-1"): value.encode("latin-1") for key, value in sent.items()}
    async with (
        app.client() as client,
        client.stream("POST", CHAT, content=payload, headers=wire) as response,
    ):
        body = await response.aread()
    assert response.status_code < 500, body[:500]
    if response.status_code >= 400:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert await counts(engine, tenant) == before, "a refused request wrote rows"
        assert upstream.requests() == [], "a refused request went upstream"
