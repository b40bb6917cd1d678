"""The assistant's reply, rebuilt from an upstream answer so that it can be stored.

A non-stream answer carries the message whole (`from_completion`). A stream carries it in
deltas: `StreamedReply.feed(bytes)` takes the raw SSE bytes as they are relayed, in whatever
pieces the network delivers, and rebuilds content, refusal and tool calls (whose arguments
arrive in fragments keyed by index). `complete` says whether the stream reached its end: a
finish_reason or `[DONE]`; a stream cut before that yields a reply marked incomplete.
Only the first choice is stored: memory follows one line of conversation. A stream's `usage`
(its last chunk's, with `stream_options.include_usage`) is kept beside it.
"""

import json
from typing import Any


def from_completion(body: Any) -> dict[str, Any] | None:
    """The assistant message of a chat.completion body, if it has one."""
    try:
        message = body["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(message, dict):
        return None
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        reply["tool_calls"] = message["tool_calls"]
    if message.get("refusal"):
        reply["refusal"] = message["refusal"]
    return reply


class StreamedReply:
    """Accumulates one streamed reply from raw SSE bytes."""

    def __init__(self) -> None:
        self._buffer = b""
        self._content: list[str] = []
        self._refusal: list[str] = []
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
        if not (self._content or self._refusal or self._tool_calls):
            return None
        reply: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(self._content) if self._content else None,
        }
        if self._tool_calls:
            reply["tool_calls"] = [self._tool_calls[index] for index in sorted(self._tool_calls)]
        if self._refusal:
            reply["refusal"] = "".join(self._refusal)
        return reply

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
            return  # keep-alives and the like
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        try:
            choice = chunk["choices"][0]
        except (KeyError, IndexError, TypeError):
            return  # usage-only chunks, errors: nothing of the message
        if choice.get("index", 0) != 0:
            return
        delta = choice.get("delta") or {}
        if delta.get("content"):
            self._content.append(delta["content"])
        if delta.get("refusal"):
            self._refusal.append(delta["refusal"])
        for call in delta.get("tool_calls") or []:
            self._tool_call(call)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]

    def _tool_call(self, fragment: dict[str, Any]) -> None:
        index = int(fragment.get("index", len(self._tool_calls)))
        call = self._tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if fragment.get("id"):
            call["id"] = fragment["id"]
        if fragment.get("type"):
            call["type"] = fragment["type"]
        function = fragment.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]
