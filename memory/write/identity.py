"""Which conversation a request belongs to: conversation ids and message hash chains.

A message's chain hash is sha256 over its parent's chain hash and the message's identity
(role, name, content, tool calls, tool_call_id) in canonical JSON, so the hash of the last
message stands for the whole history before it. A conversation stores the hash of its newest
message (`head_hash`); an incoming history that contains that hash extends the conversation,
and only the messages after it are new. Fields a client may add or drop when it resends a
message it received (`refusal`, `annotations`, `audio`, a null `content` vs ``""``) are left
out of the hash so that resending the SDK's own objects still matches.

`content_hash(content)` fingerprints a message's content alone: a conversation keeps the one of
its newest system prompt (`system_hash`) to recognise a client that repeats it.
"""

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from memory.errors import InvalidConversationId

_CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ROOT_HASH = ""


def validate_conversation_id(value: str) -> str:
    """Return `value` if it is a valid conversation id, else raise `InvalidConversationId`."""
    if not _CONVERSATION_ID.fullmatch(value):
        raise InvalidConversationId(
            "conversation id must be 1-128 characters of A-Z a-z 0-9 . _ : -",
            param="X-Memstrata-Conversation",
        )
    return value


def new_conversation_id() -> str:
    """A fresh conversation id for a history that matches no stored conversation."""
    return f"conv-{uuid.uuid4().hex}"


def _identity(message: Mapping[str, Any]) -> dict[str, Any]:
    tool_calls = [
        {
            "id": call.get("id"),
            "name": (call.get("function") or {}).get("name"),
            "arguments": (call.get("function") or {}).get("arguments"),
        }
        for call in message.get("tool_calls") or []
    ]
    return {
        "role": message.get("role"),
        "name": message.get("name"),
        "content": message.get("content") or "",
        "tool_calls": tool_calls,
        "tool_call_id": message.get("tool_call_id"),
    }


def content_hash(content: Any) -> str:
    """A fingerprint of a message's content (a string or a list of parts)."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def chain_hash(parent: str, message: Mapping[str, Any]) -> str:
    """The chain hash of `message` following a message whose chain hash is `parent`."""
    canonical = json.dumps(_identity(message), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{parent}\n{canonical}".encode()).hexdigest()


def chain(messages: Sequence[Mapping[str, Any]], parent: str = ROOT_HASH) -> list[str]:
    """Chain hashes of `messages`, the first one following `parent`."""
    hashes: list[str] = []
    for message in messages:
        parent = chain_hash(parent, message)
        hashes.append(parent)
    return hashes
