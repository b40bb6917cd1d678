"""The memory-tool loop on the Responses API, where the upstream serves it (SPEC §7). It follows
the chat completions' loop (`gateway.openai.toolloop`), whose rules it keeps: the same offer,
the same calls run in the turn's scope within the room the model's window has left
(`toolloop.MemoryCalls`), the same number of rounds.

The memory tools go as function tools after the client's own. A response whose function calls
are all memory calls is not shown to the client: the calls run, the response's output items
and one `function_call_output` per call are appended to the input, and the upstream is asked
again, at most `MEMSTRATA_MAX_TOOL_ROUNDS` times, the last time without the memory tools. A
response that also calls the client's own tools goes to the client with the memory calls
dropped unrun, as on chat completions.

Non-stream (`whole`): the final response, with the memory calls' items removed and `usage`
summed over the rounds. Stream (`rounds`): one stream of Responses events over all the rounds.
The first round's `response.created` and `response.in_progress` open it; the items of every
round follow, a memory call's events never sent, each renumbered after what was sent before it
(`output_index`, `sequence_number`); one final event closes it, the last round's, carrying the
first round's id (the one the client was shown), every item sent and the usage summed. The
response objects the client sees list its own tools only, not the memory tools. An
upstream error answering a later round arrives as an `error` event, as does a stream cut
mid-way, and the partial reply is kept, marked incomplete.
"""

from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from gateway.errors import GatewayError
from gateway.openai import translate
from gateway.openai.response_events import FINAL_EVENTS, ResponseReply, payload_of, typed_event
from gateway.openai.streams import Event, EventReader, add_usage, interrupted, parsed_json
from gateway.openai.toolloop import MemoryCalls, Offer
from gateway.openai.turn import REPLY_COMPLETE, Chunks, Turn
from gateway.state import State
from memory.recall.tools import TOOL_NAMES

Open = Callable[[dict[str, Any]], Awaitable[httpx.Response]]
Read = Callable[[httpx.Response], Awaitable[bytes]]
Item = dict[str, Any]


def _is_memory_item(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and item.get("type") == "function_call"
        and isinstance(item.get("name"), str)
        and item["name"] in TOOL_NAMES
    )


def _wants_memory(output: list[Any]) -> bool:
    """Whether a round's output calls memory tools and nothing else."""
    calls = [item for item in output if isinstance(item, dict) and item["type"] == "function_call"]
    return bool(calls) and all(_is_memory_item(call) for call in calls)


class ResponseToolLoop:
    """One response request's rounds with an upstream that serves the Responses API."""

    def __init__(
        self,
        state: State,
        turn: Turn,
        *,
        body: dict[str, Any],
        prompt: list[dict[str, Any]],
        offer: Offer,
        open: Open,
        read: Read,
    ) -> None:
        self._turn = turn
        self._body = body
        raw = body.get("input")
        self._input: list[Any] = (
            [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])
        )
        self._client_tools = offer.client_tools
        # The same tools, as the Responses API names a function tool.
        self._definitions = [
            {"type": "function", **definition["function"]} for definition in offer.definitions
        ]
        self._max_rounds = state.settings.max_tool_rounds
        # The request as the window's room counts it (its tools, its output reserve).
        counted = {
            "model": body.get("model"),
            "tools": body.get("tools"),
            "max_tokens": body.get("max_output_tokens"),
        }
        self._calls = MemoryCalls(state, turn, body=counted, prompt=prompt)
        self._open = open
        self._read = read

    def request(self, round_: int = 0) -> dict[str, Any]:
        """The body of round `round_`: the input so far, with the memory tools unless it is
        the last round."""
        body = {**self._body, "input": self._input}
        if not self._final(round_):
            body["tools"] = [*(self._client_tools or []), *self._definitions]
        elif self._client_tools is None:
            body.pop("tools", None)
        return body

    def _final(self, round_: int) -> bool:
        return round_ == self._max_rounds or self._calls.full

    async def whole(self, first: httpx.Response) -> tuple[bytes, httpx.Response, Item | None]:
        """Non-stream: the final answer's bytes and response, and the response object when it
        is one (a success the gateway understands; anything else is relayed as it is)."""
        usage: dict[str, Any] | None = None
        response = first
        for round_ in range(self._max_rounds + 1):
            if round_ > 0:
                response = await self._open(self.request(round_))
            content = await self._read(response)
            answer = parsed_json(content) if response.is_success else None
            output = answer.get("output") if isinstance(answer, dict) else None
            if answer is None or not isinstance(output, list):
                return content, response, None
            usage = add_usage(usage, answer.get("usage"))
            completed = answer.get("status") == "completed"
            if completed and _wants_memory(output) and not self._final(round_):
                await self._run(output)
                continue
            if round_ > 0 or any(_is_memory_item(item) for item in output):
                answer["output"] = [item for item in output if not _is_memory_item(item)]
                if usage is not None:
                    answer["usage"] = usage
            _as_asked(answer)
            content = translate.dumps(answer)
            self._turn.usage = translate.chat_usage(usage)
            return content, response, answer
        raise AssertionError("unreachable: the last round always answers")

    async def rounds(self, first: httpx.Response, reply: ResponseReply) -> Chunks:
        """Stream: the events of every round as one stream (see the module docstring)."""

        def sent(data: bytes) -> bytes:
            reply.feed(data)
            return data

        merged = _Merged()
        response = first
        try:
            for round_ in range(self._max_rounds + 1):
                if round_ > 0:
                    opened = await self._next(round_)
                    if isinstance(opened, dict):
                        yield sent(merged.emit(opened))
                        return
                    response = opened
                merged.next_round()
                reader = EventReader()
                async for data in response.aiter_bytes():
                    for event in reader.feed(data):
                        if out := merged.event(event):
                            yield sent(out)
                for event in reader.close():
                    if out := merged.event(event):
                        yield sent(out)
                await response.aclose()
                self._turn.usage = translate.chat_usage(merged.usage)
                if merged.failed:
                    return
                if merged.ended is None:
                    yield sent(
                        interrupted("the stream ended early", conversation=self._turn.external_id)
                    )
                    return
                if merged.continues and not self._final(round_):
                    await self._run(merged.round_output())
                    continue
                final = sent(merged.finish())
                yield REPLY_COMPLETE
                yield final
                return
        except httpx.HTTPError as exc:
            yield sent(interrupted(type(exc).__name__, conversation=self._turn.external_id))
        finally:
            await response.aclose()

    async def _next(self, round_: int) -> httpx.Response | dict[str, Any]:
        """The next round's response, or the `error` event that ends the stream instead."""
        try:
            response = await self._open(self.request(round_))
            if response.is_success:
                return response
            content = await self._read(response)
        except GatewayError as exc:
            return {"type": "error", "code": exc.code, "message": exc.message, "param": None}
        answer = parsed_json(content)
        error = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(error, dict):
            return {
                "type": "error",
                **{key: error.get(key) for key in ("code", "message", "param")},
            }
        text = content.decode(errors="replace")[:500]
        message = f"the upstream answered {response.status_code}: {text}"
        return {"type": "error", "code": None, "message": message, "param": None}

    async def _run(self, output: list[Any]) -> None:
        """Run a round's memory calls; its items and their outputs join the input."""
        calls = [
            {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments")},
            }
            for item in output
            if _is_memory_item(item)
        ]
        text = translate.reply_message(output)
        answered = await self._calls.run(text.get("content") if text else None, calls)
        self._input.extend(output)
        self._input.extend(
            {
                "type": "function_call_output",
                "call_id": message["tool_call_id"],
                "output": message["content"],
            }
            for message in answered[1:]
        )


class _Merged:
    """The events of several rounds as one Responses stream (see the module docstring)."""

    def __init__(self) -> None:
        self._sequence = 0
        self._rounds = 0
        self._id: str | None = None
        self._told = 0  # items the client has been told of, in every round
        self._kept: dict[int, Item] = {}  # the items sent, by the index the client knows
        self._hidden: set[int] = set()  # this round's indexes of memory calls
        self._indexes: dict[int, int] = {}  # this round's index → the client's
        self._items: dict[int, Item] = {}  # this round's items, as done
        self.ended: dict[str, Any] | None = None  # this round's final event, held back
        self.failed = False
        self.usage: dict[str, Any] | None = None

    def next_round(self) -> None:
        self._rounds += 1
        self._hidden, self._indexes, self._items = set(), {}, {}
        self.ended = None

    @property
    def continues(self) -> bool:
        """Whether this round asked for memory only, and completed."""
        return (
            self.ended is not None
            and self.ended.get("type") == "response.completed"
            and _wants_memory(self.round_output())
        )

    def round_output(self) -> list[Any]:
        assert self.ended is not None
        output = self.ended.get("response", {}).get("output")
        if isinstance(output, list):
            return output
        return [self._items[index] for index in sorted(self._items)]

    def event(self, event: Event) -> bytes:
        """What the client is sent of one upstream event."""
        payload = payload_of(event)
        if payload is None:
            return event.raw if self._rounds == 1 else b""
        kind = payload.get("type")
        if kind in ("response.created", "response.in_progress"):
            if self._rounds > 1:
                return b""
            response = payload.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self._id = response["id"]
            return self.emit(payload)
        if kind in FINAL_EVENTS:
            self.ended = payload
            response = payload.get("response")
            if isinstance(response, dict):
                self.usage = add_usage(self.usage, response.get("usage"))
            return b""
        if kind == "error":
            self.failed = True
            return self.emit(payload)
        index = payload.get("output_index")
        if not isinstance(index, int):
            return self.emit(payload)
        item = payload.get("item")
        if kind == "response.output_item.added" and _is_memory_item(item):
            self._hidden.add(index)
        if kind == "response.output_item.done" and isinstance(item, dict):
            self._items[index] = item
        if index in self._hidden:
            return b""
        if index not in self._indexes:
            self._indexes[index] = self._told
            self._told += 1
        payload["output_index"] = self._indexes[index]
        if kind == "response.output_item.done" and isinstance(item, dict):
            self._kept[self._indexes[index]] = item
        return self.emit(payload)

    def finish(self) -> bytes:
        """The final event: the last round's, with the first round's id, the items sent and
        the usage of every round."""
        assert self.ended is not None
        payload = self.ended
        response = payload.get("response")
        if isinstance(response, dict):
            if self._id is not None:
                response["id"] = self._id
            response["output"] = [self._kept[index] for index in sorted(self._kept)]
            if self.usage is not None:
                response["usage"] = self.usage
        return self.emit(payload)

    def emit(self, payload: dict[str, Any]) -> bytes:
        payload = {**payload, "sequence_number": self._sequence}
        if isinstance(payload.get("response"), dict):
            _as_asked(payload["response"])
        self._sequence += 1
        return typed_event(payload)


def _as_asked(response: dict[str, Any]) -> None:
    """`response` (in place) with the tools the client asked for only: the memory tools the
    gateway added are not the client's (which has none of their names, or they would not
    have been offered)."""
    offered = response.get("tools")
    if isinstance(offered, list):
        response["tools"] = [
            tool
            for tool in offered
            if not (isinstance(tool, dict) and tool.get("name") in TOOL_NAMES)
        ]
