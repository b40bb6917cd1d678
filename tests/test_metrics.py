"""Metrics move when requests flow; logs are JSON lines with the request id, and nothing secret.

Most tests call the app in-process and read `/metrics` before and after; the streams-open gauge
and the log lines need a real server process (a stream held open while `/metrics` is read; the
process's own stderr).
"""

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.logs import JsonFormatter, request_id
from gateway.settings import Settings
from memory.build import jobs, tree
from memory.build.jobs import Job
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer
from memory.build.worker import Worker
from memory.schema import conversations
from tests.inprocess import App, running_app

CHAT = "/v1/chat/completions"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
async def app(database_url: str, upstream: UpstreamServer) -> AsyncIterator[App]:
    settings = Settings(
        database_url=database_url,
        upstream_base_url=upstream.url,
        workers=0,
        metrics_refresh_seconds=0,
        memory_tools="never",
    )
    async with running_app(settings) as running:
        yield running


@pytest.fixture
async def client(app: App) -> AsyncIterator[httpx.AsyncClient]:
    async with app.client() as http:
        yield http


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def scrape(client: httpx.AsyncClient) -> Samples:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": text}], **extra}


async def test_chat_requests_move_request_overhead_upstream_and_token_metrics(
    client: httpx.AsyncClient,
) -> None:
    before = await scrape(client)
    for stream in (False, True):
        response = await client.post(CHAT, json=chat(f"metrics {uuid.uuid4().hex}", stream=stream))
        assert response.status_code == 200
    conversation = response.headers["x-memstrata-conversation"]
    assert (await client.get(f"/admin/conversations/{conversation}")).status_code == 200
    assert (await client.get("/admin/conversations/not-there")).status_code == 404
    assert (await client.get("/no/such/route")).status_code == 404
    after = await scrape(client)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    requests = "memstrata_http_requests_total"
    assert moved(requests, method="POST", route=CHAT, status="200") == 2
    # Route templates, never raw paths (unbounded label values).
    assert moved(requests, method="GET", route="/admin/conversations/{conversation}", status="200")
    assert moved(requests, method="GET", route="/admin/conversations/{conversation}", status="404")
    assert moved(requests, method="GET", route="unmatched", status="404") == 1
    assert not any("not-there" in str(labels) for _, labels in after)
    assert moved("memstrata_http_request_duration_seconds_count", method="POST", route=CHAT) == 2
    assert moved("memstrata_gateway_overhead_seconds_count") == 2
    assert moved("memstrata_gateway_overhead_seconds_sum") > 0
    upstream_count = "memstrata_upstream_latency_seconds_count"
    assert moved(upstream_count, path="/chat/completions", outcome="2xx") == 2
    assert moved("memstrata_prompt_tokens_total") > 0
    assert moved("memstrata_history_tokens_total") >= moved("memstrata_prompt_tokens_total")
    assert value(after, "memstrata_streams_open") == 0
    assert value(after, "memstrata_database_up") == 1
    assert value(after, "memstrata_jobs", status="queued") >= 1


async def test_upstream_failures_are_counted_by_outcome(
    client: httpx.AsyncClient, upstream: UpstreamServer
) -> None:
    before = await scrape(client)
    upstream.script({"status": 503})
    assert (await client.post(CHAT, json=chat("fails upstream"))).status_code == 503
    after = await scrape(client)
    name = "memstrata_upstream_latency_seconds_count"
    labels = {"path": "/chat/completions", "outcome": "5xx"}
    assert value(after, name, **labels) - value(before, name, **labels) == 1
    requests = {"method": "POST", "route": CHAT, "status": "503"}
    assert (
        value(after, "memstrata_http_requests_total", **requests)
        - value(before, "memstrata_http_requests_total", **requests)
        == 1
    )


async def test_job_durations_failures_and_queue_depth(
    app: App, client: httpx.AsyncClient, engine: AsyncEngine, tenant_id: int
) -> None:
    kind = f"metrics-{uuid.uuid4().hex[:8]}"
    async with engine.begin() as conn:
        for outcome in ("fail", "succeed"):
            await jobs.enqueue(
                conn,
                kind=kind,
                tenant_id=tenant_id,
                conversation_id=None,
                payload={"outcome": outcome},
                max_attempts=1,
            )
    queued = await scrape(client)
    assert value(queued, "memstrata_jobs", status="queued") >= 2

    async def handle(job: Job) -> None:
        if job.payload["outcome"] == "fail":
            raise RuntimeError("planned failure")

    worker = Worker(
        engine, {kind: handle}, kinds=[kind], listen=False, observe=app.state.metrics.observe_job
    )
    assert await worker.run_until_idle() == 2
    after = await scrape(client)
    assert value(after, "memstrata_job_failures_total", kind=kind) == 1
    assert value(after, "memstrata_job_duration_seconds_count", kind=kind, outcome="failed") == 1
    assert value(after, "memstrata_job_duration_seconds_count", kind=kind, outcome="done") == 1
    assert value(after, "memstrata_jobs", status="dead") >= 1
    assert value(after, "memstrata_jobs", status="failures") >= 1


async def test_summaries_by_level_and_method(
    app: App, client: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    conversation = f"metrics-tree-{uuid.uuid4().hex}"
    texts = [f"Fact number {n}: the code word is {uuid.uuid4().hex[:6]}." for n in range(4)]
    imported = await client.post(
        f"/admin/conversations/{conversation}/messages",
        json={"messages": [{"role": "user", "content": text} for text in texts]},
    )
    assert imported.status_code == 201
    before = await scrape(client)
    async with engine.connect() as conn:
        conversation_id = await conn.scalar(
            select(conversations.c.id).where(conversations.c.external_id == conversation)
        )
    assert conversation_id is not None
    config = tree.TreeConfig(
        embedder=app.state.embedder,
        summarizer=ExtractiveSummarizer("gpt-4o"),
        policy=SegmentPolicy(shift_threshold=2.0, max_messages=2),
    )
    await tree.build(
        engine,
        tenant_id=app.state.default_tenant_id,
        conversation_id=int(conversation_id),
        config=config,
        final=True,
    )
    after = await scrape(client)
    labels = {"level": "1", "method": "extractive"}
    assert value(after, "memstrata_summaries", **labels) - value(
        before, "memstrata_summaries", **labels
    ) == pytest.approx(2)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_request_path_stages_are_timed(client: httpx.AsyncClient, path: str) -> None:
    """Every chat or response request's stages land in a histogram per stage (its reply's
    record too); one whose history does not fit its budget also times the compaction that
    built its working context, its question's embedding, its recall note and the retrieval
    legs under it."""

    def body(text: str) -> dict[str, Any]:
        return chat(text) if path == CHAT else {"model": "gpt-4o", "input": text}

    before = await scrape(client)
    conversation = {"X-Memstrata-Conversation": f"stages-{uuid.uuid4().hex}"}
    history = [f"note {n}: " + "words " * 60 for n in range(12)]
    for text in history:
        response = await client.post(path, json=body(text), headers=conversation)
        assert response.status_code == 200, response.text
    tight = {**conversation, "X-Memstrata-Budget": "400"}
    response = await client.post(path, json=body("note 3?"), headers=tight)
    assert response.status_code == 200, response.text
    after = await scrape(client)

    def count(stage: str) -> float:
        name = "memstrata_request_stage_seconds_count"
        return value(after, name, stage=stage) - value(before, name, stage=stage)

    assert count("store") == count("assemble") == count("record") == len(history) + 1
    assert count("fulltext") >= 1 and count("tokens") >= 1  # the rebuilt prompt's legs
    # Its working context was built (a compaction) and its question embedded for a note.
    assert count("compaction") >= 1 and count("embed") >= 1 and count("note") >= 1


async def test_request_ids_are_made_or_taken_and_echoed(client: httpx.AsyncClient) -> None:
    made = await client.get("/healthz")
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    taken = await client.get("/healthz", headers={"X-Request-Id": "client-id:42"})
    assert taken.headers["x-request-id"] == "client-id:42"
    refused = await client.get("/healthz", headers={"X-Request-Id": "bad id\twith spaces"})
    assert re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    error = await client.get("/admin/conversations/nope/messages")
    assert error.status_code == 404 and error.headers["x-request-id"]


async def test_a_bug_is_a_500_in_openai_shape_with_the_request_id(app: App) -> None:
    async def broken() -> None:
        raise RuntimeError("a bug")

    app.app.add_api_route("/test-only/broken", broken, include_in_schema=False)
    async with app.client(raise_app_exceptions=False) as client:
        before = await scrape(client)
        response = await client.get("/test-only/broken", headers={"X-Request-Id": "bug-1"})
        after = await scrape(client)
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "bug-1"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_error")
    assert "bug-1" in error["message"] and "a bug" not in error["message"]
    labels = {"method": "GET", "route": "/test-only/broken", "status": "500"}
    name = "memstrata_http_requests_total"
    assert value(after, name, **labels) - value(before, name, **labels) == 1


def test_json_formatter_writes_one_object_with_request_id_and_extras() -> None:
    record = logging.LogRecord(
        "memstrata.test", logging.INFO, __file__, 1, "hello %s", ("x",), None
    )
    record.conversation = "c-1"
    token = request_id.set("rid-1")
    try:
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id.reset(token)
    assert line["message"] == "hello x"
    assert (line["level"], line["logger"], line["request_id"]) == (
        "info",
        "memstrata.test",
        "rid-1",
    )
    assert line["conversation"] == "c-1"
    assert "args" not in line and "msg" not in line


async def test_metrics_need_the_metrics_or_admin_token_when_set(
    database_url: str, upstream: UpstreamServer
) -> None:
    metrics_token, admin_token = "m" * 20, "a" * 20
    settings = Settings(
        database_url=database_url,
        upstream_base_url=upstream.url,
        workers=0,
        admin_token=admin_token,
        metrics_token=metrics_token,
    )
    async with running_app(settings) as guarded, guarded.client(host="10.9.8.7") as remote:
        assert (await remote.get("/metrics")).status_code == 401
        wrong = await remote.get("/metrics", headers={"Authorization": "Bearer " + "x" * 20})
        assert wrong.status_code == 401
        for token in (metrics_token, admin_token):
            allowed = await remote.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert allowed.status_code == 200
        # The metrics token opens nothing else.
        admin = await remote.get(
            "/admin/tenants", headers={"Authorization": f"Bearer {metrics_token}"}
        )
        assert admin.status_code == 401
    without = Settings(database_url=database_url, upstream_base_url=upstream.url, workers=0)
    async with running_app(without) as open_app, open_app.client(host="10.9.8.7") as remote:
        assert (await remote.get("/metrics")).status_code == 403  # like the admin API


# -- a real process: streams open, and what the logs hold ----------------------------------


@pytest.fixture(scope="module")
def slow_upstream() -> Iterator[UpstreamServer]:
    with UpstreamServer(chunk_delay=0.2) as server:
        yield server


@pytest.fixture(scope="module")
def process(database_url: str, slow_upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url,
        upstream_url=slow_upstream.url,
        workers=0,
        metrics_refresh_seconds=0,
        memory_tools="never",
    ) as gateway:
        yield gateway


def _streams_open(root_url: str) -> float:
    samples = parse(httpx.get(f"{root_url}/metrics", timeout=10).text)
    return value(samples, "memstrata_streams_open")


async def test_streams_open_while_relayed_and_after_a_client_leaves(
    process: GatewayProcess,
) -> None:
    assert _streams_open(process.root_url) == 0
    body = chat("one two three four five six seven eight nine ten", stream=True)
    async with (
        httpx.AsyncClient(base_url=process.root_url, timeout=30) as http,
        http.stream("POST", CHAT, json=body) as response,
    ):
        assert response.status_code == 200
        chunks = response.aiter_bytes()
        await anext(chunks)
        assert await asyncio.to_thread(_streams_open, process.root_url) == 1
        async for _ in chunks:
            pass
    assert await asyncio.to_thread(_streams_open, process.root_url) == 0

    # A client that leaves mid-stream closes its stream too.
    async with (
        httpx.AsyncClient(base_url=process.root_url, timeout=30) as http,
        http.stream("POST", CHAT, json=body) as response,
    ):
        chunks = response.aiter_bytes()  # held: a dropped iterator closes the connection
        await anext(chunks)
        assert await asyncio.to_thread(_streams_open, process.root_url) == 1
    for _ in range(50):
        if await asyncio.to_thread(_streams_open, process.root_url) == 0:
            break
        await asyncio.sleep(0.1)
    assert await asyncio.to_thread(_streams_open, process.root_url) == 0


def test_logs_are_json_lines_with_request_ids_and_no_content(process: GatewayProcess) -> None:
    secret = f"secret-content-{uuid.uuid4().hex}"
    sent = httpx.post(
        f"{process.url}/chat/completions",
        json=chat(secret),
        headers={"X-Request-Id": f"trace-{secret[-8:]}", "Authorization": "Bearer sk-client-key"},
        timeout=30,
    )
    assert sent.status_code == 200
    request_id = f"trace-{secret[-8:]}"
    # The access line is written once the response is sent: it may trail the client's answer.
    deadline = time.monotonic() + 10
    while True:
        logs = process.logs()
        lines = [json.loads(line) for line in logs.splitlines() if line.strip()]
        found = [line for line in lines if line.get("request_id") == request_id]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert lines, logs
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    [access] = found
    assert access["logger"] == "memstrata.access"
    assert (access["route"], access["status"]) == (CHAT, 200)
    assert access["upstream_request_id"].startswith("req_")
    assert secret not in logs
    assert "sk-client-key" not in logs
