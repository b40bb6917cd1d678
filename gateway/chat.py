"""One chat completion: identify → store → assemble → forward → record → enqueue.

The client's messages are stored (and their background processing queued) in one transaction
before anything goes upstream, so an upstream failure never loses them. The prompt is then
assembled from memory, forwarded and relayed (`gateway.relay`); the reply is recorded by the
`Turn` when it is complete.
"""

import logging
import time
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from gateway import relay
from gateway.deps import State, read_json
from gateway.errors import GatewayError
from gateway.schemas import ChatCompletionRequest
from gateway.turn import CONVERSATION_HEADER, Turn
from memory import hierarchy, identity, store
from memory.db import transaction

log = logging.getLogger(__name__)


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
    prompt = await assemble(state, turn, body)
    turn.overhead = time.perf_counter() - started
    return await relay.forward(
        state, turn, client_headers=request.headers, body=prompt, stream=bool(chat.stream)
    )


async def assemble(state: State, turn: Turn, body: dict[str, Any]) -> dict[str, Any]:
    """The request to send upstream: for now the client's own, unchanged."""
    return body
