"""The database stops mid-run: fail-open forwards unchanged, fail-closed answers 503.

An embedded Postgres of this module's own (never the session's, which other tests share) serves
three real gateway processes: fail-open with gateway keys (`auth=on`), fail-open without, and
fail-closed. Each is used while the database is up, then the server is stopped, requests are
sent, the server is started again, and requests work as before.
"""

import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.service import free_port
from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from memory.db import connect
from memory.postgres import EmbeddedPostgres
from tests.inprocess import App, running_app

CHAT = "/v1/chat/completions"
UPSTREAM_KEY = "sk-upstream-of-the-gateway"
CLIENT_KEY = "sk-client-own-key"


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    with throwaway_postgres(prefix="memstrata-failopen-") as postgres:
        yield postgres


@pytest.fixture(autouse=True)
def _fresh(upstream: UpstreamServer) -> None:
    upstream.reset()


@pytest.fixture(scope="module")
def gateways(
    server: EmbeddedPostgres, upstream: UpstreamServer
) -> Iterator[dict[str, GatewayProcess]]:
    common: dict[str, Any] = {
        "database_url": server.url,
        "upstream_url": upstream.url,
        "workers": 0,
        "memory_tools": "never",
        "metrics_refresh_seconds": 0,
    }
    variants: dict[str, dict[str, Any]] = {
        "open": {"fail_open": "on"},
        "open_auth": {"fail_open": "on", "auth": "on", "upstream_api_key": UPSTREAM_KEY},
        "closed": {"fail_open": "off"},
    }
    # Started one after the other: concurrent starts would race on the first migration.
    started: dict[str, GatewayProcess] = {}
    try:
        for name, settings in variants.items():
            started[name] = GatewayProcess(**settings, **common)
        yield started
    finally:
        for process in started.values():
            process.stop()


def body(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": text}], **extra}


def post(gateway: GatewayProcess, payload: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/chat/completions",
        json=payload,
        headers={"Authorization": f"Bearer {CLIENT_KEY}", **headers},
        timeout=30,
    )


def stream(
    gateway: GatewayProcess, payload: dict[str, Any], key: str
) -> tuple[int, dict[str, str], str]:
    with httpx.stream(
        "POST",
        f"{gateway.url}/chat/completions",
        json={**payload, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    ) as response:
        return response.status_code, dict(response.headers), response.read().decode()


def ready(gateway: GatewayProcess) -> int:
    return httpx.get(f"{gateway.root_url}/readyz", timeout=10).status_code


def metric(gateway: GatewayProcess, name: str) -> float:
    text = httpx.get(f"{gateway.root_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def test_database_stopped_mid_run(
    server: EmbeddedPostgres, upstream: UpstreamServer, gateways: dict[str, GatewayProcess]
) -> None:
    opened, keyed, closed = gateways["open"], gateways["open_auth"], gateways["closed"]
    key = httpx.post(f"{keyed.root_url}/admin/tenants", json={"name": "acme"}, timeout=10)
    assert key.status_code == 201
    created = httpx.post(f"{keyed.root_url}/admin/tenants/acme/keys", timeout=10).json()
    known, unseen = (
        created["key"],
        httpx.post(f"{keyed.root_url}/admin/tenants/acme/keys", timeout=10).json()["key"],
    )

    # -- up: memory works everywhere --------------------------------------------------------
    for gateway in (opened, closed):
        response = post(gateway, body(f"before {uuid.uuid4().hex}"))
        assert response.status_code == 200
        assert "x-memstrata-degraded" not in response.headers
        assert response.headers["x-memstrata-conversation"]
    assert post(keyed, body("before"), Authorization=f"Bearer {known}").status_code == 200
    assert all(ready(gateway) == 200 for gateway in gateways.values())
    upstream.reset()

    server.stop()
    try:
        # -- down, fail-open: forwarded unchanged, marked degraded -------------------------
        payload = body(f"while down {uuid.uuid4().hex}", temperature=0.2, seed=7)
        response = post(opened, payload, **{"X-Memstrata-Conversation": "mine-1"})
        assert response.status_code == 200, response.text
        assert response.headers["x-memstrata-degraded"] == "1"
        assert response.headers["x-memstrata-conversation"] == "mine-1"
        assert response.json()["choices"][0]["message"]["content"].startswith("echo: while down")
        [sent] = upstream.requests(CHAT)
        assert sent["body"] == payload  # unchanged
        assert sent["headers"]["authorization"] == f"Bearer {CLIENT_KEY}"

        without_header = post(opened, body("no header"))
        assert without_header.headers["x-memstrata-degraded"] == "1"
        assert "x-memstrata-conversation" not in without_header.headers

        status, headers, text = stream(opened, body("streamed while down"), CLIENT_KEY)
        assert status == 200 and headers["x-memstrata-degraded"] == "1"
        assert "data: [DONE]" in text

        # With gateway keys: a key verified before the outage still passes; the upstream
        # gets the gateway's own key, never the client's gateway key.
        upstream.reset()
        keyed_response = post(keyed, body("keyed while down"), Authorization=f"Bearer {known}")
        assert keyed_response.status_code == 200, keyed_response.text
        assert keyed_response.headers["x-memstrata-degraded"] == "1"
        [keyed_sent] = upstream.requests(CHAT)
        assert keyed_sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
        # A key never seen cannot be checked: 503, not forwarded.
        refused = post(keyed, body("unknown key"), Authorization=f"Bearer {unseen}")
        assert refused.status_code == 503
        assert len(upstream.requests(CHAT)) == 1

        assert metric(opened, "memstrata_degraded_requests_total") == 3
        assert metric(opened, "memstrata_database_up") == 0

        # -- down, fail-closed: 503 in OpenAI's shape, nothing forwarded --------------------
        upstream.reset()
        for attempt in (body("closed"), {**body("closed stream"), "stream": True}):
            failed = post(closed, attempt)
            assert failed.status_code == 503
            error = failed.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"]) == ("service_unavailable", "storage_unavailable")
            assert "x-memstrata-degraded" not in failed.headers
        assert upstream.requests(CHAT) == []

        # -- readiness follows the database; liveness does not -----------------------------
        for gateway in gateways.values():
            assert ready(gateway) == 503
            assert httpx.get(f"{gateway.root_url}/healthz", timeout=10).status_code == 200
    finally:
        server.start()

    # -- up again: memory works as before, without a restart of the gateways ----------------
    deadline = time.monotonic() + 20
    while not all(ready(gateway) == 200 for gateway in gateways.values()):
        assert time.monotonic() < deadline, "readyz did not recover"
        time.sleep(0.2)
    for gateway in (opened, closed):
        again = post(
            gateway, body(f"after {uuid.uuid4().hex}"), **{"X-Memstrata-Conversation": "back"}
        )
        assert again.status_code == 200
        assert "x-memstrata-degraded" not in again.headers
    stored = httpx.get(f"{opened.root_url}/admin/conversations/back/messages", timeout=10).json()
    assert len(stored["messages"]) == 4  # both gateways, user + reply each
    # What was forwarded while down was not stored.
    missing = httpx.get(f"{opened.root_url}/admin/conversations/mine-1/messages", timeout=10)
    assert missing.status_code == 404
    assert post(keyed, body("after"), Authorization=f"Bearer {unseen}").status_code == 200


async def test_a_response_forwarded_while_the_database_is_down_is_marked_degraded(
    database_url: str, upstream: UpstreamServer
) -> None:
    """The Responses API forwards without memory too; its answer said nothing of it (the chat
    path's `X-Memstrata-Degraded` was missing), so a client could not tell that the turn was
    not kept."""
    settings = Settings(
        database_url=database_url,
        upstream_base_url=upstream.url,
        workers=0,
        fail_open="on",
        upstream_responses="on",
    )
    unreachable = connect(f"postgresql+asyncpg://nobody@127.0.0.1:{free_port()}/none")
    try:
        async with running_app(settings) as running:
            down = App(running.app, dataclasses.replace(running.state, engine=unreachable))
            async with down.client() as client:
                named = {"X-Memstrata-Conversation": "down-1"}
                for stream in (False, True):
                    payload = {"model": "m", "input": f"while down {stream}", "stream": stream}
                    response = await client.post("/v1/responses", json=payload, headers=named)
                    assert response.status_code == 200, response.text
                    assert response.headers["x-memstrata-degraded"] == "1"
                    assert response.headers["x-memstrata-conversation"] == "down-1"
                chat = await client.post(CHAT, json=body("while down"))
                assert chat.headers["x-memstrata-degraded"] == "1"
    finally:
        await unreachable.dispose()
    sent = [request["body"] for request in upstream.requests("/v1/responses")]
    assert [request["input"] for request in sent] == ["while down False", "while down True"]
