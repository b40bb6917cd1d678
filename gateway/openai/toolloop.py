"""The memory-tool loop (SPEC §7): the model may read memory before it answers the client. This
is the chat completions' loop (a Responses request translated to chat completions goes through
it too); a Responses request forwarded as one has its own rounds
(`gateway.openai.response_tools`), which run their calls through the same `MemoryCalls`.

When the tools are offered (`offer()`: `MEMSTRATA_MEMORY_TOOLS=always`, or `auto` and the prompt
was rebuilt from memory), their definitions are added after the client's own `tools`. A reply
that calls memory tools only is not shown to the client: the gateway runs the calls
(`memory.recall.tools.run_tool`, in the turn's tenant and recall scope), appends the assistant
message and one `tool` message per call to the prompt, and asks the upstream again, at most
`MEMSTRATA_MAX_TOOL_ROUNDS` times; the request after the last round goes without the memory
tools, so that the model must answer. The client sees only the final answer.

A reply that calls memory tools *and* the client's own tools goes to the client with the
client's calls alone, untouched (ids, arguments, order), and the memory calls dropped unrun:
the client can answer its calls, and its next request then sends back a valid history
(assistant message with those calls, then their results); that history is also what is stored.
Running the memory calls and re-asking instead would throw away calls the model meant for the
client; keeping them for later would make the stored conversation differ from the client's.

The rounds' results stay within the model's window (less its output reserve and the tools'
definitions, the room a prompt has in `memory.recall.assemble.Budget`): a result that would
not fit is cut to what does, with a note, and once less than `MIN_ROOM` tokens are left the
next request goes without the memory tools, so that the model answers with what it has read.

Non-stream: every round is read whole; the final completion is returned with the memory calls
removed and `usage` summed over the rounds (unchanged, byte for byte, when the first reply is
final as it is). Stream: content is relayed as it arrives, in every round, as one coherent
stream (`gateway.openai.streams.MergedStream`): a round that ends in memory calls only is continued
by the next one in the same stream. An upstream error answering the first round is relayed with its
status and body; one answering a later round of a stream arrives as an error event (the HTTP
status is already sent), as does a stream cut mid-way, and the partial reply is kept, marked
incomplete. The reply recorded is always what the client was shown.
"""

import json
import logging
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx
from fastapi.responses import Response

from gateway.errors import GatewayError
from gateway.openai.replies import from_completion
from gateway.openai.streams import (
    EventReader,
    MergedStream,
    add_usage,
    interrupted,
    is_memory_call,
    parsed_json,
    sse_error,
)
from gateway.openai.turn import REPLY_COMPLETE, Chunks, Turn
from gateway.settings import Settings
from gateway.state import State
from memory import tokens
from memory.db import transaction
from memory.errors import StorageUnavailable
from memory.recall import tools
from memory.recall.assemble import Budget, BudgetRules

log = logging.getLogger(__name__)

MIN_ROOM = 256
"""Tokens of room in the model's window below which no more memory is read."""
# Characters a result may take per token of room, before it is counted: more than most text
# takes, so that the tool cuts where its note says what is left out; the count then cuts
# exactly.
_CHARS_PER_TOKEN = 3
# A tool message's tokens beside its content, and the cut note's.
_MESSAGE_TOKENS = 32
_FULL = "error: the prompt has no room left in the model's window; answer with what you have"


@dataclass(frozen=True)
class Offer:
    """What the loop adds to a request: the tools' definitions beside the client's own."""

    definitions: list[dict[str, Any]]
    client_tools: list[Any] | None  # None: the client sent no `tools`


def offer(settings: Settings, turn: Turn, body: Mapping[str, Any]) -> Offer | None:
    """The memory tools to offer with `body`, or None when they must not be."""
    mode = settings.memory_tools
    if mode == "never" or (mode == "auto" and not turn.rebuilt) or not turn.memory_tools:
        return None
    if not _offerable(body):
        return None
    if turn.conversation_id <= 0:  # forwarded without memory (the database is down)
        return None
    return Offer(definitions=tools.definitions(), client_tools=body.get("tools"))


def reserved_tokens(settings: Settings, body: Mapping[str, Any]) -> int:
    """Prompt tokens to keep for the tool definitions if they may be offered with `body`
    (whether the prompt will be rebuilt is not known yet: `auto` reserves them too)."""
    if settings.memory_tools == "never" or not _offerable(body):
        return 0
    return tools.tool_tokens(str(body.get("model", "")))


def _offerable(body: Mapping[str, Any]) -> bool:
    client_tools = body.get("tools")
    if client_tools is not None and not isinstance(client_tools, list):
        return False
    choice = body.get("tool_choice")
    if (
        body.get("n") not in (None, 1)  # one line of conversation only
        or "functions" in body  # the deprecated form cannot be mixed with tools
        or choice == "none"
        or isinstance(choice, dict)  # a function the model must call
        or (choice is not None and not client_tools)  # the client's mistake: left to upstream
    ):
        return False
    # A client with tools of these names keeps them: ours are not offered.
    return not {_tool_name(tool) for tool in client_tools or []} & tools.TOOL_NAMES


def _tool_name(tool: Any) -> str | None:
    if not isinstance(tool, dict):
        return None
    # A chat tool names its function; a Responses function tool is named itself.
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    # Only a string can name a tool; anything else (a list is unhashable) is the upstream's to
    # refuse, not a reason to fail here.
    return name if isinstance(name, str) else None


class ToolLoop:
    """One request's rounds with the upstream."""

    def __init__(
        self,
        state: State,
        turn: Turn,
        *,
        client_headers: Mapping[str, str],
        query: str,
        body: dict[str, Any],
        offer: Offer,
    ) -> None:
        self._state = state
        self._turn = turn
        self._headers = state.upstream.headers_for(client_headers)
        self._query = query
        self._body = body
        self._offer = offer
        self._messages: list[Any] = list(body["messages"])
        self._max_rounds = state.settings.max_tool_rounds
        self._calls = MemoryCalls(state, turn, body=body, prompt=self._messages)

    async def complete(self) -> Response:
        """Non-stream: the final completion."""
        content, response, completion = await self.whole()
        reply = from_completion(completion) if completion is not None else None
        return await self._answer(content, response, reply)

    async def whole(self) -> tuple[bytes, httpx.Response, dict[str, Any] | None]:
        """Non-stream: the final answer's bytes and response, and the completion when it is
        one (a success the gateway understands; anything else is relayed as it is)."""
        usage: dict[str, Any] | None = None
        for round_ in range(self._max_rounds + 1):
            final = self._final(round_)
            response = await self._open(final=final, stream=False)
            content = await self._read(response)
            if not response.is_success:
                return content, response, None
            completion = parsed_json(content)
            message = _message(completion)
            if message is None:  # not a completion we understand: relayed as it is
                return content, response, None
            usage = add_usage(usage, completion.get("usage"))
            calls = message.get("tool_calls") or []
            memory = [call for call in calls if is_memory_call(call)]
            if memory and len(memory) == len(calls) and not final:
                self._messages.extend(await self._calls.run(message.get("content"), memory))
                continue
            if memory or round_ > 0:
                _drop_memory_calls(completion, message)
                if round_ > 0 and usage is not None:
                    completion["usage"] = usage
                content = json.dumps(completion, ensure_ascii=False).encode()
            self._turn.usage = usage
            return content, response, completion
        raise AssertionError("unreachable: the last round always answers")

    async def stream(self) -> Response:
        """Stream: one client stream over all the rounds."""
        opened = await self.open_stream()
        if isinstance(opened, Response):
            return opened
        first, chunks, merged = opened
        return self._turn.stream(self._state, first, chunks, merged.reply)

    async def open_stream(self) -> Response | tuple[httpx.Response, Chunks, MergedStream]:
        """Stream: the first round's response, and the chunks of all the rounds as one chat
        stream, or the answer to relay when the first round failed."""
        first = await self._open(final=False, stream=True)
        if not first.is_success:
            return await self._answer(await self._read(first), first)
        merged = MergedStream(hide_usage=self._turn.hide_usage)
        return first, self._rounds(first, merged), merged

    async def _rounds(self, response: httpx.Response, merged: MergedStream) -> Chunks:
        try:
            for round_ in range(self._max_rounds + 1):
                if round_ > 0:
                    opened = await self._next_round(round_)
                    if isinstance(opened, bytes):
                        yield merged.send(opened)
                        return
                    response = opened
                current = merged.round(final=self._final(round_))
                reader = EventReader()
                async for data in response.aiter_bytes():
                    for event in reader.feed(data):
                        if sent := current.event(event):
                            yield sent
                for event in reader.close():
                    if sent := current.event(event):
                        yield sent
                await response.aclose()
                current.end()
                if not current.continues:
                    self._turn.usage = merged.total
                    yield REPLY_COMPLETE
                    if done := merged.done():
                        yield done
                    return
                # Those rounds are billed whatever becomes of the next: a failure or a client
                # that leaves still records their usage with the partial reply.
                self._turn.usage = merged.usage
                message = current.assistant_message()
                self._messages.extend(
                    await self._calls.run(message["content"], message["tool_calls"])
                )
        except httpx.HTTPError as exc:
            cause = type(exc).__name__
            yield merged.send(interrupted(cause, conversation=self._turn.external_id))
        finally:
            await response.aclose()

    async def _next_round(self, round_: int) -> httpx.Response | bytes:
        """The next round's response, or the error event that ends the stream instead."""
        try:
            response = await self._open(final=self._final(round_), stream=True)
            if response.is_success:
                return response
            content = await self._state.upstream.read(response)
        except GatewayError as exc:
            return sse_error(exc.message, code=exc.code, type=exc.type)
        error = parsed_json(content)
        if isinstance(error, dict) and isinstance(error.get("error"), dict):
            return f"data: {json.dumps(error, ensure_ascii=False)}\n\n".encode()
        text = content.decode(errors="replace")[:500]
        return sse_error(f"the upstream answered {response.status_code}: {text}", code=None)

    def _final(self, round_: int) -> bool:
        """Whether round `round_` goes without the memory tools: the last one, or once the
        window is (nearly) full."""
        return round_ == self._max_rounds or self._calls.full

    # -- one round -------------------------------------------------------------------------

    def _request(self, *, final: bool) -> dict[str, Any]:
        body = {**self._body, "messages": self._messages}
        client_tools = self._offer.client_tools
        if not final:
            body["tools"] = [*(client_tools or []), *self._offer.definitions]
        elif client_tools is None:
            body.pop("tools", None)
        return body

    async def _open(self, *, final: bool, stream: bool) -> httpx.Response:
        try:
            return await self._state.upstream.open(
                "POST",
                "/chat/completions",
                headers=self._headers,
                json=self._request(final=final),
                query=self._query,
                stream=stream,
            )
        except GatewayError as exc:
            exc.headers.update(self._turn.headers())
            raise

    async def _read(self, response: httpx.Response) -> bytes:
        try:
            return await self._state.upstream.read(response)
        except GatewayError as exc:
            exc.headers.update(self._turn.headers())
            raise

    async def _answer(
        self, content: bytes, response: httpx.Response, reply: dict[str, Any] | None = None
    ) -> Response:
        return await self._turn.answer(self._state, content, response, reply)


class MemoryCalls:
    """The memory calls of one request's rounds, run in its turn's tenant and recall scope,
    their results kept within the room the model's window has left (see the module
    docstring). `body` is the request as a chat completion counts it (model, tools, output
    reserve); `prompt` the messages sent first, counted when the turn did not count them."""

    def __init__(
        self, state: State, turn: Turn, *, body: Mapping[str, Any], prompt: list[Any]
    ) -> None:
        self._state = state
        self._turn = turn
        self._body = body
        self._prompt = prompt
        self._model = str(body.get("model", ""))
        self._limits = tools.Limits(
            regex_timeout=state.settings.regex_timeout,
            result_chars=state.settings.tool_result_chars,
        )
        self._scope: tools.Scope | None = None
        # Tokens the prompt may still grow by within the model's window (set at the first call).
        self._room: int | None = None

    @property
    def full(self) -> bool:
        """Whether the window is (nearly) full: no more memory is to be read."""
        return self._room is not None and self._room < MIN_ROOM

    async def run(self, content: Any, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Run the calls: the assistant message that made them, then one tool message per
        call with its result (calls without an id are given one)."""
        began = time.perf_counter()
        for call in calls:
            call["id"] = call.get("id") or f"call_memstrata_{uuid.uuid4().hex[:20]}"
        called = {"role": "assistant", "content": content if content else None, "tool_calls": calls}
        room = self._window_room() - tokens.count_message(called, model=self._model)
        answered: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            # Each call gets an even share of what the ones before it left.
            share = room // (len(calls) - index)
            result = await self._call(call, room=share) if share >= MIN_ROOM else _FULL
            answered.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            room -= tokens.count_message(answered[-1], model=self._model)
        self._room = room
        self._turn.overhead += time.perf_counter() - began
        return [called, *answered]

    def _window_room(self) -> int:
        """Tokens the prompt may still grow by within the model's window."""
        if self._room is None:
            settings = self._state.settings
            whole = BudgetRules(
                default=0, window=settings.context_window, output_reserve=settings.output_reserve
            )
            window = Budget.of(
                self._body,
                whole,
                requested=sys.maxsize,
                tools_room=reserved_tokens(settings, self._body),
            )
            prompt = self._turn.context_tokens
            if prompt is None:
                prompt = tokens.count_messages(self._prompt, model=self._model)
            self._room = window.limit - prompt
        return self._room

    async def _call(self, call: dict[str, Any], *, room: int) -> str:
        """The result of a memory call, within `room` tokens (less the message's own)."""
        limits = replace(
            self._limits, result_chars=min(self._limits.result_chars, room * _CHARS_PER_TOKEN)
        )
        result = await self._result(call, limits)
        fitted = tokens.head_within(result, room - _MESSAGE_TOKENS, model=self._model)
        if fitted != result:
            fitted += f"\n[cut at {len(fitted)} of {len(result)} characters: the prompt is full]"
        return fitted

    async def _result(self, call: dict[str, Any], limits: tools.Limits) -> str:
        function = call.get("function") or {}
        name = str(function.get("name"))
        began = time.perf_counter()
        try:
            async with transaction(self._state.engine) as conn:
                if self._scope is None:
                    self._scope = await tools.scope_for(
                        conn,
                        tenant_id=self._turn.tenant_id,
                        conversation_id=self._turn.conversation_id,
                        cross_conversation=self._state.settings.cross_conversation == "on",
                        abandoned_branches=(self._state.settings.recall_abandoned_branches == "on"),
                    )
                result = await tools.run_tool(
                    conn,
                    self._scope,
                    name=name,
                    arguments=function.get("arguments"),
                    embedder=self._state.embedder,
                    limits=limits,
                )
        except StorageUnavailable:
            log.warning("memory tool %s: the database is unavailable", name)
            result = "error: memory cannot be read right now; answer without it"
        except Exception:  # a bug in a tool must not fail the client's request
            log.exception("memory tool %s failed", name)
            result = "error: the tool failed; answer without it"
        log.info(
            "memory tool %s",
            name,
            extra={
                "conversation": self._turn.external_id,
                "ms": round((time.perf_counter() - began) * 1000, 1),
                "failed": result.startswith("error:"),
            },
        )
        return result


def _message(completion: Any) -> dict[str, Any] | None:
    try:
        message = completion["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None
    return message if isinstance(message, dict) else None


def _drop_memory_calls(completion: dict[str, Any], message: dict[str, Any]) -> None:
    """Leave the client's own calls only; with none left, the reply simply stops."""
    kept = [call for call in message.get("tool_calls") or [] if not is_memory_call(call)]
    if kept:
        message["tool_calls"] = kept
        return
    message.pop("tool_calls", None)
    choice = completion["choices"][0]
    if choice.get("finish_reason") == "tool_calls":
        choice["finish_reason"] = "stop"
