"""One chat completion: identify → store → assemble → forward → record → enqueue.

The client's messages are stored in one transaction before anything goes upstream, so an
upstream failure never loses them; the write path queues the conversation's build in the same
transaction (`memory.write.store`). Identifying the conversation also says where the request's
new messages start, whether its history branches off the stored one, and whether it repeats
an earlier request (`memory.write.identity`): a retry stores nothing, still goes upstream, and
its reply takes the place of the first one's if that differs and is still the head, or was
never recorded (`memory.write.replies`). A turn whose system
prompt and new messages alone exceed the budget is refused (400 `context_length_exceeded`)
inside that transaction, so it stores nothing. The query the read path will embed for the
turn's recall starts embedding as soon as the conversation is identified, while the turn is
stored, or as the request arrives for a named conversation this process last found past its
budget (a guess, replaced if identifying finds another: `memory.recall.early`); a refused turn
cancels it. The prompt is assembled by the read path (`memory.recall.assemble`) in that same
transaction, under the conversation's row lock, so that the working context it advances is
advanced by one request at a time whichever process serves it. It is then forwarded
(`upstream_body`: a conversation-scoped `prompt_cache_key`, and, for a stream, a request for
the usage, which the relay hides from a client that did not ask for it) and relayed
(`gateway.openai.relay`), which records the reply, and queues its build, when it is complete.
When the database is down during the store or assembly step, nothing is stored and the request
is forwarded unchanged or refused with 503, as `gateway.openai.degraded` decides.
"""

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway import background
from gateway.bodies import read_json
from gateway.errors import GatewayError
from gateway.openai import degraded, relay, tenancy, toolloop
from gateway.openai.turn import CONVERSATION_HEADER, Turn
from gateway.schemas import ChatCompletionRequest, storable_context
from gateway.settings import Settings
from gateway.state import State
from memory import stages, tokens
from memory.db import transaction
from memory.embeddings import Embedder
from memory.errors import StorageUnavailable
from memory.recall.assemble import (
    Assembled,
    Budget,
    BudgetRules,
    Recall,
    StoredTurn,
    assemble,
    check_fits,
    query_ahead,
    query_guess,
)
from memory.recall.assemble import dry_run as memory_dry_run
from memory.recall.early import Early
from memory.write import identity, placement, retries, store

log = logging.getLogger(__name__)

BUDGET_HEADER = "X-Memstrata-Budget"
IDEMPOTENCY_HEADER = "Idempotency-Key"
# The OpenAI SDKs number each attempt of a request; above 0 it is a retry.
RETRY_COUNT_HEADER = "X-Stainless-Retry-Count"


async def complete(request: Request, state: State, *, tenant_id: int) -> Response:
    """Handle `POST /v1/chat/completions`."""
    started = time.perf_counter()
    body, chat = await parse(request, state.settings)
    await tenancy.check_references(state, tenant_id=tenant_id, body=body)
    header = request.headers.get(CONVERSATION_HEADER)
    external_id = identity.validate_conversation_id(header) if header is not None else None
    # Room kept for the memory tools' definitions, when the gateway offers them.
    budget = Budget.of(
        body,
        budget_rules(state.settings),
        requested=parse_budget(request.headers.get(BUDGET_HEADER)),
        tools_room=toolloop.reserved_tokens(state.settings, body),
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
    # What tells a retry of this request from a new one (`retries.RequestKey`).
    request_key = retries.RequestKey.of(
        body=body,
        idempotency_key=request.headers.get(IDEMPOTENCY_HEADER),
        retry_count=request.headers.get(RETRY_COUNT_HEADER),
    )
    # The query's embedding starts once the conversation is identified, while the turn is
    # stored and its working context read (`memory.recall.early`); for a named conversation
    # past its budget last time, a guess of it starts now.
    early = Early(state.embedder)
    recall = recall_of(state, embedder=early)
    if external_id is not None and state.past_budget.holds(tenant_id, external_id):
        early.start(query_guess(body["messages"], recall=recall))
    with stages.recording() as timings:
        try:
            async with transaction(state.engine) as conn:
                with stages.stage("store"):
                    stored, appended = await store_turn(
                        conn,
                        tenant_id=tenant_id,
                        external_id=external_id,
                        user=chat.user,
                        messages=body["messages"],
                        model=model,
                        budget=budget,
                        request=request_key,
                        window=timedelta(seconds=state.settings.idempotency_window_seconds),
                        identified=functools.partial(
                            start_query,
                            early,
                            messages=body["messages"],
                            budget=budget,
                            recall=recall,
                            model=model,
                        ),
                    )
                if external_id is not None:
                    past = (stored.stored_tokens or 0) > budget.limit
                    state.past_budget.saw(tenant_id, external_id, past=past)
                with stages.stage("assemble"):
                    assembled = await assemble(
                        conn, stored, budget, recall, tools_guide=budget.tools_room > 0
                    )
        except StorageUnavailable as exc:
            return await unchanged(exc, external_id=external_id)
        finally:
            early.close()
    turn = Turn(
        tenant_id=tenant_id,
        conversation_id=stored.conversation_id,
        external_id=appended.conversation.external_id,
        model=chat.model,
        started=started,
        reply_to=appended.reply_to,
        stored_from=appended.first_seq if appended.node_ids else None,
        memory_tools=budget.tools_room > 0,
    )
    turn.sent(assembled, state.metrics)
    report_stages(state, timings)
    stream = bool(chat.stream)
    return await relay.forward(
        state,
        turn,
        client_headers=request.headers,
        query=request.url.query,
        body=upstream_body(state.settings, turn, body, assembled, stream=stream),
        stream=stream,
    )


def upstream_body(
    settings: Settings, turn: Turn, body: dict[str, Any], assembled: Assembled, *, stream: bool
) -> dict[str, Any]:
    """What goes upstream: the client's body with the assembled messages; a conversation-scoped
    `prompt_cache_key` when the settings send one and the client sent none; for a stream, a
    request for its usage (the relay hides it from a client that did not ask: `turn`)."""
    prompt = dict(body)
    if assembled.messages is not body["messages"]:
        prompt["messages"] = assembled.messages
    if settings.sends_cache_key and "prompt_cache_key" not in body:
        prompt["prompt_cache_key"] = cache_key(turn)
    if stream and settings.stream_usage == "on":
        options = body.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        if not options.get("include_usage"):
            options["include_usage"] = True
            prompt["stream_options"] = options
            turn.hide_usage = True
    return prompt


def cache_key(turn: Turn) -> str:
    """The `prompt_cache_key` of the turn's conversation: one for all its requests, from any
    process, and nothing a provider could read the tenant or conversation from."""
    scope = f"{turn.tenant_id}:{turn.conversation_id}".encode()
    return "memstrata-" + hashlib.sha256(scope).hexdigest()[:32]


def report_stages(state: State, timings: stages.Record) -> None:
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
    request: retries.RequestKey | None = None,
    window: timedelta = retries.DEFAULT_WINDOW,
    identified: Callable[[placement.Found], None] | None = None,
    new_only: bool = False,
) -> tuple[StoredTurn, store.Appended]:
    """Identify and store: the request's new `messages` stored in `conn`'s transaction (none
    for a retry of `request` within `window`), and what was stored. A turn that cannot fit
    `budget` is refused here, inside the transaction, so that it stores nothing. `identified`
    is told what identifying found, before anything is stored. `new_only`: the client says
    `messages` follow the head of the conversation `external_id` (`identity.identify`)."""
    found = await identity.identify(
        conn,
        tenant_id=tenant_id,
        external_id=external_id,
        user=user,
        messages=messages,
        request=request,
        window=window,
        new_only=new_only,
    )
    if identified is not None:
        identified(found)
    appended = await store.store_new(
        conn,
        tenant_id=tenant_id,
        found=found,
        messages=messages,
        model=model,
        request_key=request.value if request is not None else None,
    )
    stored = StoredTurn.of(messages, appended, tenant_id=tenant_id, model=model)
    check_fits(stored, budget)
    return stored, appended


def start_query(
    early: Early,
    found: placement.Found,
    *,
    messages: list[dict[str, Any]],
    budget: Budget,
    recall: Recall,
    model: str,
) -> None:
    """Start embedding the query the read path will ask for, if any (`query_ahead`), once
    identifying the conversation (`found`) says where the request's new `messages` start."""
    early.start(
        query_ahead(
            messages,
            new_from=len(messages) if found.retry else found.start,
            stored_tokens=int(found.row.token_count),
            budget=budget,
            recall=recall,
            model=model,
        )
    )


async def recall_unstored(
    state: State, turn: StoredTurn, budget: Budget, *, tools_guide: bool
) -> Assembled:
    """Assemble, in a transaction of its own, the prompt of a turn that stores nothing (the
    Responses API's `store: false`): the working context is read, never advanced."""
    async with transaction(state.engine) as conn:
        return await assemble(
            conn, turn, budget, recall_of(state), tools_guide=tools_guide, persist=False
        )


async def parse(
    request: Request, settings: Settings
) -> tuple[dict[str, Any], ChatCompletionRequest]:
    """The raw body (forwarded as is) and its validated view, both made off the event loop
    when the body is large (`gateway.bodies`)."""

    def validate(body: Any, unsafe: bool) -> tuple[dict[str, Any], ChatCompletionRequest]:
        if not isinstance(body, dict):
            raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > settings.max_messages:
            raise _too_many(settings.max_messages, str(len(messages)))
        try:
            chat = ChatCompletionRequest.model_validate(body, context=storable_context(unsafe))
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(), body=body) from exc
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
) -> Assembled:
    """The prompt `complete` would send upstream if the stored conversation `external_id`
    received `query` as a new user message, with what each message is; nothing is stored."""
    return await memory_dry_run(
        state.engine,
        tenant_id=tenant_id,
        external_id=external_id,
        query=query,
        budget=budget,
        rules=budget_rules(state.settings),
        tools_room=toolloop.reserved_tokens(state.settings, {"model": model}),
        recall=recall_of(state),
        model=model,
    )


def recall_of(state: State, *, embedder: Embedder | None = None) -> Recall:
    """How the read path recalls under the settings (with `embedder` for the query, when not
    the state's own)."""
    settings = state.settings
    return Recall(
        embedder=embedder or state.embedder,
        cross_conversation=settings.cross_conversation == "on",
        policy=background.policy(settings),
        mode=settings.context_mode,
        abandoned_branches=settings.recall_abandoned_branches == "on",
    )


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
