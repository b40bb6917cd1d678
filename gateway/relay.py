"""Forwarding a chat completion upstream and relaying the answer to the client.

The upstream answer is relayed unchanged: an error keeps its status, body and `Retry-After`; a
stream is passed on chunk by chunk as it arrives while a `StreamedReply` rebuilds the message
beside it. The reply is recorded when it ends (before the client is sent `[DONE]`), marked
incomplete if the stream was cut, even when the client has gone. When the memory tools are
offered (`gateway.toolloop.offer`), the request goes through the tool loop instead, with the
same guarantees.
"""

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from gateway import toolloop
from gateway.deps import State
from gateway.errors import GatewayError
from gateway.replies import StreamedReply, from_completion
from gateway.streams import sse_error
from gateway.turn import Turn
from gateway.upstream import relayed_headers

__all__ = ["forward", "sse_error"]

log = logging.getLogger(__name__)


async def forward(
    state: State,
    turn: Turn,
    *,
    client_headers: Mapping[str, str],
    body: dict[str, Any],
    stream: bool,
) -> Response:
    """Send `body` upstream and answer the client with what comes back."""
    offer = toolloop.offer(state.settings, turn, body)
    if offer is not None:
        loop = toolloop.ToolLoop(state, turn, client_headers=client_headers, body=body, offer=offer)
        return await (loop.stream() if stream else loop.complete())
    upstream = state.upstream
    try:
        response = await upstream.open(
            "POST",
            "/chat/completions",
            headers=upstream.headers_for(client_headers),
            json=body,
            stream=stream,
        )
    except GatewayError as exc:
        exc.headers.update(turn.headers())
        raise
    if stream and response.is_success:
        return StreamingResponse(
            _relay(response, state, turn),
            status_code=response.status_code,
            headers={
                **relayed_headers(response),
                **turn.headers(),
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
            media_type="text/event-stream",
        )
    try:
        content = await upstream.read(response)
    except GatewayError as exc:
        exc.headers.update(turn.headers())
        raise
    if response.is_success:
        await turn.record(state, from_completion(_json(content)), complete=True)
    return Response(
        content,
        status_code=response.status_code,
        headers={**relayed_headers(response), **turn.headers()},
    )


async def _relay(response: httpx.Response, state: State, turn: Turn) -> AsyncIterator[bytes]:
    """Pass the upstream stream on as it comes; store what arrived when it ends.

    The reply is stored before the client is sent `[DONE]`: a client that sends its next turn
    as soon as it has the answer must find the reply already in the conversation."""
    reply = StreamedReply()
    recorded = False
    try:
        async for chunk in response.aiter_bytes():
            reply.feed(chunk)
            if reply.done and not recorded:
                recorded = True
                with anyio.CancelScope(shield=True):
                    await turn.record(state, reply.message(), complete=True)
            yield chunk
    except httpx.HTTPError as exc:
        log.warning(
            "upstream stream interrupted: %s",
            type(exc).__name__,
            extra={"conversation": turn.external_id},
        )
        yield sse_error(
            f"the upstream stream was interrupted ({type(exc).__name__}); "
            "the partial reply was kept",
            code="upstream_stream_interrupted",
        )
    finally:
        await response.aclose()
        # The client may be gone (cancelled scope): storing the reply must still happen.
        if not recorded:
            with anyio.CancelScope(shield=True):
                await turn.record(state, reply.message(), complete=reply.complete)


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None
