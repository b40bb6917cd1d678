"""What the fake upstream (`devkit.upstream_server`) answers: scripted behaviours and helpers.

`validate_behaviour()` checks one behaviour, `UpstreamState` holds the queue, the default, the
recorded requests and the prompt cache (`cached_tokens`); `error_body()` is OpenAI's error
shape; `last_user_text()`, `content_text()`, `word_count()` and `split_words()` read and cut
text; `embedding_vector()` is the deterministic unit vector the server answers for a text
(tests compare against it).

A behaviour is a JSON object with any of these keys (unknown keys are rejected with 400):

* ``status`` (int), ``body`` (JSON value or string), ``headers`` (object of strings): when
  ``status >= 400`` or ``body`` is present the server answers exactly that (``body`` defaults
  to an OpenAI error body matching ``status``; ``status`` defaults to 200; a string body is
  sent as ``text/plain``). ``headers`` are added to every kind of answer.
* ``sse`` (list of strings): answer ``200 text/event-stream`` with one ``data: ITEM`` event per
  item, exactly as given (for malformed streams; add ``"[DONE]"`` to end it properly).
* ``delay`` (seconds): sleep before answering (on top of the server's ``latency``).
* ``chunk_delay`` (seconds): overrides the server's chunk delay for this stream.
* ``reply`` (str): the assistant content instead of the echo.
* ``tool_calls``: list of ``{"name": str, "arguments": object | str, "id"?: str}``.
* ``finish_reason`` (str): overrides ``"stop"`` / ``"tool_calls"``.
* ``cut_after`` (int): stream -- send that many content/tool chunks (at most all of them),
  then close the TCP connection without the terminating chunk, the finish chunk or ``[DONE]``
  (the client sees an incomplete chunked body); non-stream (and non-chat) -- close the
  connection without any response.
* ``match`` (str): the behaviour only applies to a request whose match text contains it
  (chat: text of the last user message; embeddings: the inputs joined by newlines;
  models: ``""``).
* ``path`` (str): the behaviour only applies to requests on exactly this path.

Queue semantics: strict FIFO. Each ``/v1`` request looks only at the head of the queue; if the
head applies (its ``match`` / ``path`` filters pass) it is popped and used, otherwise the head
stays queued and the default behaviour is used. The default itself is subject to its own
``match`` / ``path`` filters (if they fail, the plain echo behaviour is used).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

Behaviour = dict[str, Any]

_MAX_PREFIXES: Final = 1_000_000

DEFAULT_EMBEDDING_DIMENSIONS: Final = 384

_ERROR_TYPES: Final[dict[int, tuple[str, str | None]]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", None),
    409: ("invalid_request_error", None),
    422: ("invalid_request_error", None),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", None),
    502: ("server_error", None),
    503: ("server_error", None),
}

_BEHAVIOUR_KEYS: Final = frozenset(
    {
        "status",
        "body",
        "sse",
        "headers",
        "delay",
        "chunk_delay",
        "reply",
        "tool_calls",
        "finish_reason",
        "cut_after",
        "match",
        "path",
    }
)


class BehaviourError(ValueError):
    """A scripted behaviour is malformed."""


def error_body(
    message: str, *, status: int = 400, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-shaped error body for ``status``."""
    err_type, default_code = _ERROR_TYPES.get(
        status, ("server_error" if status >= 500 else "invalid_request_error", None)
    )
    return {
        "error": {
            "message": message,
            "type": err_type,
            "param": param,
            "code": code if code is not None else default_code,
        }
    }


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate_behaviour(raw: object) -> Behaviour:
    """Check a behaviour object and return a copy; raise :class:`BehaviourError` if malformed."""
    if not isinstance(raw, dict):
        raise BehaviourError(f"a behaviour must be a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _BEHAVIOUR_KEYS)
    if unknown:
        raise BehaviourError(f"unknown behaviour keys {unknown}; known: {sorted(_BEHAVIOUR_KEYS)}")
    if "status" in raw and not (
        isinstance(raw["status"], int)
        and not isinstance(raw["status"], bool)
        and 100 <= raw["status"] <= 599
    ):
        raise BehaviourError("'status' must be an int in 100..599")
    if "headers" in raw and not (
        isinstance(raw["headers"], dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in raw["headers"].items())
    ):
        raise BehaviourError("'headers' must be an object of strings")
    if "sse" in raw and not (
        isinstance(raw["sse"], list) and all(isinstance(item, str) for item in raw["sse"])
    ):
        raise BehaviourError("'sse' must be a list of strings")
    for key in ("delay", "chunk_delay"):
        if key in raw and not (is_number(raw[key]) and raw[key] >= 0):
            raise BehaviourError(f"'{key}' must be a number >= 0")
    if "cut_after" in raw and not (
        isinstance(raw["cut_after"], int)
        and not isinstance(raw["cut_after"], bool)
        and raw["cut_after"] >= 0
    ):
        raise BehaviourError("'cut_after' must be an int >= 0")
    for key in ("reply", "finish_reason", "match", "path"):
        if key in raw and not isinstance(raw[key], str):
            raise BehaviourError(f"'{key}' must be a string")
    if "tool_calls" in raw:
        calls = raw["tool_calls"]
        if not isinstance(calls, list) or not calls:
            raise BehaviourError("'tool_calls' must be a non-empty list")
        for call in calls:
            if not (
                isinstance(call, dict)
                and isinstance(call.get("name"), str)
                and set(call) <= {"name", "arguments", "id"}
                and isinstance(call.get("arguments", {}), dict | str)
                and isinstance(call.get("id", ""), str)
            ):
                raise BehaviourError(
                    "each tool call must be {'name': str, 'arguments': object|str, 'id'?: str}"
                )
    return dict(raw)


def content_text(content: object) -> str:
    """Text of a message ``content`` (a string or a list of content parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def last_user_text(body: Mapping[str, Any]) -> str:
    """Text of the last ``user`` message of a chat completion request (``""`` if none)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return content_text(message.get("content"))
    return ""


def word_count(text: str) -> int:
    return len(text.split())


def split_words(text: str) -> list[str]:
    """Split ``text`` into word pieces whose concatenation is exactly ``text``."""
    pieces: list[str] = re.findall(r"\s*\S+", text)
    if not pieces:
        return [text]
    consumed = sum(len(piece) for piece in pieces)
    pieces[-1] += text[consumed:]
    return pieces


def embedding_vector(text: str, dimensions: int) -> list[float]:
    """A deterministic unit vector for ``text`` (seeded by its SHA-256)."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    rng = random.Random(seed)
    vector = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


class UpstreamState:
    """Mutable in-memory state: recorded requests, the behaviour queue and the default."""

    def __init__(self, *, chunk_delay: float, latency: float, max_recorded: int) -> None:
        self.chunk_delay = chunk_delay
        self.latency = latency
        self.requests: deque[dict[str, Any]] = deque(maxlen=max_recorded)
        self.queue: deque[Behaviour] = deque()
        self.default: Behaviour = {}
        self.prefixes: set[bytes] = set()

    def cached_tokens(self, messages: list[Any], counts: list[int]) -> int:
        """A provider's prompt cache, by whole messages: the tokens (`counts`, per message) of
        the longest run of leading messages, byte for byte as received, that an earlier prompt
        began with; this prompt's prefixes are remembered for the next. (No minimum length:
        OpenAI caches from 1,024 tokens on, in steps of 128.)"""
        if len(self.prefixes) > _MAX_PREFIXES:
            self.prefixes.clear()
        digest, cached, total = b"", 0, 0
        for message, count in zip(messages, counts, strict=True):
            raw = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
            digest = hashlib.blake2b(digest + raw.encode(), digest_size=16).digest()
            total += count
            if digest in self.prefixes:
                cached = total
            self.prefixes.add(digest)
        return cached

    @staticmethod
    def _applies(behaviour: Behaviour, path: str, match_text: str) -> bool:
        if "path" in behaviour and behaviour["path"] != path:
            return False
        return "match" not in behaviour or behaviour["match"] in match_text

    def next_behaviour(self, path: str, match_text: str) -> Behaviour:
        """Pop the queue head if it applies, else return the default (or ``{}``)."""
        if self.queue and self._applies(self.queue[0], path, match_text):
            return self.queue.popleft()
        if self._applies(self.default, path, match_text):
            return dict(self.default)
        return {}

    def reset(self) -> None:
        self.requests.clear()
        self.queue.clear()
        self.default = {}
        self.prefixes.clear()
