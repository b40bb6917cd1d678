"""The assistant's reply, rebuilt from an upstream answer so that it can be stored.

A non-stream answer carries the message whole (`from_completion`). A stream carries it in
deltas: `StreamedReply.feed(bytes)` takes the raw SSE bytes as they are relayed, in whatever
pieces the network delivers, and rebuilds content, refusal and tool calls (whose arguments
arrive in fragments keyed by index). `complete` says whether the stream reached its end: a
finish_reason or `[DONE]`; a stream cut before that yields a reply marked incomplete.
Only the first choice is stored: memory follows one line of conversation.
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
    content = message.get("content")
    if not (content is None or isinstance(content, str | list)):
        content = json.dumps(content, ensure_ascii=False)
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls and all(isinstance(call, dict) for call in calls):
        reply["tool_calls"] = calls
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        reply["refusal"] = refusal
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
            return  # a keep-alive or garbage: nothing of the message
        # Usage-only chunks, errors and chunks of any other shape hold nothing of the message.
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        choice = choices[0] if isinstance(choices, list) and choices else None
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if isinstance(content := delta.get("content"), str):
                self._content.append(content)
            if isinstance(refusal := delta.get("refusal"), str):
                self._refusal.append(refusal)
            calls = delta.get("tool_calls")
            for call in calls if isinstance(calls, list) else []:
                if isinstance(call, dict):
                    self._tool_call(call)
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
