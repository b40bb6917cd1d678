"""The gateway's way to the upstream (`gateway.upstream.Upstream`), against the fake upstream, a
real HTTP server process: which of its pooled clients a request goes through, and so whether the
connections it opened are used again.

A request goes through the first client with the fewest requests in flight, and stays in flight
until its response is closed. Requests one at a time therefore share one client and its one
kept-alive connection (taken in turn, a pool of `CLIENTS` clients saw one request in `CLIENTS`
and opened a connection for each one that came slower than its keep-alive), while requests in
flight together spread over the clients; an idle connection is kept for the keep-alive
(`MEMSTRATA_UPSTREAM_KEEP_ALIVE_SECONDS`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from devkit.service import free_port
from devkit.upstream import UpstreamServer
from gateway.errors import UpstreamUnavailable
from gateway.upstream import CLIENTS, Upstream, make_clients

pytestmark = pytest.mark.usefixtures("fresh_upstream")
PATH = "/chat/completions"


def _body(text: str, *, stream: bool = False) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "stream": stream}


@pytest.fixture
async def hooked() -> AsyncIterator[tuple[list[httpx.AsyncClient], list[int]]]:
    """Three clients that say, in `seen`, which of them sent each request."""
    seen: list[int] = []

    def hook(index: int) -> Callable[[httpx.Request], Awaitable[None]]:
        async def sent(request: httpx.Request) -> None:
            seen.append(index)

        return sent

    clients = [
        httpx.AsyncClient(event_hooks={"request": [hook(index)]}, trust_env=False)
        for index in range(3)
    ]
    yield clients, seen
    for client in clients:
        await client.aclose()


async def test_requests_one_at_a_time_share_one_connection(upstream: UpstreamServer) -> None:
    clients = make_clients(timeout=10.0, connect_timeout=5.0)
    way = Upstream(clients, base_url=upstream.url, api_key="sk-test")
    try:
        for number in range(2 * CLIENTS):
            response = await way.open("POST", PATH, headers={}, json=_body(f"question {number}"))
            assert response.status_code == 200
            await way.read(response)
    finally:
        for client in clients:
            await client.aclose()
    recorded = upstream.requests(f"/v1{PATH}")
    assert len(recorded) == 2 * CLIENTS
    assert len({request["peer"] for request in recorded}) == 1


async def test_requests_in_flight_spread_and_a_closed_one_frees_its_client(
    upstream: UpstreamServer, hooked: tuple[list[httpx.AsyncClient], list[int]]
) -> None:
    clients, seen = hooked
    way = Upstream(clients, base_url=upstream.url, api_key="sk-test")
    # Streams opened and not yet read: each holds its client.
    held = [
        await way.open("POST", PATH, headers={}, json=_body(f"held {n}", stream=True), stream=True)
        for n in range(3)
    ]
    assert seen == [0, 1, 2]
    await held[1].aclose()
    again = await way.open("POST", PATH, headers={}, json=_body("after one closed"))
    assert seen[-1] == 1
    await way.read(again)  # read to its end: released too
    assert await held[0].aread()  # a stream read to its end closes itself
    await held[2].aclose()
    await held[2].aclose()  # closing twice releases once
    for number in range(3):
        response = await way.open("POST", PATH, headers={}, json=_body(f"idle {number}"))
        await way.read(response)
    assert seen[-3:] == [0, 0, 0]


async def test_a_request_that_fails_frees_its_client(
    hooked: tuple[list[httpx.AsyncClient], list[int]],
) -> None:
    clients, seen = hooked
    nobody = f"http://127.0.0.1:{free_port('127.0.0.1')}/v1"
    way = Upstream(clients, base_url=nobody, api_key="sk-test")
    for _ in range(2):
        with pytest.raises(UpstreamUnavailable):
            await way.open("POST", PATH, headers={}, json=_body("to nobody"))
    assert seen == [0, 0]


@pytest.mark.parametrize(("keep_alive", "connections"), [(0.2, 2), (3.0, 1)])
async def test_an_idle_connection_is_kept_for_the_keep_alive(
    upstream: UpstreamServer, keep_alive: float, connections: int
) -> None:
    clients = make_clients(timeout=10.0, connect_timeout=5.0, keep_alive=keep_alive)
    way = Upstream(clients, base_url=upstream.url, api_key="sk-test")
    try:
        for number in range(2):
            if number:
                await asyncio.sleep(0.6)
            response = await way.open("POST", PATH, headers={}, json=_body(f"after {number}"))
            await way.read(response)
    finally:
        for client in clients:
            await client.aclose()
    peers = {request["peer"] for request in upstream.requests(f"/v1{PATH}")}
    assert len(peers) == connections
