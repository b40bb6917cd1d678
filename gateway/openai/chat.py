"""One chat completion: identify → store → assemble → forward → record → enqueue.

The client's messages are stored in one transaction before anything goes upstream, so an
upstream failure never loses them; the write path queues the conversation's build in the same
transaction (`memory.write.store`). A turn whose system prompt and new messages alone exceed
the budget is refused (400 `context_length_exceeded`) inside that transaction, so it stores
nothing. The prompt is then assembled by the read path (`memory.recall.assemble`), forwarded
and relayed (`gateway.openai.relay`), which records the reply, and queues its build, when it is
complete. When the database is down during the store or assembly step, the request is forwarded
unchanged or refused with 503, as `gateway.openai.degraded` decides.
"""

import functools
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.bodies import read_json
from gateway.errors import GatewayError
from gateway.openai import degraded, relay, toolloop
from gateway.openai.turn import CONVERSATION_HEADER, Turn
from gateway.schemas import ChatCompletionRequest
from gateway.settings import Settings
from gateway.state import State
from memory import stages, tokens
from memory.db import transaction
from memory.errors import StorageUnavailable
from memory.recall.assemble import (
    Assembled,
    Budget,
    BudgetRules,
    StoredTurn,
    assemble,
    check_fits,
)
from memory.recall.assemble import dry_run as memory_dry_run
from memory.write import identity, store

log = logging.getLogger(__name__)

BUDGET_HEADER = "X-Memstrata-Budget"


async def complete(request: Request, state: State, *, tenant_id: int) -> Response:
    """Handle `POST /v1/chat/completions`."""
    started = time.perf_counter()
    body, chat = await parse(request, state.settings)
    header = request.headers.get(CONVERSATION_HEADER)
    external_id = identity.validate_conversation_id(header) if header is not None else None
    # Room kept for the memory tools' definitions, when the gateway offers them.
    tools_room = toolloop.reserved_tokens(state.settings, body)
    budget = Budget.of(
        body,
        budget_rules(state.settings),
        requested=parse_budget(request.headers.get(BUDGET_HEADER)),
        tools_room=tools_room,
    )
    model = str(body.get("model", ""))
    # With the database down: forwarded unchanged (fail-open) or 503 (`degraded`).
    unchanged = functools.partial(
        degraded.forward,
        state,
        client_headers=request.headers,
        query=request.url.query,
        body=body,
        tenant_id=tenant_id,
        model=chat.model,
        stream=bool(chat.stream),
        started=started,
    )
    with stages.recording() as timings:
        try:
            with stages.stage("store"):
                async with transaction(state.engine) as conn:
                    stored, stored_id = await store_turn(
                        conn,
                        tenant_id=tenant_id,
                        external_id=external_id,
                        user=chat.user,
                        messages=body["messages"],
                        model=model,
                        budget=budget,
                    )
        except StorageUnavailable as exc:
            return await unchanged(exc, external_id=external_id)
        turn = Turn(
            tenant_id=tenant_id,
            conversation_id=stored.conversation_id,
            external_id=stored_id,
            model=chat.model,
            started=started,
        )
        try:
            with stages.stage("assemble"):
                assembled = await recall(state, stored, budget, tools_guide=tools_room > 0)
        except StorageUnavailable as exc:
            return await unchanged(exc, external_id=turn.external_id, stored=turn)
    turn.sent(assembled)
    _report(state, timings)
    messages = assembled.messages
    return await relay.forward(
        state,
        turn,
        client_headers=request.headers,
        query=request.url.query,
        body=body if messages is body["messages"] else {**body, "messages": messages},
        stream=bool(chat.stream),
    )


def _report(state: State, timings: stages.Record) -> None:
    """The request path's stages, to `/metrics` and, at DEBUG, to the log."""
    state.metrics.observe_stages(timings)
    if log.isEnabledFor(logging.DEBUG):
        spent = {name: round(seconds * 1000, 2) for name, seconds in timings.items()}
        log.debug("request stages", extra={"stages_ms": spent})


async def store_turn(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    external_id: str | None,
    user: str | None,
    messages: list[dict[str, Any]],
    model: str,
    budget: Budget,
) -> tuple[StoredTurn, str]:
    """Identify and store: the request's new `messages` stored in `conn`'s transaction, and
    the id of the conversation they went to. A turn that cannot fit `budget` is refused here,
    inside the transaction, so that it stores nothing."""
    found = await identity.identify(
        conn, tenant_id=tenant_id, external_id=external_id, user=user, messages=messages
    )
    appended = await store.store_new(
        conn, tenant_id=tenant_id, found=found, messages=messages, model=model
    )
    stored = StoredTurn.of(messages, appended, tenant_id=tenant_id, model=model)
    check_fits(stored, budget)
    return stored, appended.conversation.external_id


async def recall(
    state: State, stored: StoredTurn, budget: Budget, *, tools_guide: bool
) -> Assembled:
    """Assemble: the prompt for a stored turn, within its budget (`memory.recall.assemble`)."""
    return await assemble(
        state.engine,
        stored,
        budget,
        embedder=state.embedder,
        cross_conversation=state.settings.cross_conversation == "on",
        tools_guide=tools_guide,
    )


async def parse(
    request: Request, settings: Settings
) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """The raw body (forwarded as is) and its validated view, both made off the event loop
    when the body is large (`gateway.bodies`)."""

    def validate(body: Any) -> tuple[dict[str, Any], ChatCompletionRequest]:
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > settings.max_messages:
            raise _too_many(settings.max_messages, str(len(messages)))
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc
        # Counted here, off the event loop for a large body; found counted when stored.
        tokens.precount(body["messages"], model=chat.model)
        return body, chat

    def few_enough(raw: bytes) -> None:
        # Parsing 100,000 messages holds the GIL for a third of a second even in a thread:
        # counted in the raw bytes first (with room for "role" quoted inside contents).
        if raw.count(b'"role"') > 2 * settings.max_messages:
            raise _too_many(settings.max_messages, "more than twice")

    parsed: tuple[dict[str, Any], ChatCompletionRequest] = await read_json(
        request, max_bytes=settings.max_body_bytes, then=validate, before=few_enough
    )
    return parsed


async def dry_run(
    state: State,
    *,
    tenant_id: int,
    external_id: str,
    query: str,
    budget: int | None,
    model: str = "gpt-4o",
) -> tuple[list[dict[str, Any]], int]:
    """The messages, and their tokens, that `complete` would send upstream if the stored
    conversation `external_id` received `query` as a new user message; nothing is stored."""
    assembled = await memory_dry_run(
        state.engine,
        tenant_id=tenant_id,
        external_id=external_id,
        query=query,
        budget=budget,
        rules=budget_rules(state.settings),
        tools_room=toolloop.reserved_tokens(state.settings, {"model": model}),
        embedder=state.embedder,
        cross_conversation=state.settings.cross_conversation == "on",
        model=model,
    )
    return assembled.messages, assembled.tokens


def _too_many(limit: int, count: str) -> GatewayError:
    return GatewayError(
        413,
        f"the body holds {count} messages, more than {limit} (MEMSTRATA_MAX_MESSAGES); send "
        "only the new messages, with X-Memstrata-Conversation",
        param="messages",
        code="too_many_messages",
    )


def budget_rules(settings: Settings) -> BudgetRules:
    """The budget settings, as the read path takes them."""
    return BudgetRules(
        default=settings.context_budget,
        window=settings.context_window,
        output_reserve=settings.output_reserve,
    )


def parse_budget(value: str | None) -> int | None:
    """The budget a request asks for with `X-Memstrata-Budget`, or None."""
    if value is None:
        return None
    value = value.strip()
    # ASCII digits only: `isdigit` also accepts "²", which `int` refuses.
    if (
        not (value.isascii() and value.isdigit())
        or len(value) > 8
        or not 1 <= int(value) <= 10_000_000
    ):
        raise GatewayError(
            400,
            f"{BUDGET_HEADER} must be a whole number of tokens from 1 to 10000000",
            param=BUDGET_HEADER,
            code="invalid_value",
        )
    return int(value)
