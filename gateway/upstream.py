"""The upstream OpenAI-compatible server, reached through one pooled `httpx.AsyncClient`.

`Upstream.open(method, path, ...)` sends a request and returns the response with its body not
yet read, so that a stream can be relayed chunk by chunk; transport failures become
`UpstreamUnavailable` (502) or `UpstreamTimeout` (504). An upstream *answer* with an error
status is not an exception here: the caller relays its status, body and `Retry-After` as they are.
"""

from collections.abc import Mapping
from typing import Any

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
# Client headers worth passing on besides the body: auth is decided separately.
_FORWARDED_REQUEST_HEADERS = ("openai-organization", "openai-project", "openai-beta")


class Upstream:
    """The upstream server: where prompts are sent and answers come from."""

    def __init__(self, client: httpx.AsyncClient, *, base_url: str, api_key: str | None) -> None:
        self._client = client
        self._base_url = base_url.rstrip("/")
        self._api_key = api_key

    def headers_for(self, client_headers: Mapping[str, str]) -> dict[str, str]:
        """Headers to send upstream: our key if we have one, else the client's own."""
        headers = {
            name: client_headers[name]
            for name in _FORWARDED_REQUEST_HEADERS
            if name in client_headers
        }
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        elif "authorization" in client_headers:
            headers["authorization"] = client_headers["authorization"]
        return headers

    async def open(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str],
        json: Any = None,
        stream: bool = False,
    ) -> httpx.Response:
        """Send a request; the caller must `aclose()` the response (its body is unread)."""
        request = self._client.build_request(
            method,
            f"{self._base_url}{path}",
            json=json,
            # SSE must arrive as written, not gzip-buffered.
            headers={**headers, "accept-encoding": "identity"} if stream else dict(headers),
        )
        try:
            return await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(f"the upstream did not answer in time ({_name(exc)})") from exc
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(f"cannot reach the upstream: {_name(exc)}") from exc

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


def relayed_headers(response: httpx.Response) -> dict[str, str]:
    """The upstream answer's own headers (rate limits, request ids, Retry-After …)."""
    return {
        name: value for name, value in response.headers.items() if name.lower() not in _HOP_BY_HOP
    }


def _name(exc: Exception) -> str:
    detail = str(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def make_client(*, timeout: float, connect_timeout: float) -> httpx.AsyncClient:
    """The pooled client every upstream call of a process goes through."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=connect_timeout),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
    )
