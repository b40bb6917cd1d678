"""The assistant's reply, rebuilt from an upstream answer so that it can be stored.

Every field of the message is kept (`audio`, `annotations`, `reasoning_content`, `refusal`,
`function_call`, a provider's own): only fields without a value (null, an empty list or object)
are left out. A non-stream answer carries the message whole (`from_completion`). A stream
carries it in deltas: `StreamedReply.feed(bytes)` takes the raw SSE bytes as they are relayed,
in whatever pieces the network delivers, and rebuilds the message: tool calls from fragments
keyed by index; every other field by merging its deltas (text is concatenated, such as
`content`, `reasoning_content`, `audio.transcript` or the deprecated `function_call.arguments`;
lists are extended; anything else keeps its latest value). `complete` says whether the stream
reached its end: a finish_reason or `[DONE]`; a stream cut before that yields a reply marked
incomplete. Only the first choice is stored: memory follows one line of conversation. A stream's
`usage` (its last chunk's, with `stream_options.include_usage`) is kept beside it.
"""

import json
from typing import Any


def from_completion(body: Any) -> dict[str, Any] | None:
    """The assistant message of a chat.completion body, if it has one.

    An upstream may send anything: what is recorded is well-formed whatever it sent (content a
    string, a list of parts or None, anything else as its JSON text; tool calls only when they
    are a list of objects), while the client is relayed the upstream's answer untouched."""
    choices = body.get("choices") if isinstance(body, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        return None
    return _well_formed(_kept({**message, "role": "assistant"}))


def _kept(message: dict[str, Any]) -> dict[str, Any]:
    """The message without its fields that hold no value (`content` is always kept)."""
    return {
        key: value
        for key, value in message.items()
        if key == "content" or value not in (None, [], {})
    }


def _well_formed(reply: dict[str, Any]) -> dict[str, Any]:
    """`reply` as it can be stored and sent back, whatever an upstream put in it: `content` a
    string, a list of parts or None (anything else as its JSON text); `tool_calls` only when
    they are a list of objects. The client is relayed the upstream's answer untouched."""
    content = reply.get("content")
    if not (content is None or isinstance(content, str | list)):
        reply["content"] = json.dumps(content, ensure_ascii=False)
    calls = reply.get("tool_calls")
    if calls is not None and not (
        isinstance(calls, list) and all(isinstance(call, dict) for call in calls)
    ):
        del reply["tool_calls"]
    return reply


def _merge(into: dict[str, Any], delta: dict[str, Any]) -> None:
    """Add one delta's fields to what the earlier deltas made (see the module docstring); a
    value of another type than the field's so far is an upstream's mistake, and left out."""
    for key, value in delta.items():
        previous = into.get(key)
        if previous is not None and value is not None and type(value) is not type(previous):
            continue
        if isinstance(value, str) and isinstance(previous, str):
            into[key] = previous + value
        elif isinstance(value, list) and isinstance(previous, list):
            previous.extend(value)
        elif isinstance(value, dict) and isinstance(previous, dict):
            _merge(previous, value)
        elif value is not None:
            into[key] = value.copy() if isinstance(value, dict | list) else value


class StreamedReply:
    """Accumulates one streamed reply from raw SSE bytes."""

    def __init__(self) -> None:
        self._buffer = b""
        self._fields: dict[str, Any] = {}
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.done = False
        self.usage: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.done or self.finish_reason is not None

    def feed(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            self._line(line.rstrip(b"\r"))

    def message(self) -> dict[str, Any] | None:
        """The reply so far, or None if nothing of it arrived."""
        reply = _well_formed(_kept({"content": None, **self._fields, "role": "assistant"}))
        if self._tool_calls:
            reply["tool_calls"] = [self._tool_calls[index] for index in sorted(self._tool_calls)]
        if reply["content"] == "":
            reply["content"] = None
        return reply if len(reply) > 2 or reply["content"] is not None else None

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            return  # a keep-alive or garbage: nothing of the message
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        # Usage-only chunks, errors and chunks of any other shape hold nothing of the message.
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict):
                    self._tool_call(call)
            _merge(
                self._fields, {k: v for k, v in delta.items() if k not in ("role", "tool_calls")}
            )
        if isinstance(reason := choice.get("finish_reason"), str) and reason:
            self.finish_reason = reason

    def _tool_call(self, fragment: dict[str, Any]) -> None:
        index = fragment.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            index = len(self._tool_calls)
        call = self._tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        for key in ("id", "type"):
            if isinstance(value := fragment.get(key), str) and value:
                call[key] = value
        function = fragment.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(value := function.get(key), str):
                    call["function"][key] += value
