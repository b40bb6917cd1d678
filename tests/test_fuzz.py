"""Property-based: whatever a client sends to the chat endpoint, the gateway never answers 5xx,
and a request it refuses writes nothing and forwards nothing.

hypothesis generates chat bodies (valid shapes, wrong types, hostile text: NUL, unpaired
surrogates, huge and non-finite numbers, deep nesting), raw bytes, and headers (conversation
ids, budgets, content types). The app runs in-process, the upstream is the real fake server.
CI runs a bounded number of examples; `bench.faults` runs many more and reports the counts.
"""

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from memory.schema import conversations, jobs, nodes
from tests.inprocess import App, running_app

CHAT = "/v1/chat/completions"
EXAMPLES = 150

texts = st.text(max_size=30) | st.sampled_from(["a\x00b", "a\ud800b", "\udfff", "", " ", "é" * 40])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | texts
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["user", "assistant", "system", "developer", "tool", "function", "x"])
calls = st.lists(
    st.fixed_dictionaries(
        {"id": texts, "type": st.just("function")},
        optional={"function": st.fixed_dictionaries({"name": texts, "arguments": texts | values})},
    ),
    max_size=2,
)
message = st.fixed_dictionaries(
    {"role": roles | values},
    optional={
        "content": texts
        | values
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts})),
        "name": texts | values,
        "tool_calls": calls | values,
        "tool_call_id": texts | values,
    },
)
bodies = st.fixed_dictionaries(
    {"model": st.just("m") | texts | values, "messages": st.lists(message, max_size=4) | values},
    optional={
        "stream": st.booleans() | values,
        "user": texts | values,
        "metadata": values,
        "temperature": values,
        "tools": values,
        "max_tokens": values,
        "stop": values,
    },
)


def nested(depth: int) -> bytes:
    return b'{"model": "m", "messages": [], "x": ' + b"[" * depth + b"]" * depth + b"}"


raw_bodies = st.binary(max_size=200) | st.sampled_from(
    [nested(70), nested(1500), b'{"model": "m", "temperature": 1e999, "messages": []}']
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "X-Memstrata-Conversation": st.text(alphabet=st.characters(codec="latin-1"), max_size=12),
        "X-Memstrata-Budget": st.text(alphabet=st.characters(codec="latin-1"), max_size=8),
        "content-type": st.sampled_from(["application/json", "text/plain", "application/x+json"]),
    },
)


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


def encoded(body: Any) -> bytes:
    # As a client's JSON library would send it: escapes for what is not ASCII.
    return json.dumps(body, ensure_ascii=True).encode()


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payload=bodies.map(encoded) | raw_bodies, extra=headers)
async def test_no_body_or_header_gets_a_5xx_and_a_refusal_writes_nothing(
    app: App, engine: AsyncEngine, upstream: UpstreamServer, payload: bytes, extra: dict[str, str]
) -> None:
    upstream.reset()
    tenant = app.state.default_tenant_id
    before = await counts(engine, tenant)
    sent = {"content-type": "application/json", **extra}
    wire = {key: value.encode("latin-1") for key, value in sent.items()}
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
