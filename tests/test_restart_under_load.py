"""Postgres restarted while chat requests run: no 500, and no answer acknowledged as stored
that was not.

Two real gateway processes on an embedded Postgres of this module's own, one failing open and
one failing closed, take a steady stream of chat requests (each message unique, each
conversation named) while the server is stopped and started again. Then, per answer:

* no status is 5xx but 503 (fail-closed, database down);
* an answer without `X-Memstrata-Degraded` stored its user message and its reply;
* a degraded answer (fail-open) stored either nothing of its request, or, when its message had
  been stored before the database failed, its reply too once the database was back.

`bench.faults` runs the same at ~20 requests/s for longer and reports the counts and the
recovery time; here the run is scaled down to a few seconds.
"""

import concurrent.futures
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.upstream import UpstreamServer
from memory.postgres import EmbeddedPostgres

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedPostgres]:
    with throwaway_postgres(prefix="memstrata-restart-") as postgres:
        yield postgres


@pytest.fixture(scope="module")
def gateways(server: EmbeddedPostgres, upstream: UpstreamServer) -> Iterator[list[GatewayProcess]]:
    common: dict[str, Any] = {
        "database_url": server.url,
        "upstream_url": upstream.url,
        "workers": 0,
        "memory_tools": "never",
    }
    started: list[GatewayProcess] = []
    try:
        for fail_open in ("on", "off"):  # one after the other: the first migrates
            started.append(GatewayProcess(**common, fail_open=fail_open))
        yield started
    finally:
        for process in started:
            process.stop()


@dataclass(frozen=True)
class Answer:
    gateway: GatewayProcess
    conversation: str
    text: str
    status: int
    degraded: bool


def send(gateway: GatewayProcess, number: int, stream: bool) -> Answer:
    conversation = f"restart-{number}-{uuid.uuid4().hex[:8]}"
    text = f"message {number} {uuid.uuid4().hex}"
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "stream": stream}
    headers = {"X-Memstrata-Conversation": conversation}
    with httpx.stream(
        "POST", f"{gateway.url}/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        response.read()
    degraded = response.headers.get("x-memstrata-degraded") == "1"
    return Answer(gateway, conversation, text, response.status_code, degraded)


def stored(gateway: GatewayProcess, conversation: str) -> list[dict[str, object]]:
    response = httpx.get(f"{gateway.root_url}/admin/conversations/{conversation}/messages")
    if response.status_code == 404:
        return []
    assert response.status_code == 200, response.text
    messages: list[dict[str, object]] = response.json()["messages"]
    return messages


def test_a_database_restart_under_load_loses_no_acknowledged_message(
    server: EmbeddedPostgres, gateways: list[GatewayProcess]
) -> None:
    stop = threading.Event()
    numbers = itertools.count()

    def load() -> list[Answer]:
        answers = []
        while not stop.is_set():
            number = next(numbers)
            answers.append(send(gateways[number % 2], number, stream=number % 3 == 0))
            time.sleep(0.15)
        return answers

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(load) for _ in range(4)]
        time.sleep(1.5)
        server.stop()
        time.sleep(1.5)
        server.start()
        time.sleep(2.0)
        stop.set()
        answers = [answer for run in runs for answer in run.result()]

    assert len(answers) > 10  # a loaded machine answers fewer in the same seconds
    statuses = {answer.status for answer in answers}
    assert statuses <= {200, 503}, statuses
    opened = gateways[0]
    assert all(a.status == 200 for a in answers if a.gateway is opened)
    assert any(a.degraded or a.status == 503 for a in answers), "the outage was not seen"

    deadline = time.monotonic() + 30  # a degraded turn's reply is stored in the background
    pending = [a for a in answers if a.status == 200]
    while pending:
        left = []
        for answer in pending:
            messages = stored(opened, answer.conversation)
            contents = [message["content"] for message in messages]
            if answer.degraded and not messages:
                continue  # the database failed before anything was stored
            assert contents[:1] == [answer.text], (answer, contents)
            if len(messages) < 2:
                left.append(answer)  # stored, its reply not yet
        if left and time.monotonic() > deadline:
            pytest.fail(f"{len(left)} acknowledged turns never stored their reply: {left[:3]}")
        pending = left
        time.sleep(0.5)
