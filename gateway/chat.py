"""One chat completion: identify → store → assemble → forward → record → enqueue.

The client's messages are stored (and their background processing queued) in one transaction
before anything goes upstream, so an upstream failure never loses them. The upstream answer is
relayed unchanged: an error keeps its status, body and `Retry-After`; a stream is passed on
chunk by chunk as it arrives while a `StreamedReply` rebuilds the message beside it. The reply
is stored after it ends, marked incomplete if the stream was cut, even when the client has gone.
"""

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from gateway.deps import State, read_json
from gateway.errors import GatewayError, error_body
from gateway.replies import StreamedReply, from_completion
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import relayed_headers
from memory import hierarchy, identity, store
from memory.db import transaction
from memory.errors import MemstrataError

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "X-Memstrata-Conversation"


@dataclass
class Turn:
    """What one request has established before going upstream."""

    tenant_id: int
    conversation_id: int
    external_id: str
    model: str
    started: float
    overhead: float = 0.0

    def headers(self) -> dict[str, str]:
        return {
            CONVERSATION_HEADER: self.external_id,
            "X-Memstrata-Overhead-Ms": f"{self.overhead * 1000:.2f}",
        }


async def parse(
    request: Request, *, max_bytes: int
) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """The raw body (forwarded as is) and its validated view."""
    body = await read_json(request, max_bytes=max_bytes)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
    try:
        return body, ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


async def complete(request: Request, state: State, *, tenant_id: int) -> Response:
    """Handle `POST /v1/chat/completions`."""
    started = time.perf_counter()
    body, chat = await parse(request, max_bytes=state.settings.max_body_bytes)
    header = request.headers.get(CONVERSATION_HEADER)
    external_id = identity.validate_conversation_id(header) if header is not None else None

    async with transaction(state.engine) as conn:
        stored = await store.ingest(
            conn,
            tenant_id=tenant_id,
            external_id=external_id,
            user=chat.user,
            messages=body["messages"],
            model=chat.model,
        )
        await hierarchy.enqueue(conn, tenant_id=tenant_id, conversation_id=stored.conversation.id)
    turn = Turn(
        tenant_id=tenant_id,
        conversation_id=stored.conversation.id,
        external_id=stored.conversation.external_id,
        model=chat.model,
        started=started,
    )

    upstream = state.upstream
    turn.overhead = time.perf_counter() - started
    try:
        response = await upstream.open(
            "POST",
            "/chat/completions",
            headers=upstream.headers_for(request.headers),
            json=body,
            stream=bool(chat.stream),
        )
    except GatewayError as exc:
        exc.headers.update(turn.headers())
        raise
    if chat.stream and response.is_success:
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
        recorded = time.perf_counter()
        await _record(state, turn, from_completion(_json(content)), complete=True)
        turn.overhead += time.perf_counter() - recorded
    return Response(
        content,
        status_code=response.status_code,
        headers={**relayed_headers(response), **turn.headers()},
    )


async def _relay(response: httpx.Response, state: State, turn: Turn) -> AsyncIterator[bytes]:
    """Pass the upstream stream on as it comes; store what arrived when it ends."""
    reply = StreamedReply()
    try:
        async for chunk in response.aiter_bytes():
            reply.feed(chunk)
            yield chunk
    except httpx.HTTPError as exc:
        log.warning(
            "upstream stream interrupted: %s",
            type(exc).__name__,
            extra={"conversation": turn.external_id},
        )
        error = error_body(
            f"the upstream stream was interrupted ({type(exc).__name__}); "
            "the partial reply was kept",
            type="upstream_error",
            code="upstream_stream_interrupted",
        )
        yield f"data: {json.dumps(error)}\n\n".encode()
    finally:
        await response.aclose()
        # The client may be gone (cancelled scope): storing the reply must still happen.
        with anyio.CancelScope(shield=True):
            await _record(state, turn, reply.message(), complete=reply.complete)


async def _record(
    state: State, turn: Turn, reply: Mapping[str, Any] | None, *, complete: bool
) -> None:
    if reply is None:
        return
    try:
        async with transaction(state.engine) as conn:
            await store.append(
                conn,
                tenant_id=turn.tenant_id,
                conversation_id=turn.conversation_id,
                messages=[reply],
                model=turn.model,
                status="complete" if complete else "incomplete",
            )
            await hierarchy.enqueue(
                conn, tenant_id=turn.tenant_id, conversation_id=turn.conversation_id
            )
    except MemstrataError:
        # The client already has its answer; losing the stored copy is logged loudly.
        log.exception("could not store the reply", extra={"conversation": turn.external_id})


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None
