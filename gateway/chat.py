"""One chat completion: identify → store → assemble → forward → record → enqueue.

The client's messages are stored (and their background processing queued) in one transaction
before anything goes upstream, so an upstream failure never loses them; a turn whose system
prompt and new messages alone exceed the budget is refused (400) inside that transaction, so it
stores nothing. The prompt is then assembled from memory, forwarded and relayed
(`gateway.relay`); the reply is recorded by the `Turn` when it is complete. When the database
is down during the store or assembly step, the request is forwarded unchanged or refused with
503, as `gateway.degraded` decides.
"""

import functools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway import degraded, relay, toolloop
from gateway.deps import State, read_json
from gateway.errors import GatewayError
from gateway.schemas import ChatCompletionRequest
from gateway.turn import CONVERSATION_HEADER, Turn
from memory import tokens
from memory.build import tree
from memory.db import transaction
from memory.errors import ProviderError, StorageUnavailable
from memory.recall import prompt
from memory.schema import conversations, nodes
from memory.write import identity, store

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
    budget = parse_budget(request.headers.get(BUDGET_HEADER))
    # With the database down: forwarded unchanged (fail-open) or 503 (`gateway.degraded`).
    unchanged = functools.partial(
        degraded.forward,
        state,
        client_headers=request.headers,
        body=body,
        tenant_id=tenant_id,
        model=chat.model,
        stream=bool(chat.stream),
        started=started,
    )

    # Room kept for the memory tools' definitions, when the gateway offers them.
    tools_room = toolloop.reserved_tokens(state.settings, body)
    try:
        async with transaction(state.engine) as conn:
            stored = await store.ingest(
                conn,
                tenant_id=tenant_id,
                external_id=external_id,
                user=chat.user,
                messages=body["messages"],
                model=chat.model,
            )
            # Refused inside the transaction, so that an oversized turn stores nothing.
            part = _split(body["messages"], stored)
            _check_fits(state, body, part, budget=budget, tools_room=tools_room)
            await tree.enqueue(conn, tenant_id=tenant_id, conversation_id=stored.conversation.id)
    except StorageUnavailable as exc:
        return await unchanged(exc, external_id=external_id)
    turn = Turn(
        tenant_id=tenant_id,
        conversation_id=stored.conversation.id,
        external_id=stored.conversation.external_id,
        model=chat.model,
        started=started,
    )
    try:
        prompt = await assemble(
            state,
            turn,
            body,
            appended=stored,
            part=part,
            budget=budget,
            reserved_tokens=tools_room,
        )
    except StorageUnavailable as exc:
        return await unchanged(exc, external_id=turn.external_id)
    turn.overhead = time.perf_counter() - started
    return await relay.forward(
        state, turn, client_headers=request.headers, body=prompt, stream=bool(chat.stream)
    )


BUDGET_HEADER = "X-Memstrata-Budget"
_SYSTEM_ROLES = ("system", "developer")
_QUERY_CHARS = 2000
_RELATED_LIMIT = 20
_SYSTEM_LOOKAHEAD = 4


def parse_budget(value: str | None) -> int | None:
    """The budget a request asks for with `X-Memstrata-Budget`, or None."""
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or not 1 <= int(value) <= 10_000_000:
        raise GatewayError(
            400,
            f"{BUDGET_HEADER} must be a whole number of tokens from 1 to 10000000",
            param=BUDGET_HEADER,
            code="invalid_value",
        )
    return int(value)


async def assemble(
    state: State,
    turn: Turn,
    body: dict[str, Any],
    *,
    appended: store.Appended,
    part: "_TurnPart",
    budget: int | None = None,
    reserved_tokens: int = 0,
) -> dict[str, Any]:
    """The request to send upstream (SPEC §6).

    A conversation that fits the budget goes as the client sent it (or, when the client sent
    only its new messages, as stored); otherwise the prompt is rebuilt from memory by
    `memory.recall.prompt.build`. Sets the turn's token counts and `rebuilt`. `reserved_tokens` is
    room kept for tool schemas the gateway adds (the memory tools); `part` is how the body's
    messages divide given what was `appended`."""
    messages: list[dict[str, Any]] = body["messages"]
    prompt, tokens_sent, full, rebuilt = await _prompt(
        state,
        tenant_id=turn.tenant_id,
        conversation_id=turn.conversation_id,
        model=str(body.get("model", "")),
        request_system=part.system,
        new_messages=part.new_messages,
        new_from=part.first_seq,
        whole=messages if part.whole else None,
        stored=(appended.token_count, appended.user_id),
        budget=budget,
        reserved_tokens=reserved_tokens + _tools_cost(body),
        max_output=_max_output(body),
        tools_guide=reserved_tokens > 0,
    )
    turn.full_tokens = full
    turn.context_tokens = tokens_sent
    turn.rebuilt = rebuilt
    if prompt is messages:
        return body
    return {**body, "messages": prompt}


@dataclass(frozen=True)
class _TurnPart:
    """How a request's messages divide: the leading system prompt, the messages new to the
    conversation (stored from `first_seq` on), and whether the request holds the whole history."""

    system: list[dict[str, Any]]
    new_messages: list[dict[str, Any]]
    first_seq: int
    whole: bool


def _split(messages: list[dict[str, Any]], appended: store.Appended) -> _TurnPart:
    new_count, first_seq = len(appended.node_ids), appended.first_seq
    if new_count == 0:  # a resent history with nothing new: the last message is the question
        new_count, first_seq = 1, max(0, first_seq - 1)
    system = _leading_system(messages)
    # The leading system prompt goes first, never again among the new messages.
    return _TurnPart(
        system=system,
        new_messages=messages[max(len(messages) - new_count, len(system)) :],
        first_seq=first_seq,
        whole=len(messages) == first_seq + new_count,
    )


def _check_fits(
    state: State, body: dict[str, Any], part: _TurnPart, *, budget: int | None, tools_room: int
) -> None:
    """400 `context_length_exceeded` when the system prompt and the new messages alone exceed
    the budget: no memory could make such a turn fit."""
    model = str(body.get("model", ""))
    reserved = tools_room + _tools_cost(body)
    limit = _limit(
        state, model, budget=budget, reserved_tokens=reserved, max_output=_max_output(body)
    )
    need = tokens.count_messages([*part.system, *part.new_messages], model=model)
    if need > limit:
        raise GatewayError(
            400,
            f"the system prompt and the new messages need {need} tokens, more than the "
            f"{max(limit, 0)} a budget of {limit + reserved} leaves after {reserved} for tool "
            "definitions (MEMSTRATA_CONTEXT_BUDGET or X-Memstrata-Budget, capped by the "
            "model's window less its reply)",
            param="messages",
            code="context_length_exceeded",
        )


def _limit(
    state: State, model: str, *, budget: int | None, reserved_tokens: int, max_output: int | None
) -> int:
    """The tokens the prompt's messages may take: the budget, capped by the model's window
    less its output reserve, less the room kept for tool definitions."""
    settings = state.settings
    return (
        prompt.budget_for(
            model,
            requested=budget if budget is not None else settings.context_budget,
            default_window=settings.context_window,
            default_reserve=settings.output_reserve,
            max_output=max_output,
        )
        - reserved_tokens
    )


async def dry_run(
    state: State,
    *,
    tenant_id: int,
    external_id: str,
    query: str,
    budget: int | None,
    model: str = "gpt-4o",
) -> tuple[list[dict[str, Any]], int]:
    """The messages, and their tokens, that `assemble` would send upstream if the stored
    conversation `external_id` received `query` as a new user message; nothing is stored."""
    async with transaction(state.engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=external_id)
        next_seq = await conn.scalar(
            select(conversations.c.next_seq).where(conversations.c.id == ref.id)
        )
    question = {"role": "user", "content": query}
    reserved = toolloop.reserved_tokens(state.settings, {"model": model, "messages": [question]})
    prompt, count, _full, _rebuilt = await _prompt(
        state,
        tenant_id=tenant_id,
        conversation_id=ref.id,
        model=model,
        request_system=[],
        new_messages=[question],
        unstored_tokens=tokens.count_message(question, model=model),
        new_from=int(next_seq or 0),
        whole=None,
        budget=budget,
        reserved_tokens=reserved,
        max_output=None,
        tools_guide=reserved > 0,
    )
    return prompt, count


async def _prompt(
    state: State,
    *,
    tenant_id: int,
    conversation_id: int,
    model: str,
    request_system: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    new_from: int,
    whole: list[dict[str, Any]] | None,
    budget: int | None,
    reserved_tokens: int,
    max_output: int | None,
    stored: tuple[int, str | None] | None = None,
    unstored_tokens: int = 0,
    tools_guide: bool = True,
) -> tuple[list[dict[str, Any]], int, int, bool]:
    """(messages, their tokens, the whole history's tokens, rebuilt?).

    The messages and `reserved_tokens` (tool definitions) together stay within the budget;
    the tokens returned are the messages' own. `stored` is the conversation's (token count,
    user) when the caller has just read them: a resent history that fits then needs no
    database at all."""
    settings = state.settings
    limit = _limit(
        state, model, budget=budget, reserved_tokens=reserved_tokens, max_output=max_output
    )
    if stored is None:
        async with transaction(state.engine) as conn:
            stored = await _figures(conn, tenant_id, conversation_id)
    stored_tokens, user = stored
    full = stored_tokens + unstored_tokens + tokens.REPLY_PRIMING_TOKENS
    if full <= limit * 1.25:  # stored counts may come from another model's tokenizer
        verbatim = whole
        if verbatim is None:
            async with transaction(state.engine) as conn:
                kept = await _history(conn, tenant_id, conversation_id, before=new_from)
            stored_system = _leading_system(kept)
            verbatim = [
                *(request_system or stored_system),
                *kept[len(stored_system) :],
                *new_messages,
            ]
        count = tokens.count_messages(verbatim, model=model)
        if count <= limit:
            return verbatim, count, full, False
    async with transaction(state.engine) as conn:
        related: list[int] = []
        if settings.cross_conversation == "on" and user is not None:
            related = await _related(conn, tenant_id, conversation_id, user)
        system = request_system or await _stored_system(conn, tenant_id, conversation_id)
        try:
            built = await prompt.build(
                conn,
                tenant_id=tenant_id,
                conversation_id=conversation_id,
                system=system,
                new_messages=new_messages,
                new_from=new_from,
                query=_query(new_messages),
                embed=lambda text: _embed(state, text),
                budget=limit + reserved_tokens,
                model=model,
                reserved_tokens=reserved_tokens,
                conversation_ids=related,
                stored_messages=new_from,
                stored_tokens=stored_tokens,
                tools_guide=prompt.TOOLS_GUIDE if tools_guide else None,
            )
        except prompt.ContextOverflow as exc:
            raise GatewayError(
                400, str(exc), param="messages", code="context_length_exceeded"
            ) from exc
    return built.messages, built.tokens, full, True


async def _figures(
    conn: AsyncConnection, tenant_id: int, conversation_id: int
) -> tuple[int, str | None]:
    """The stored conversation's (token count, user)."""
    row = (
        await conn.execute(
            select(conversations.c.token_count, conversations.c.user_id).where(
                conversations.c.id == conversation_id,
                conversations.c.tenant_id == tenant_id,
            )
        )
    ).one()
    return int(row.token_count), row.user_id


async def _related(
    conn: AsyncConnection, tenant_id: int, conversation_id: int, user: str
) -> list[int]:
    """The tenant's other conversations of the same `user`, most recent first."""
    rows = await conn.execute(
        select(conversations.c.id)
        .where(
            conversations.c.tenant_id == tenant_id,
            conversations.c.user_id == user,
            conversations.c.id != conversation_id,
        )
        .order_by(conversations.c.updated_at.desc())
        .limit(_RELATED_LIMIT)
    )
    return [int(row.id) for row in rows]


async def _stored_system(
    conn: AsyncConnection, tenant_id: int, conversation_id: int
) -> list[dict[str, Any]]:
    """The stored conversation's leading system messages (for clients that send only new
    messages without repeating their system prompt)."""
    head = await _history(conn, tenant_id, conversation_id, before=_SYSTEM_LOOKAHEAD)
    return _leading_system(head)


async def _history(
    conn: AsyncConnection, tenant_id: int, conversation_id: int, *, before: int
) -> list[dict[str, Any]]:
    """Stored messages before seq `before`, in OpenAI's format, as the client sent them."""
    rows = await conn.execute(
        select(
            nodes.c.role,
            nodes.c.content,
            nodes.c.name,
            nodes.c.tool_calls,
            nodes.c.tool_call_id,
            nodes.c.meta,
        )
        .where(
            nodes.c.tenant_id == tenant_id,
            nodes.c.conversation_id == conversation_id,
            nodes.c.level == 0,
            nodes.c.seq < before,
        )
        .order_by(nodes.c.seq)
    )
    history = []
    for row in rows:
        message: dict[str, Any] = {**(row.meta or {}), "role": row.role, "content": row.content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(row, key) is not None:
                message[key] = getattr(row, key)
        history.append(message)
    return history


def _leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    count = 0
    while count < len(messages) and messages[count].get("role") in _SYSTEM_ROLES:
        count += 1
    return messages[:count]


def _query(new_messages: list[dict[str, Any]]) -> str:
    """What retrieval looks for: the new user messages' text (else any new text)."""
    texts = [tokens.message_text(m) for m in new_messages if m.get("role") == "user"]
    if not any(texts):
        texts = [tokens.message_text(m) for m in new_messages]
    return "\n".join(t for t in texts if t)[-_QUERY_CHARS:]


async def _embed(state: State, text: str) -> list[float] | None:
    """The query's vector, or None when the embedder fails (retrieval is then full-text)."""
    try:
        [vector] = await state.embedder.embed([text])
    except ProviderError:
        log.warning("query embedding failed; retrieving by full text only", exc_info=True)
        return None
    return vector


def _tools_cost(body: dict[str, Any]) -> int:
    """Tokens the client's own tool schemas cost in the prompt (an estimate)."""
    tools = body.get("tools")
    if not tools:
        return 0
    model = str(body.get("model", ""))
    return tokens.count_text(json.dumps(tools, separators=(",", ":")), model=model)


def _max_output(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
