"""Chain hashes: what identifies a message, and the path before it.

A message's chain hash is sha256 over its parent's chain hash and the message's
canonical form (`canonical`), so the hash of a message stands for the whole path before it.
Two messages are the same when their canonical forms are equal: role, `name`, content,
tool calls and `tool_call_id` (and the deprecated `function_call`), where

* content `null`, `""` and `[]` are alike, and a list of text parts is the string of their
  texts joined by newlines (the other keys of a text part are left out); a list holding other
  parts keeps them, compared as JSON;
* a tool call is its `id`, function name and arguments, the arguments compared as parsed JSON
  (`{"x":1}` and `{"x": 1}` are alike; arguments that do not parse are compared as written),
  their numbers as JavaScript reads them, doubles (`{"x": 2.0}` and `{"x":2}` are alike: a
  JavaScript client that keeps the arguments parsed writes the one back as the other);
* field order never matters, and fields a client may add or drop when it resends a message it
  received (`refusal`, `annotations`, `audio`, `reasoning_content`, a tool call's `type`) are
  left out.

`content_hash(content)` fingerprints a content alone in the same canonical form: a conversation
keeps the one of its newest system prompt (`system_hash`) to recognise a client that repeats it.
"""

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

ROOT_HASH = ""
"""The parent of a conversation's first message."""

SYSTEM_ROLES: Final = ("system", "developer")
"""The roles of a client's system prompt."""


def canonical(message: Mapping[str, Any]) -> dict[str, Any]:
    """What identifies a message (see the module docstring)."""
    found: dict[str, Any] = {
        "role": message.get("role"),
        "name": message.get("name") or None,
        "content": canonical_content(message.get("content")),
        "tool_calls": [_call(call) for call in message.get("tool_calls") or []],
        "tool_call_id": message.get("tool_call_id"),
    }
    legacy = message.get("function_call")
    if isinstance(legacy, Mapping):
        found["function_call"] = _function(legacy)
    return found


def canonical_content(content: Any) -> Any:
    """A message's content in canonical form: no content is `""`, text parts are a string."""
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    texts = [_text_of(part) for part in content]
    if all(text is not None for text in texts):
        return "\n".join(text for text in texts if text is not None)
    return [
        part if text is None else {"type": "text", "text": text}
        for part, text in zip(content, texts, strict=True)
    ]


def _text_of(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, Mapping) and part.get("type") == "text":
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        return {"raw": call}
    function = call.get("function")
    return {"id": call.get("id"), **_function(function if isinstance(function, Mapping) else {})}


def _function(function: Mapping[str, Any]) -> dict[str, Any]:
    written = function.get("arguments")
    try:
        arguments = _as_doubles(json.loads(written) if isinstance(written, str) else written)
    except (ValueError, RecursionError):  # not JSON, or nested past what Python reads: as written
        arguments = written
    return {"name": function.get("name"), "arguments": arguments}


def _as_doubles(value: Any) -> Any:
    """`value` with its numbers as doubles, written without a fraction when they have none
    (`2.0`, `2` and `2e0` alike, and the integers a double cannot tell apart)."""
    if isinstance(value, dict):
        return {key: _as_doubles(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_doubles(item) for item in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            double = float(value)
        except OverflowError:  # an integer past any double: as written
            return value
        return int(double) if double.is_integer() else double
    return value


def canonical_json(value: Any) -> bytes:
    """`value` as sorted, compact JSON in UTF-8: the bytes a hash is taken over."""
    # surrogatepass: an upstream's reply may hold an unpaired surrogate (stored escaped, still
    # hashed as it came); for any other text it is plain UTF-8.
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def content_hash(content: Any) -> str:
    """A fingerprint of a message's content (a string or a list of parts), canonical."""
    return hashlib.sha256(canonical_json(canonical_content(content))).hexdigest()


def chain_hash(parent: str, message: Mapping[str, Any]) -> str:
    """The chain hash of `message` following a message whose chain hash is `parent`."""
    role, name, content = message.get("role"), message.get("name"), message.get("content")
    tool_call_id = message.get("tool_call_id")
    if (
        isinstance(role, str)
        and (content is None or (isinstance(content, str) and len(content) < _KEPT_TEXT))
        and (name is None or isinstance(name, str))
        and (tool_call_id is None or isinstance(tool_call_id, str))
        and not message.get("tool_calls")
        and not isinstance(message.get("function_call"), Mapping)
    ):
        # Nothing else of such a message is in its canonical form (`canonical`).
        return _text_hash(parent, role, name or None, content, tool_call_id)
    return _hash(parent, message)


_KEPT_TEXT = 1_024
"""Text messages shorter than this keep their chain hash (`_text_hash`): a client resends its
whole history with each message, and each of them was hashed, after the same parent, the turn
before."""


@functools.lru_cache(maxsize=8_192)
def _text_hash(
    parent: str, role: str, name: str | None, content: str | None, tool_call_id: str | None
) -> str:
    return _hash(
        parent, {"role": role, "name": name, "content": content, "tool_call_id": tool_call_id}
    )


def _hash(parent: str, message: Mapping[str, Any]) -> str:
    return hashlib.sha256(f"{parent}\n".encode() + canonical_json(canonical(message))).hexdigest()


def chain(messages: Sequence[Mapping[str, Any]], parent: str = ROOT_HASH) -> list[str]:
    """Chain hashes of `messages`, the first one following `parent`."""
    hashes: list[str] = []
    for message in messages:
        parent = chain_hash(parent, message)
        hashes.append(parent)
    return hashes


def after_head(hashes: Sequence[str], head: str | None) -> int | None:
    """Where the new messages start, or None when the history does not contain the head."""
    if head is None:
        return 0
    try:
        return hashes.index(head) + 1
    except ValueError:
        return None
