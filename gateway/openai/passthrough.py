"""Relaying a request to the upstream unchanged, with no memory: every `/v1` path the gateway
does not serve itself (models, embeddings, audio, images, moderations, files, batches, …).

The method, the path, the query string and the body go upstream as the client sent them; the
body is streamed through as it arrives (an upload may be large, and is neither parsed nor
stored; `MEMSTRATA_MAX_BODY_BYTES` bounds only the bodies the gateway reads: chat, responses,
embeddings), with the headers that describe it (`Content-Type`, so a multipart boundary survives,
`Content-Length` and `Accept`), the `OpenAI-Organization` / `OpenAI-Project` / `OpenAI-Beta`
headers and the upstream's authorization (`gateway.upstream.Upstream.headers_for`). The answer
comes back with its status and headers, its body relayed chunk by chunk as it arrives, so a
stream (server-sent events, speech audio) reaches the client as it is produced.
"""

import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from gateway.upstream import Upstream, relayed_headers

log = logging.getLogger(__name__)

_BODYLESS = ("GET", "HEAD", "DELETE", "OPTIONS")


async def relay(
    request: Request,
    upstream: Upstream,
    path: str,
    *,
    json: object = None,
    observed_as: str | None = None,
) -> Response:
    """Send the client's request to `path` upstream and relay the answer as it comes; `json`:
    a body the gateway has read and checked already (else the client's is streamed through);
    `observed_as`: the path the metrics report (`path` itself by default)."""
    return answer(await send(request, upstream, path, json=json, observed_as=observed_as))


async def send(
    request: Request,
    upstream: Upstream,
    path: str,
    *,
    json: object = None,
    content: bytes | None = None,
    query: str | None = None,
    observed_as: str | None = None,
) -> httpx.Response:
    """Send the client's request to `path` upstream; the answer's body is unread. `content`:
    the client's raw body, read already; `query`: another query string than the client's."""
    raw = json is None and (
        content is not None
        or request.method not in _BODYLESS
        or "content-length" in request.headers
    )
    return await upstream.open(
        request.method,
        path,
        headers=upstream.headers_for(request.headers, raw_body=raw),
        json=json,
        content=content if content is not None else request.stream() if raw else None,
        query=request.url.query if query is None else query,
        stream=True,
        observed_as=observed_as,
    )


def answer(response: httpx.Response) -> StreamingResponse:
    """Relay an upstream answer to the client: its status, its headers, its body as it comes."""
    return StreamingResponse(
        _chunks(response), status_code=response.status_code, headers=relayed_headers(response)
    )


async def _chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_bytes():
            yield chunk
    except httpx.HTTPError as exc:
        # The status is already sent: the connection is dropped, so that the client sees an
        # incomplete body rather than a short one that looks whole.
        log.warning("upstream relay interrupted: %s", type(exc).__name__)
        raise
    finally:
        await response.aclose()
