"""The Responses API with memory: `POST /v1/responses` (what it stored is read back and deleted
by `gateway.openai.response_objects`).

A response request goes the chat path's way (`gateway.openai.chat`): its `instructions` and
`input` are read as chat messages (`gateway.openai.translate`), then identified and stored
(`chat.store_turn`), the prompt assembled (`chat.recall`), forwarded, and the reply recorded by
the turn. The conversation is the one `previous_response_id` names (404 if it names none of this
tenant's), else the one `X-Memstrata-Conversation` names, else the one whose stored chain the
messages extend: a client that resends the whole input each time (openai-agents does) is
recognised as a chat client is. `conversation` (the Conversations API's field: an id, or an
object with its `id`) names the conversation as the header does, and is not sent upstream,
which gets the history from the gateway (it would prepend its own copy); with `store: false`
the request goes upstream as sent. `background: true` runs in the foreground (the reply must
be recorded): the answer is the finished response, which polling reads back. Continuing a
response that is no longer its conversation's latest sends its own history (even from a branch
the conversation left since) and the new input whole, so the write path continues the
conversation from that point, as a branch if it must; continuing the latest one, its input is
new, whatever it repeats. A retry is told as on the chat path (`Idempotency-Key`,
`X-Stainless-Retry-Count`, the same body) and stores nothing.
`store: false` stores nothing: the request reads memory (the history of `previous_response_id`, if
named: its own branch's, when that fits the budget) and goes upstream, and the response cannot
be retrieved or continued later. The memory tools are not offered on this path. With the
database down and `MEMSTRATA_FAIL_OPEN=on`, a request that names no `previous_response_id` goes
upstream as the client sent it, unrecorded, its answer marked `X-Memstrata-Degraded` as on the
chat path.

Upstream, the request goes as a Responses request when the upstream serves the API: the
client's own body when the prompt is its input unchanged, else with the assembled prompt as
`input` (and no `previous_response_id`: the upstream gets the history itself). Otherwise it is
translated to a chat completion and the answer back to a response object or Responses events.
Whether the upstream serves it is `MEMSTRATA_UPSTREAM_RESPONSES`: `on`, `off`, or `auto`: on
for OpenAI's own API, else learnt from the first request: an answer of 404, 405 or 501 (other
than an unknown model's) means it does not, remembered by the process. A first request that
could not be translated (built-in tools) learns it before anything is stored, from a request
the upstream must refuse (`{}`: 400 if it serves the API), so that it is refused unstored.
Upstream error answers are relayed with their status and body, as on the chat path. As there
too, a stored conversation's request carries its `prompt_cache_key` when the client sent none
and the settings send one (`chat.cache_key`), and the upstream's usage is recorded: the answer's
`usage` (`ResponseTurn.record`), counted as a chat completion's is.

What is stored for a response (`memory.write.responses`): the response object as the client
saw it and the request's input items, beside the messages the conversation holds.
"""

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, ClassVar
from urllib.parse import urlsplit

import httpx
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.bodies import read_json
from gateway.errors import GatewayError
from gateway.openai import chat, tenancy, translate
from gateway.openai.degraded import DEGRADED_HEADER
from gateway.openai.response_events import ChatEvents, ResponseReply
from gateway.openai.streams import EventReader, sse_error
from gateway.openai.turn import CONVERSATION_HEADER, REPLY_COMPLETE, Chunks, Turn
from gateway.schemas import ResponsesRequest
from gateway.settings import Settings
from gateway.state import State
from gateway.upstream import Upstream
from memory import stages, tokens
from memory.db import transaction
from memory.errors import InvalidConversationId, StorageUnavailable
from memory.recall.assemble import Budget, StoredTurn, leading_system
from memory.write import identity, retries
from memory.write import responses as stored_responses

log = logging.getLogger(__name__)

# What an upstream answers for a path it does not serve (the Responses API, or one response).
NOT_SERVED = (404, 405, 501)
_OPENAI_HOST = "api.openai.com"


def serves_responses(settings: Settings) -> bool | None:
    """What is known, at start, of whether the upstream serves the Responses API."""
    if settings.upstream_responses != "auto":
        return settings.upstream_responses == "on"
    return True if urlsplit(settings.upstream_url).hostname == _OPENAI_HOST else None


async def _probe(state: State, client_headers: Mapping[str, str]) -> None:
    """Learn whether the upstream serves the Responses API from a request it must refuse
    (no model, no input): it answers 400 if it serves it, else 404, 405 or 501. A failure to
    reach it teaches nothing (the request then learns as any other)."""
    upstream = state.upstream
    try:
        response = await upstream.open(
            "POST", "/responses", headers=upstream.headers_for(client_headers), json={}
        )
        status = response.status_code
        await upstream.read(response)
    except GatewayError:
        return
    _learnt(upstream, served=status not in NOT_SERVED)


def _learnt(upstream: Upstream, *, served: bool) -> None:
    if not served:
        log.info("the upstream does not serve the Responses API: translating to chat completions")
    upstream.serves_responses = served


@dataclass
class ResponseTurn(Turn):
    """A turn whose answer is a response: kept with its input items when it is recorded."""

    records_without_reply: ClassVar[bool] = True
    store: bool = True
    input_items: list[dict[str, Any]] = field(default_factory=list)
    response: dict[str, Any] | None = None
    streamed: ResponseReply | None = None
    degraded: bool = False
    """Forwarded without memory, the database being down (fail-open)."""
    background: bool = False
    """Asked for with `background: true` (and run in the foreground): the stored response
    says so, which is what lets a client cancel it."""

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        if not self.external_id:
            del headers[CONVERSATION_HEADER]
        if self.degraded:
            headers[DEGRADED_HEADER] = "1"
        return headers

    def answered(self) -> dict[str, Any] | None:
        """The response object the client was given, as far as it came."""
        return self.streamed.response() if self.streamed is not None else self.response

    async def record(
        self, state: State, reply: Mapping[str, Any] | None, *, complete: bool
    ) -> None:
        if not self.store:
            return
        body = self.answered()
        if self.usage is None and body is not None:
            self.usage = translate.chat_usage(body.get("usage"))
        await super().record(state, reply, complete=complete)

    async def recorded(self, conn: AsyncConnection) -> None:
        body = self.answered()
        if body is None or not isinstance(body.get("id"), str):
            return
        if self.background:
            body = {**body, "background": True}
        await stored_responses.save(
            conn,
            tenant_id=self.tenant_id,
            conversation_id=self.conversation_id,
            response_id=body["id"],
            body=body,
            input_items=self.input_items,
        )


async def create(request: Request, state: State, *, tenant_id: int) -> Response:
    """Handle `POST /v1/responses`."""
    started = time.perf_counter()
    body = await read_json(request, max_bytes=state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
    try:
        parsed = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
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
        await _probe(state, request.headers)
    if state.upstream.serves_responses is False:
        # It can only go upstream translated: what cannot be is refused before it is stored.
        translate.check_translatable(body)
    header = request.headers.get(CONVERSATION_HEADER)
    external_id = identity.validate_conversation_id(header) if header is not None else None
    named = _named_conversation(body, header=external_id)
    if named is not None and parsed.store is not False:
        # The gateway's conversation of that id (each tenant's own): the upstream, which gets
        # the history from the gateway, must not add its own, and need not hold one.
        external_id = named
        body = {key: value for key, value in body.items() if key != "conversation"}
    await tenancy.check_references(state, tenant_id=tenant_id, body=body)
    budget = Budget.of(
        {"model": parsed.model, "tools": body.get("tools"), "max_tokens": parsed_max(body)},
        chat.budget_rules(state.settings),
        requested=chat.parse_budget(request.headers.get(chat.BUDGET_HEADER)),
        tools_room=0,
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
    )
    previous = parsed.previous_response_id
    # What tells a retry of this request from a new one, as on the chat path: the SDKs retry
    # a response request too, and a client naming its conversation sends only its new input.
    request_key = retries.RequestKey.of(
        body=body,
        idempotency_key=request.headers.get(chat.IDEMPOTENCY_HEADER),
        retry_count=request.headers.get(chat.RETRY_COUNT_HEADER),
    )
    with stages.recording() as timings:
        try:
            with stages.stage("store"):
                if turn.store:
                    stored = await _store(
                        state,
                        turn,
                        messages,
                        budget,
                        previous=previous,
                        user=parsed.user,
                        request=request_key,
                    )
                elif previous is not None:
                    stored = await _unstored(state, turn, messages, budget, previous=previous)
                else:
                    stored = None
            with stages.stage("assemble"):
                assembled = (
                    await chat.recall(state, stored, budget, tools_guide=False, persist=turn.store)
                    if stored
                    else None
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
    forwarder = _Forward(state, turn, request=request, body=body, stream=bool(parsed.stream))
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
) -> StoredTurn:
    """Identify and store the request's messages (see the module docstring); a retry of
    `request` stores nothing."""
    async with transaction(state.engine) as conn:
        # Continuing the latest response, the input is new whatever it repeats (`new_only`).
        new_only = False
        if previous is not None:
            found = await _previous(conn, turn, previous, lock=True)
            new_only = found.at_head
            if not found.at_head:
                history = await stored_responses.history(
                    conn, tenant_id=turn.tenant_id, found=found
                )
                new = messages[len(leading_system(messages)) if leading_system(history) else 0 :]
                messages = [*history, *new]
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
            new_only=new_only,
        )
    turn.conversation_id = stored.conversation_id
    turn.external_id = appended.conversation.external_id
    turn.reply_to = appended.reply_to
    return stored


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


class _Forward:
    """One response request's way upstream, and its answer's way back."""

    def __init__(
        self,
        state: State,
        turn: ResponseTurn,
        *,
        request: Request,
        body: dict[str, Any],
        stream: bool,
    ) -> None:
        self._state = state
        self._turn = turn
        self._upstream = state.upstream
        self._headers = state.upstream.headers_for(request.headers)
        self._query = request.url.query
        self._body = body
        self._stream = stream

    async def send(self, prompt: list[dict[str, Any]], *, as_sent: bool) -> Response:
        """Send `prompt` (`as_sent`: the client's own input, unchanged) upstream."""
        if self._upstream.serves_responses is not False:
            body = self._body if as_sent else self._responses_body(prompt)
            response = await self._open("/responses", body)
            if self._upstream.serves_responses is None:
                answer = await self._learn(response)
                if answer is not None:
                    return answer
            if self._upstream.serves_responses:
                return await self._relay(response)
        return await self._translated(prompt)

    async def _learn(self, response: httpx.Response) -> Response | None:
        """Learn whether the upstream serves the Responses API from its first answer; the
        answer to relay when it had to be read to tell (an unknown model's 404), else None."""
        if response.status_code not in NOT_SERVED:
            _learnt(self._upstream, served=True)
            return None
        content = await self._read(response)
        error = _json(content)
        code = error.get("error", {}).get("code") if isinstance(error, dict) else None
        if isinstance(code, str) and code == "model_not_found":
            _learnt(self._upstream, served=True)
            return await self._turn.answer(self._state, content, response)
        _learnt(self._upstream, served=False)
        return None

    def _responses_body(self, prompt: list[dict[str, Any]]) -> dict[str, Any]:
        instructions = self._body.get("instructions")
        if instructions and prompt and prompt[0] == translate.instructions_message(instructions):
            prompt = prompt[1:]
        body = {**self._body, "input": translate.input_items(prompt)}
        body.pop("previous_response_id", None)
        return body

    async def _open(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self._upstream.open(
                "POST",
                path,
                headers=self._headers,
                json=body,
                query=self._query,
                stream=self._stream,
            )
        except GatewayError as exc:
            exc.headers.update(self._turn.headers())
            raise

    async def _read(self, response: httpx.Response) -> bytes:
        try:
            return await self._upstream.read(response)
        except GatewayError as exc:
            exc.headers.update(self._turn.headers())
            raise

    async def _relay(self, response: httpx.Response) -> Response:
        """The upstream's Responses answer, relayed as it is."""
        if self._stream and response.is_success:
            streamed = self._turn.streamed = ResponseReply()
            chunks = self._passed(response, streamed)
            return self._turn.stream(self._state, response, chunks, streamed)
        content = await self._read(response)
        answer = _json(content)
        reply = None
        if response.is_success and isinstance(answer, dict):
            self._turn.response = answer
            reply = translate.reply_message(answer.get("output"))
        return await self._turn.answer(self._state, content, response, reply)

    async def _passed(self, response: httpx.Response, reply: ResponseReply) -> Chunks:
        reader = EventReader()
        try:
            async for data in response.aiter_bytes():
                for event in reader.feed(data):
                    final = reply.ends(event)
                    reply.feed(event.raw)
                    if final:
                        yield REPLY_COMPLETE
                    yield event.raw
            for event in reader.close():
                reply.feed(event.raw)
                yield event.raw
        except httpx.HTTPError as exc:
            yield self._interrupted(type(exc).__name__)
        finally:
            await response.aclose()

    async def _translated(self, prompt: list[dict[str, Any]]) -> Response:
        """The request as a chat completion; its answer as a response."""
        response = await self._open("/chat/completions", translate.chat_request(self._body, prompt))
        response_id = translate.new_id("resp")
        if self._stream and response.is_success:
            streamed = self._turn.streamed = ResponseReply()
            skeleton = translate.response_skeleton(
                self._body, response_id=response_id, model=str(self._body.get("model"))
            )
            events = ChatEvents(skeleton)
            chunks = self._converted(response, events, streamed)
            return self._turn.stream(self._state, response, chunks, streamed)
        content = await self._read(response)
        converted = translate.response_object(_json(content), self._body, response_id=response_id)
        if not response.is_success or converted is None:
            return await self._turn.answer(self._state, content, response)
        self._turn.response = converted
        reply = translate.reply_message(converted["output"])
        return await self._turn.answer(self._state, translate.dumps(converted), response, reply)

    async def _converted(
        self, response: httpx.Response, events: ChatEvents, reply: ResponseReply
    ) -> Chunks:
        def sent(data: bytes) -> bytes:
            reply.feed(data)
            return data

        reader = EventReader()
        try:
            yield sent(events.start())
            async for data in response.aiter_bytes():
                for event in reader.feed(data):
                    if out := events.event(event):
                        yield sent(out)
            for event in reader.close():
                if out := events.event(event):
                    yield sent(out)
            if events.failed:
                # Not a completed response: no final event, and the reply is recorded (by the
                # turn, as the stream ends) as incomplete.
                return
            if not events.finished:  # cut short, though without a transport error
                yield sent(self._interrupted("the stream ended early"))
                return
            final = events.finish()
            reply.feed(final)
            yield REPLY_COMPLETE
            yield final
        except httpx.HTTPError as exc:
            yield sent(self._interrupted(type(exc).__name__))
        finally:
            await response.aclose()

    def _interrupted(self, cause: str) -> bytes:
        log.warning(
            "upstream stream interrupted: %s",
            cause,
            extra={"conversation": self._turn.external_id},
        )
        return sse_error(
            f"the upstream stream was interrupted ({cause}); the partial reply was kept",
            code="upstream_stream_interrupted",
        )


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None
