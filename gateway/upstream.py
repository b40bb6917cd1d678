"""The upstream OpenAI-compatible server, reached through a few pooled `httpx.AsyncClient`s.

One client shared by many concurrent requests does not scale: its connection pool does work
proportional to the requests waiting on it for each one it serves (encode/httpx#3215), so a
process keeps `CLIENTS` of them (`make_clients`) and sends each request through the first of
those with the fewest requests in flight (until their responses are closed). Under load the
requests spread over all of them; at a few requests a second they all go through the first,
whose idle connections then stay alive between them. (Taken in turn, each client saw one request
in `CLIENTS`, so below about two requests a second every request waited longer than the
keep-alive and opened a new connection: a TCP and a TLS handshake before each prompt, where a
client talking to the upstream directly reused its one.)

`Upstream.open(method, path, ...)` sends a request (a JSON body, or raw bytes as they come, and
the client's query string, such as Azure's `api-version`) and returns the response with its
body not yet read, so that a stream can be relayed chunk by chunk; transport failures become
`UpstreamUnavailable` (502) or `UpstreamTimeout` (504). An upstream *answer* with an error
status is not an exception here: the caller relays its status, body and `Retry-After` as they are.
Every call is timed to its response headers and reported to the `observe` callback (the
metrics). The upstream gets our `api_key` if set, else the client's own `Authorization`, but
never while gateway keys are in use (`forward_client_auth=False`): that header is a gateway key.
"""

import functools
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Final

import httpx

from gateway.errors import UpstreamTimeout, UpstreamUnavailable

# Headers of an upstream answer that describe the connection or the encoding we undo,
# rather than the answer itself: never relayed.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-encoding",
        "content-length",
        "upgrade",
        "date",
        "server",
        "proxy-authenticate",
        "trailer",
        "te",
    }
)
CLIENTS: Final = 8
# Idle upstream connections are closed by us before the server may close them: uvicorn (and
# many servers) drop idle connections after 5 s, and a request sent on a connection the server
# is closing at that moment fails (ReadError, a 502 for the client).
KEEPALIVE_SECONDS: Final = 4.0
# Client headers worth passing on besides the body: auth is decided separately.
_FORWARDED_REQUEST_HEADERS = ("openai-organization", "openai-project", "openai-beta")
# What describes a body relayed as raw bytes (a multipart upload's boundary, its size).
_BODY_HEADERS = ("content-type", "content-length", "accept")


Observer = Callable[[str, float, str], None]
"""Told `(path, seconds, outcome)` of every upstream call: the time to the response headers,
and `2xx`..`5xx`, `timeout` or `error`."""


class Upstream:
    """The upstream server: where prompts are sent and answers come from.

    `forward_client_auth`: without an `api_key`, pass the client's own `Authorization` on (only
    while gateway authentication is off: with it on, the client's header holds a gateway key,
    which must never leave the gateway). `serves_responses`: whether the upstream serves the
    Responses API, None while not known (`gateway.openai.responses` finds out)."""

    def __init__(
        self,
        clients: Sequence[httpx.AsyncClient],
        *,
        base_url: str,
        api_key: str | None,
        forward_client_auth: bool = True,
        observe: Observer | None = None,
        serves_responses: bool | None = None,
    ) -> None:
        if not clients:
            raise ValueError("Upstream needs at least one client")
        self._clients = list(clients)
        self._in_flight = [0] * len(self._clients)
        self._base_url = base_url.rstrip("/")
        self._api_key = api_key
        self._forward_client_auth = forward_client_auth
        self._observe = observe
        self.serves_responses = serves_responses
        """Whether `POST /responses` is served there: None until known (learnt once)."""

    def headers_for(
        self, client_headers: Mapping[str, str], *, raw_body: bool = False
    ) -> dict[str, str]:
        """Headers to send upstream: the OpenAI ones the client sent (and, for a `raw_body`,
        those describing it), with our key if we have one, else the client's own."""
        names = (*_FORWARDED_REQUEST_HEADERS, *(_BODY_HEADERS if raw_body else ()))
        headers = {name: client_headers[name] for name in names if name in client_headers}
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        elif self._forward_client_auth and "authorization" in client_headers:
            headers["authorization"] = client_headers["authorization"]
        return headers

    async def open(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        json: Any = None,
        content: bytes | AsyncIterable[bytes] | None = None,
        query: str = "",
        stream: bool = False,
        observed_as: str | None = None,
    ) -> httpx.Response:
        """Send a request (`json`, or the raw `content`, with the client's `query` string);
        the caller must `aclose()` the response (its body is unread). `observed_as`: the path
        the call is reported as (a relayed path is the client's, of any number of values)."""
        counts = self._in_flight
        index = counts.index(min(counts))
        client = self._clients[index]
        request = client.build_request(
            method,
            f"{self._base_url}{path}?{query}" if query else f"{self._base_url}{path}",
            json=json,
            content=content,
            # SSE must arrive as written, not gzip-buffered.
            headers={**headers, "accept-encoding": "identity"} if stream else dict(headers),
        )
        path = observed_as or path
        counts[index] += 1
        try:
            response = await self._send(client, request, path)
        except BaseException:
            self._release(index)
            raise
        response.stream = _Counted(response.stream, functools.partial(self._release, index))
        return response

    def _release(self, index: int) -> None:
        self._in_flight[index] -= 1

    async def _send(
        self, client: httpx.AsyncClient, request: httpx.Request, path: str
    ) -> httpx.Response:
        started = time.perf_counter()
        try:
            response = await client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            self._observed(path, started, "timeout")
            raise UpstreamTimeout(f"the upstream did not answer in time ({_name(exc)})") from exc
        except httpx.HTTPError as exc:
            self._observed(path, started, "error")
            raise UpstreamUnavailable(f"cannot reach the upstream: {_name(exc)}") from exc
        self._observed(path, started, f"{response.status_code // 100}xx")
        return response

    def _observed(self, path: str, started: float, outcome: str) -> None:
        if self._observe is not None:
            self._observe(path, time.perf_counter() - started, outcome)

    async def read(self, response: httpx.Response) -> bytes:
        """The whole body of an opened response, transport errors translated."""
        try:
            return await response.aread()
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"the upstream did not answer in time ({_name(exc)})") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"the upstream broke the connection: {_name(exc)}") from exc
        finally:
            await response.aclose()


class _Counted(httpx.AsyncByteStream):
    """A response's body that calls `release` once, when it is closed (read to its end, or
    closed early): until then its request is in flight on its client."""

    def __init__(
        self, stream: httpx.SyncByteStream | httpx.AsyncByteStream, release: Callable[[], None]
    ) -> None:
        if not isinstance(stream, httpx.AsyncByteStream):
            raise TypeError("an async client's response has an async body")
        self._stream = stream
        self._release: Callable[[], None] | None = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
        await self._stream.aclose()


def relayed_headers(response: httpx.Response) -> dict[str, str]:
    """The upstream answer's own headers (rate limits, request ids, Retry-After …)."""
    return {
        name: value for name, value in response.headers.items() if name.lower() not in _HOP_BY_HOP
    }


def _name(exc: Exception) -> str:
    detail = str(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def make_clients(
    *, timeout: float, connect_timeout: float, keep_alive: float = KEEPALIVE_SECONDS
) -> list[httpx.AsyncClient]:
    """The `CLIENTS` clients chat completions go through, 1000 connections between them, each
    idle connection closed after `keep_alive` seconds."""
    connections = 1000 // CLIENTS
    return [
        httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(
                max_connections=connections,
                max_keepalive_connections=max(connections // 10, 1),
                keepalive_expiry=keep_alive,
            ),
        )
        for _ in range(CLIENTS)
    ]
