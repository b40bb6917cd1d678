"""Streams of the Responses API: reading one to record its reply, and making one out of a chat
completion stream.

`ResponseReply.feed(bytes)` reads the server-sent events of a Responses stream, in whatever
pieces the network delivers, and keeps the response object (`response.created`, then the final
`response.completed`, `response.incomplete` or `response.failed`) and its output items as they
grow (`response.output_item.added` / `.done`, text and argument deltas). `message()` is the
assistant message they make (`gateway.openai.translate.reply_message`); `response()` the
response object as far as it came, `status` `incomplete` when the stream was cut; `done` says
whether the final event arrived, `ends(event)` whether an event is that final one.

`ChatEvents` turns the events of a chat completion stream into the events OpenAI's Responses
API sends, in its order: `response.created` and `response.in_progress`; for the text, a message
item (`output_item.added`, `content_part.added`, one `output_text.delta` per chunk,
`output_text.done`, `content_part.done`, `output_item.done`); for each tool call, a
`function_call` item (`output_item.added`, `function_call_arguments.delta` per fragment,
`function_call_arguments.done`, `output_item.done`); then `response.completed` (or
`response.incomplete` for a `finish_reason` of `length` or `content_filter`) with the usage. An
error event of the chat stream becomes an `error` event and ends the stream (`failed`): nothing
follows it, no final response, so the reply is kept as incomplete. A chat stream that ends with
neither a `finish_reason` nor `[DONE]` was cut short (`finished` is false): it gets no final
response either. Every event carries its
`sequence_number`.
"""

import copy
import json
from typing import Any

from gateway.openai import translate
from gateway.openai.streams import Event, EventReader, parsed_json

FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def typed_event(payload: dict[str, Any]) -> bytes:
    """An event as the Responses API sends one: named by its payload's `type`."""
    data = json.dumps(payload, ensure_ascii=False)
    return f"event: {payload.get('type')}\ndata: {data}\n\n".encode()


def payload_of(event: Event) -> dict[str, Any] | None:
    """An event's data as a JSON object, or None."""
    payload = parsed_json(event.data) if event.data is not None else None
    return payload if isinstance(payload, dict) else None


class ResponseReply:
    """One Responses stream, read as it is relayed (see the module docstring)."""

    def __init__(self) -> None:
        self._reader = EventReader()
        self._response: dict[str, Any] | None = None
        self._items: dict[int, dict[str, Any]] = {}
        self.done = False

    @property
    def complete(self) -> bool:
        return self.done

    def feed(self, data: bytes) -> None:
        for event in self._reader.feed(data):
            payload = payload_of(event)
            if payload is not None:
                self._event(payload)

    @staticmethod
    def ends(event: Event) -> bool:
        payload = payload_of(event)
        return payload is not None and payload.get("type") in FINAL_EVENTS

    def response(self) -> dict[str, Any] | None:
        if self._response is None:
            return None
        response = copy.deepcopy(self._response)
        if not self.done:
            response["output"] = [self._items[index] for index in sorted(self._items)]
            response["status"] = "incomplete"
        return response

    def message(self) -> dict[str, Any] | None:
        response = self.response()
        return translate.reply_message(response["output"]) if response is not None else None

    def _event(self, payload: dict[str, Any]) -> None:
        kind = payload.get("type")
        if kind in ("response.created", "response.in_progress", *FINAL_EVENTS):
            if isinstance(payload.get("response"), dict):
                self._response = payload["response"]
            self.done = self.done or kind in FINAL_EVENTS
            return
        index = payload.get("output_index")
        if not isinstance(index, int):
            return
        if kind in ("response.output_item.added", "response.output_item.done"):
            if isinstance(payload.get("item"), dict):
                self._items[index] = payload["item"]
            return
        item = self._items.get(index)
        delta = payload.get("delta")
        if item is None or not isinstance(delta, str):
            return
        if kind == "response.function_call_arguments.delta":
            item["arguments"] = str(item.get("arguments") or "") + delta
        elif kind == "response.output_text.delta":
            parts = item.setdefault("content", [])
            while len(parts) <= int(payload.get("content_index") or 0):
                parts.append({"type": "output_text", "text": ""})
            part = parts[int(payload.get("content_index") or 0)]
            part["text"] = str(part.get("text") or "") + delta


class ChatEvents:
    """Responses events for one chat completion stream (see the module docstring)."""

    def __init__(self, response: dict[str, Any]) -> None:
        self._response = response
        self._sequence = 0
        self._text: dict[str, Any] | None = None  # the open message item
        self._calls: dict[int, dict[str, Any]] = {}  # chat index → its function_call item
        self._open_call: int | None = None
        self._finish: str | None = None
        self._usage: Any = None
        self.failed = False
        """The chat stream sent an error: the response ends there (see the module docstring)."""
        self._done = False

    def start(self) -> bytes:
        snapshot = copy.deepcopy(self._response)
        return self._emit("response.created", response=snapshot) + self._emit(
            "response.in_progress", response=copy.deepcopy(snapshot)
        )

    def event(self, event: Event) -> bytes:
        """What the client is sent for one event of the chat stream."""
        if self.failed or event.data is None:
            return b""
        if event.data.strip() == "[DONE]":
            self._done = True
            return b""
        chunk = payload_of(event)
        if chunk is None:
            return b""
        if isinstance(chunk.get("error"), dict):
            error = chunk["error"]
            self.failed = True
            return self._emit(
                "error",
                code=error.get("code"),
                message=error.get("message"),
                param=error.get("param"),
            )
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return b""
        choice = choices[0]
        out = b""
        raw_delta = choice.get("delta")
        delta: dict[str, Any] = raw_delta if isinstance(raw_delta, dict) else {}
        if isinstance(delta.get("content"), str) and delta["content"]:
            out += self._text_delta(delta["content"])
        for fragment in delta.get("tool_calls") or []:
            if isinstance(fragment, dict):
                out += self._call_delta(fragment)
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        return out

    @property
    def finished(self) -> bool:
        """Whether the chat stream reached its end: a `finish_reason` or `[DONE]`."""
        return self._done or self._finish is not None

    def finish(self) -> bytes:
        """The events that close the stream: open items done, then the final response."""
        out = self._close_text() + self._close_call()
        translate.finished(self._response, self._finish, self._usage)
        final = "response.incomplete" if self._response["status"] == "incomplete" else None
        return out + self._emit(final or "response.completed", response=self._response)

    # -- items ---------------------------------------------------------------------------------

    def _add(self, item: dict[str, Any]) -> bytes:
        self._response["output"].append(item)
        return self._emit(
            "response.output_item.added",
            output_index=len(self._response["output"]) - 1,
            item=copy.deepcopy(item),
        )

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self._response["output"]) if it is item)

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._text is None:
            out += self._close_call()
            item = translate.message_item("", item_id=translate.new_id("msg"), status="in_progress")
            self._text = item
            part = copy.deepcopy(item["content"][0])
            out += self._add(item) + self._emit(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self._index(item),
                content_index=0,
                part=part,
            )
        item = self._text
        item["content"][0]["text"] += text
        return out + self._emit(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=self._index(item),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _close_text(self) -> bytes:
        item, self._text = self._text, None
        if item is None:
            return b""
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}
        part = item["content"][0]
        return (
            self._emit("response.output_text.done", **where, text=part["text"], logprobs=[])
            + self._emit("response.content_part.done", **where, part=copy.deepcopy(part))
            + self._emit(
                "response.output_item.done",
                output_index=where["output_index"],
                item=copy.deepcopy(item),
            )
        )

    def _call_delta(self, fragment: dict[str, Any]) -> bytes:
        index = fragment.get("index", 0)
        raw_function = fragment.get("function")
        function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
        out = b""
        if index not in self._calls:
            out += self._close_text() + self._close_call()
            call = {"id": fragment.get("id"), "function": {"name": function.get("name")}}
            item = translate.call_item(call, item_id=translate.new_id("fc"), status="in_progress")
            self._calls[index] = item
            self._open_call = index
            out += self._add(item)
        item = self._calls[index]
        arguments = function.get("arguments")
        if not isinstance(arguments, str) or not arguments:
            return out
        item["arguments"] += arguments
        return out + self._emit(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=self._index(item),
            delta=arguments,
        )

    def _close_call(self) -> bytes:
        if self._open_call is None:
            return b""
        item = self._calls[self._open_call]
        self._open_call = None
        item["status"] = "completed"
        index = self._index(item)
        return self._emit(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=item["arguments"],
        ) + self._emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _emit(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return typed_event(payload)
