"""Server-sent events: reading an upstream stream event by event, and merging the streams of
several upstream rounds into the one stream a client sees.

`interrupted` logs an upstream stream cut short and makes the error event the client is sent;
`parsed_json` reads a body or an event's data that may not be JSON.

`EventReader.feed(bytes)` yields whole `Event`s (the raw bytes, terminator included, and the
joined `data:` payload) in whatever pieces the network delivers; `\\n`, `\\r\\n` and `\\r` line
ends are all understood.

`MergedStream` serves the memory-tool loop (`gateway.openai.toolloop`): each upstream round is read
through `MergedStream.round(final=...)`, whose `event()` returns what the client must see of
each event (often the raw bytes unchanged, sometimes a rewritten chunk, sometimes nothing):

* one stream: every chunk carries the first round's completion `id`, `created` and `model` (a
  later round is another completion upstream, made seconds later); the assistant `role` is
  announced once; `[DONE]` is sent once, at the very end (`MergedStream.done()`);
* content is relayed as it comes, in every round;
* calls to memory tools (`memory.recall.tools.TOOL_NAMES`) never reach the client: their fragments
  are kept by the round to be run; calls to the client's own tools pass through, renumbered
  `0, 1, …` in the order they appear, ids and arguments untouched;
* a round that asked only for memory tools (and is not the last allowed) has its
  `finish_reason` and its usage chunk held back: the loop runs the tools and the next round
  continues the same stream; the usage the client finally sees is the sum of all rounds';
* a `finish_reason` of `tool_calls` whose calls were all memory calls becomes `stop`;
* with `hide_usage` (the gateway asked for the usage, the client did not), the usage-only
  chunk is not sent; `MergedStream.total` is the usage summed over the rounds either way.

`MergedStream.reply` rebuilds, from exactly the bytes the client was sent, the reply to record.
"""

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gateway.errors import error_body
from gateway.openai.replies import StreamedReply
from memory.recall.tools import TOOL_NAMES

log = logging.getLogger(__name__)

# What makes the chunks of a stream one completion's.
_IDENTITY = ("id", "created", "model")
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(rb"\r\n|\n|\r")


@dataclass(frozen=True)
class Event:
    """One server-sent event: its raw bytes and its data (None for comments and the like)."""

    raw: bytes
    data: str | None


class EventReader:
    """Splits a byte stream into events."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> Iterator[Event]:
        self._buffer += data
        while (end := _EVENT_END.search(self._buffer)) is not None:
            raw, self._buffer = self._buffer[: end.end()], self._buffer[end.end() :]
            yield _event(raw)

    def close(self) -> Iterator[Event]:
        """What is left when the stream ends without a final blank line."""
        if self._buffer.strip():
            yield _event(self._buffer + b"\n\n")
        self._buffer = b""


def _event(raw: bytes) -> Event:
    data = [line[5:].removeprefix(b" ") for line in _LINE.split(raw) if line.startswith(b"data:")]
    return Event(raw=raw, data=b"\n".join(data).decode(errors="replace") if data else None)


def data_event(payload: Any) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def sse_error(message: str, *, code: str | None, type: str = "upstream_error") -> bytes:
    """An error event in a stream, as OpenAI sends one (the SDK raises `APIError` on it)."""
    return data_event(error_body(message, type=type, code=code))


def interrupted(cause: str, *, conversation: str) -> bytes:
    """Log an upstream stream cut short (`cause`), and the error event that tells the client,
    whose partial reply is kept."""
    log.warning("upstream stream interrupted: %s", cause, extra={"conversation": conversation})
    return sse_error(
        f"the upstream stream was interrupted ({cause}); the partial reply was kept",
        code="upstream_stream_interrupted",
    )


def parsed_json(content: bytes | str) -> Any:
    """`content` as JSON, or None when it is not."""
    try:
        return json.loads(content)
    except ValueError:
        return None


def add_usage(total: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    """`total` plus `usage`, field by field (nested token details included)."""
    if not isinstance(usage, dict):
        return total
    merged: dict[str, Any] = dict(total or {})
    for key, value in usage.items():
        if isinstance(value, bool):
            merged.setdefault(key, value)
        elif isinstance(value, int | float):
            previous = merged.get(key)
            merged[key] = value + (previous if isinstance(previous, int | float) else 0)
        elif isinstance(value, dict):
            previous = merged.get(key)
            merged[key] = add_usage(previous if isinstance(previous, dict) else None, value)
        else:
            merged.setdefault(key, value)
    return merged


def usage_of(event: Event) -> dict[str, Any] | None:
    """The usage a usage-only chunk (`choices: []`) carries, else None."""
    if event.data is None or '"usage"' not in event.data:
        return None
    try:
        chunk = json.loads(event.data)
    except ValueError:
        return None
    if not isinstance(chunk, dict) or chunk.get("choices") != []:
        return None
    usage = chunk.get("usage")
    if not isinstance(usage, dict):
        return None
    found: dict[str, Any] = usage
    return found


def is_memory_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and _is_memory_name(function.get("name"))


def _is_memory_name(name: Any) -> bool:
    # An upstream may name a call with anything (a list is unhashable): only a string names
    # a memory tool, anything else is relayed as it came.
    return isinstance(name, str) and name in TOOL_NAMES


class MergedStream:
    """Several upstream rounds as one client stream (see the module docstring)."""

    def __init__(self, *, hide_usage: bool = False) -> None:
        self.reply = StreamedReply()
        self.hide_usage = hide_usage
        self.usage: dict[str, Any] | None = None  # of the rounds already over
        self.total: dict[str, Any] | None = None  # of every round, once the last is over
        # The first chunk's `id`, `created` and `model`: every chunk carries them.
        self.identity: dict[str, Any] | None = None
        self.role_sent = False
        self.ended = False  # the last round ended with [DONE]

    def round(self, *, final: bool) -> "Round":
        return Round(self, final=final)

    def done(self) -> bytes:
        """The closing `[DONE]`, if the last round ended with one."""
        return self.send(b"data: [DONE]\n\n") if self.ended else b""

    def send(self, data: bytes) -> bytes:
        self.reply.feed(data)
        return data


class Round:
    """One upstream round of a `MergedStream`."""

    def __init__(self, stream: MergedStream, *, final: bool) -> None:
        self._stream = stream
        self._final = final
        self._content: list[str] = []
        self._memory: dict[int, dict[str, Any]] = {}  # upstream index → the call so far
        self._client: dict[int, int] = {}  # upstream index → index the client sees
        self._usage: dict[str, Any] | None = None
        self.done = False
        self.finish_reason: str | None = None

    @property
    def wants_memory(self) -> bool:
        """Whether the round asks for memory tools only (and may: it is not the last)."""
        return bool(self._memory) and not self._client and not self._final

    @property
    def continues(self) -> bool:
        """Whether the round is over, asking for memory tools only: another must follow."""
        return self.wants_memory and (self.finish_reason is not None or self.done)

    def end(self) -> None:
        """The upstream stream of this round is over."""
        if self.continues:
            self._stream.usage = add_usage(self._stream.usage, self._usage)
        else:
            self._stream.ended = self.done
            self._stream.total = add_usage(self._stream.usage, self._usage)

    def assistant_message(self) -> dict[str, Any]:
        """The round's reply as the next upstream request must repeat it."""
        return {
            "role": "assistant",
            "content": "".join(self._content) or None,
            "tool_calls": self.memory_calls(),
        }

    def memory_calls(self) -> list[dict[str, Any]]:
        """The memory calls of the round, in order (`id` None if the upstream sent none)."""
        return [self._memory[index] for index in sorted(self._memory)]

    def event(self, event: Event) -> bytes:
        """What the client is sent of `event` (b"" for nothing)."""
        if event.data is None:
            return self._stream.send(event.raw)
        if event.data.strip() == "[DONE]":
            self.done = True
            return b""
        try:
            chunk = json.loads(event.data)
        except ValueError:
            return self._stream.send(event.raw)
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
            return self._stream.send(event.raw)  # an error event, or something unknown
        changed = self._rewrite(chunk)
        if changed is None:
            return b""
        return self._stream.send(data_event(chunk) if changed else event.raw)

    def _rewrite(self, chunk: dict[str, Any]) -> bool | None:
        """Rewrite `chunk` in place: True if changed, False if not, None to drop it."""
        changed = False
        stream = self._stream
        if stream.identity is None:
            stream.identity = {key: chunk[key] for key in _IDENTITY if key in chunk}
        else:
            for key, value in stream.identity.items():
                if chunk.get(key) != value:
                    chunk[key] = value
                    changed = True
        usage = chunk.get("usage")
        if usage:
            # Held back until the last round, which shows the sum of all of them.
            self._usage = add_usage(self._usage, usage)
            if self.wants_memory:
                chunk["usage"] = None
                changed = True
            elif stream.usage is not None:
                chunk["usage"] = add_usage(stream.usage, usage)
                changed = True
        choices = chunk["choices"]
        if not choices:
            return None if self.wants_memory or (usage and stream.hide_usage) else changed
        choice = choices[0]
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return changed
        delta = choice.get("delta")
        if isinstance(delta, dict):
            changed |= self._delta(delta)
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self.finish_reason = reason
            if self.wants_memory:
                choice["finish_reason"] = None
                changed = True
            elif reason == "tool_calls" and not self._client:
                choice["finish_reason"] = "stop"
                changed = True
        if changed and _empty(choice) and not chunk.get("usage"):
            return None
        return changed

    def _delta(self, delta: dict[str, Any]) -> bool:
        changed = False
        if "role" in delta:
            if self._stream.role_sent:
                del delta["role"]
                changed = True
            self._stream.role_sent = True
        if isinstance(delta.get("content"), str):
            self._content.append(delta["content"])
        fragments = delta.get("tool_calls")
        if isinstance(fragments, list) and fragments:
            shown = [f for f in (self._fragment(f) for f in fragments) if f is not None]
            if shown != fragments:
                changed = True
                if shown:
                    delta["tool_calls"] = shown
                else:
                    del delta["tool_calls"]
        return changed

    def _fragment(self, fragment: Any) -> Any:
        """The fragment as the client sees it, or None for a memory call's."""
        index = fragment.get("index", 0) if isinstance(fragment, dict) else None
        if not isinstance(index, int) or isinstance(index, bool):
            return fragment  # malformed: relayed as it came, nothing of a memory call
        if index not in self._memory and index not in self._client:
            function = fragment.get("function") or {}
            if isinstance(function, dict) and _is_memory_name(function.get("name")):
                self._memory[index] = {
                    "id": None,
                    "type": "function",
                    "function": {"name": "", "arguments": ""},
                }
            else:
                self._client[index] = len(self._client)
        if index in self._memory:
            call = self._memory[index]
            if isinstance(fragment.get("id"), str) and fragment["id"]:
                call["id"] = fragment["id"]
            function = fragment.get("function")
            if isinstance(function, dict):
                for key in ("name", "arguments"):
                    if isinstance(value := function.get(key), str):
                        call["function"][key] += value
            return None
        if self._client[index] == index:
            return fragment
        return {**fragment, "index": self._client[index]}


def _empty(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    if not isinstance(delta, dict):
        return False
    return (
        choice.get("finish_reason") is None
        and choice.get("logprobs") is None
        and all(value is None or value == [] for value in delta.values())
    )
