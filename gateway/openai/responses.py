"""The Responses API with memory: `POST /v1/responses` (what it stored is read back and deleted
by `gateway.openai.response_objects`).

A response request goes the chat path's way (`gateway.openai.chat`): its `instructions` and
`input` are read as chat messages (`gateway.openai.translate`), then identified and stored
(`chat.store_turn`) and the prompt assembled in the same transaction, the query's embedding
started once the conversation is identified, then forwarded, and the reply recorded by the
turn. The conversation is the one `previous_response_id` names (404 if it names none of this
tenant's), else the one `X-Memstrata-Conversation` names, else the one whose stored chain the
messages extend: a client that resends the whole input each time (openai-agents does) is
recognised as a chat client is. `conversation` (the Conversations API's field: an id, or an
object with its `id`) names the conversation as the header does, and is not sent upstream,
which gets the history from the gateway (it would prepend its own copy), and the response
carries it as OpenAI's does (`gateway.openai.response_turn`); with `store: false`
the request goes upstream as sent. `background: true` runs in the foreground (the reply must
be recorded): the answer is the finished response, which polling reads back. Continuing a
response that is no longer its conversation's latest sends its own history (even from a branch
the conversation left since) and the new input whole, so the write path continues the
conversation from that point, as a branch if it must; continuing the latest one, its input is
new, whatever it repeats. A retry is told as on the chat path (`Idempotency-Key`,
`X-Stainless-Retry-Count`, the same body) and stores nothing.
`store: false` stores nothing: the request reads memory (the history of `previous_response_id`, if
named: its own branch's, when that fits the budget) and goes upstream, and the response cannot
be retrieved or continued later. With the database down and `MEMSTRATA_FAIL_OPEN=on`, a request
that names no `previous_response_id` goes upstream as the client sent it, unrecorded, its answer
marked `X-Memstrata-Degraded` as on the chat path.

The memory tools are offered as on the chat path (`gateway.openai.toolloop.offer`): the budget
keeps room for their definitions, and the working context holds the hints to them. A stored
conversation's request carries its `prompt_cache_key` when the client sent none and the
settings send one (`chat.cache_key`). The way upstream and back, forwarded as Responses or
translated to chat completions, is `gateway.openai.response_upstream`; what the turn records
(the response object as the client saw it, the request's input items and the upstream's usage)
is `gateway.openai.response_turn`.
"""

import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.bodies import read_json
from gateway.errors import GatewayError
from gateway.openai import chat, response_upstream, tenancy, toolloop, translate
from gateway.openai.response_turn import ResponseTurn
from gateway.openai.turn import CONVERSATION_HEADER
from gateway.schemas import ResponsesRequest
from gateway.state import State
from memory import stages, tokens
from memory.db import transaction
from memory.errors import InvalidConversationId, StorageUnavailable
from memory.recall.assemble import (
    Assembled,
    Budget,
    StoredTurn,
    assemble,
    leading_system,
    query_guess,
)
from memory.recall.early import Early
from memory.write import identity, retries
from memory.write import responses as stored_responses

log = logging.getLogger(__name__)


# What an upstream answers for a path it does not serve (the Responses API, or one response).
async def create(request: Request, state: State, *, tenant_id: int) -> Response:
    """Handle `POST /v1/responses`."""
    started = time.perf_counter()
    body = await read_json(request, max_bytes=state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
    try:
        parsed = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(), body=body) from exc
    # An earlier reply named by its id goes on as the stored item: the upstream need not keep
    # responses (a stateless one, or another account than the one that made it).
    body = translate.dereferenced(body, await _referenced(state, tenant_id, body))
    messages = translate.input_messages(body)
    background = body.get("background") is True
    if background:
        # Run in the foreground: the reply is recorded as it comes, and the answer is the
        # finished response, which a client polling for it then reads back as stored.
        body = {key: value for key, value in body.items() if key != "background"}
    if state.upstream.serves_responses is None and not translate.translatable(body):
        # Whether it can go upstream must be known before it is stored.
        await response_upstream.probe(state, request.headers)
    if state.upstream.serves_responses is False:
        # It can only go upstream translated: what cannot be is refused before it is stored.
        translate.check_translatable(body)
    header = request.headers.get(CONVERSATION_HEADER)
    external_id = identity.validate_conversation_id(header) if header is not None else None
    named = _named_conversation(body, header=external_id)
    if named is not None and parsed.store is False:
        named = None  # it goes upstream as sent
    if named is not None:
        # The gateway's conversation of that id (each tenant's own): the upstream, which gets
        # the history from the gateway, must not add its own, and need not hold one.
        external_id = named
        body = {key: value for key, value in body.items() if key != "conversation"}
    await tenancy.check_references(state, tenant_id=tenant_id, body=body)
    budget = Budget.of(
        {"model": parsed.model, "tools": body.get("tools"), "max_tokens": parsed_max(body)},
        chat.budget_rules(state.settings),
        requested=chat.parse_budget(request.headers.get(chat.BUDGET_HEADER)),
        # Room kept for the memory tools' definitions, when the gateway offers them.
        tools_room=toolloop.reserved_tokens(state.settings, body),
    )
    turn = ResponseTurn(
        tenant_id=tenant_id,
        conversation_id=0,
        external_id=external_id or "",
        model=parsed.model,
        started=started,
        store=parsed.store is not False,
        input_items=translate.stored_items(body),
        background=background,
        memory_tools=budget.tools_room > 0,
        conversation=named,
    )
    previous = parsed.previous_response_id
    # What tells a retry of this request from a new one, as on the chat path: the SDKs retry
    # a response request too, and a client naming its conversation sends only its new input.
    request_key = retries.RequestKey.of(
        body=body,
        idempotency_key=request.headers.get(chat.IDEMPOTENCY_HEADER),
        retry_count=request.headers.get(chat.RETRY_COUNT_HEADER),
    )
    assembled: Assembled | None = None
    with stages.recording() as timings:
        try:
            if turn.store:
                assembled = await _store(
                    state,
                    turn,
                    messages,
                    budget,
                    previous=previous,
                    user=parsed.user,
                    request=request_key,
                )
            elif previous is not None:
                with stages.stage("store"):
                    unstored = await _unstored(state, turn, messages, budget, previous=previous)
                with stages.stage("assemble"):
                    assembled = await chat.recall_unstored(
                        state, unstored, budget, tools_guide=budget.tools_room > 0
                    )
        except StorageUnavailable:
            if state.settings.fail_open != "on" or previous is not None:
                raise
            log.warning("database unavailable, forwarding a response request without memory")
            state.metrics.degraded.inc()
            turn.store, turn.degraded, assembled = False, True, None
    chat.report_stages(state, timings)
    if assembled is not None:
        # Only a stored turn saved the compaction it was assembled with.
        turn.sent(assembled, state.metrics if turn.store else None)
    else:
        turn.overhead = time.perf_counter() - started
    prompt = messages if assembled is None else assembled.messages
    if state.settings.sends_cache_key and turn.conversation_id and "prompt_cache_key" not in body:
        body = {**body, "prompt_cache_key": chat.cache_key(turn)}
    forwarder = response_upstream.Forward(
        state, turn, request=request, body=body, stream=bool(parsed.stream)
    )
    return await forwarder.send(prompt, as_sent=prompt is messages)


async def _referenced(
    state: State, tenant_id: int, body: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """The stored output items the request's `item_reference`s name (the Vercel AI SDK sends
    an earlier reply so), by id."""
    item_ids = translate.references(body)
    if not item_ids:
        return {}
    async with transaction(state.engine) as conn:
        return await stored_responses.output_items(conn, tenant_id=tenant_id, item_ids=item_ids)


def _named_conversation(body: Mapping[str, Any], *, header: str | None) -> str | None:
    """The conversation `conversation` names (the Conversations API: an id, or an object with
    its `id`), checked: for a stored request, the gateway's conversation of that id, as
    `X-Memstrata-Conversation` names one; None when the body names none."""
    named = body.get("conversation")
    if named is None:
        return None
    if isinstance(named, dict):
        named = named.get("id")
    if not isinstance(named, str):
        raise GatewayError(
            400,
            "conversation must be a conversation id or an object with its id",
            param="conversation",
            code="invalid_type",
        )
    if body.get("previous_response_id") is not None:
        raise GatewayError(
            400,
            "previous_response_id and conversation cannot be used together",
            param="conversation",
            code="invalid_value",
        )
    try:
        external_id = identity.validate_conversation_id(named)
    except InvalidConversationId as exc:
        raise GatewayError(400, str(exc), param="conversation", code="invalid_value") from exc
    if header is not None and header != external_id:
        raise GatewayError(
            400,
            f"conversation {external_id!r} is not the one {CONVERSATION_HEADER} names",
            param="conversation",
            code="invalid_value",
        )
    return external_id


def parsed_max(body: Mapping[str, Any]) -> int | None:
    value = body.get("max_output_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _store(
    state: State,
    turn: ResponseTurn,
    messages: list[dict[str, Any]],
    budget: Budget,
    *,
    previous: str | None,
    user: str | None,
    request: retries.RequestKey,
) -> Assembled:
    """Identify and store the request's messages (see the module docstring; a retry of
    `request` stores nothing), then assemble its prompt in the same transaction, as the chat
    path does: the query's embedding starts once the conversation is identified, while the
    turn is stored (`memory.recall.early`)."""
    early = Early(state.embedder)
    recall = chat.recall_of(state, embedder=early)
    named = turn.external_id or None
    if named is not None and state.past_budget.holds(turn.tenant_id, named):
        # Past its budget last time: a guess of the query starts embedding now.
        early.start(query_guess(messages, recall=recall))
    try:
        async with transaction(state.engine) as conn:
            with stages.stage("store"):
                # Continuing the latest response, its input is new whatever it repeats.
                new_only = False
                if previous is not None:
                    found = await _previous(conn, turn, previous, lock=True)
                    new_only = found.at_head
                    if not found.at_head:
                        history = await stored_responses.history(
                            conn, tenant_id=turn.tenant_id, found=found
                        )
                        system = leading_system(history)
                        messages = [
                            *history,
                            *messages[len(leading_system(messages)) if system else 0 :],
                        ]
                stored, appended = await chat.store_turn(
                    conn,
                    tenant_id=turn.tenant_id,
                    external_id=turn.external_id or None,
                    user=user,
                    messages=messages,
                    model=turn.model,
                    budget=budget,
                    request=request,
                    window=timedelta(seconds=state.settings.idempotency_window_seconds),
                    identified=functools.partial(
                        chat.start_query,
                        early,
                        messages=messages,
                        budget=budget,
                        recall=recall,
                        model=turn.model,
                    ),
                    new_only=new_only,
                )
            turn.conversation_id = stored.conversation_id
            turn.external_id = appended.conversation.external_id
            turn.reply_to = appended.reply_to
            turn.stored_from = appended.first_seq if appended.node_ids else None
            if named is not None:
                past = (stored.stored_tokens or 0) > budget.limit
                state.past_budget.saw(turn.tenant_id, named, past=past)
            with stages.stage("assemble"):
                return await assemble(
                    conn, stored, budget, recall, tools_guide=budget.tools_room > 0
                )
    finally:
        early.close()


async def _unstored(
    state: State,
    turn: ResponseTurn,
    messages: list[dict[str, Any]],
    budget: Budget,
    *,
    previous: str,
) -> StoredTurn:
    """`store: false` continuing a response: its history read, nothing written. A response
    the conversation has left (it forked from an earlier one since) is continued with its own
    history, when that fits the budget; past it, memory is the conversation's as it is now."""
    async with transaction(state.engine) as conn:
        found = await _previous(conn, turn, previous, lock=False)
        history = None
        if not found.at_head:
            history = await stored_responses.history(conn, tenant_id=turn.tenant_id, found=found)
    system = leading_system(messages)
    new = messages[len(system) :]
    turn.conversation_id = found.conversation_id
    unstored = StoredTurn(
        tenant_id=turn.tenant_id,
        conversation_id=found.conversation_id,
        model=turn.model,
        system=system,
        new_messages=new,
        first_seq=found.last_seq + 1,
        whole=None,
        unstored_tokens=tokens.count_messages(new, model=turn.model),
    )
    if history is None:
        return unstored
    kept = leading_system(history)
    whole = [*(system or kept), *history[len(kept) :], *new]
    counted = tokens.count_messages(whole, model=turn.model)
    if counted + tokens.REPLY_PRIMING_TOKENS > budget.limit:
        return unstored
    # Sent whole, as a history that fits is: none of it is what the conversation holds now.
    return replace(unstored, whole=whole, stored_tokens=0, unstored_tokens=counted)


async def _previous(
    conn: AsyncConnection, turn: ResponseTurn, response_id: str, *, lock: bool
) -> stored_responses.ResponseRecord:
    """The response `previous_response_id` names, which sets the turn's conversation."""
    found = await stored_responses.find(
        conn, tenant_id=turn.tenant_id, response_id=response_id, lock=lock
    )
    if turn.external_id and turn.external_id != found.external_id:
        raise GatewayError(
            400,
            f"previous_response_id {response_id!r} belongs to another conversation than "
            f"{CONVERSATION_HEADER} names",
            param="previous_response_id",
            code="invalid_value",
        )
    turn.external_id = found.external_id
    return found
