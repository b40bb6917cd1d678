"""The memory tools: what a model (or an MCP client) may call to read memory beyond its prompt.

Four tools (SPEC §7), offered to the model in OpenAI's function-tool format (`definitions()`,
whose prompt cost `tool_tokens(model)` tells) and served over MCP with the same meaning:
`memory_expand(node_id)`, `memory_search(query, limit)`, `memory_browse(level, start, end)`
and `memory_find(pattern, start_seq, end_seq)`; their bodies are in `memory.recall.browsing`.

`call` runs one call as a model makes it (arguments as a JSON text or object, leniently read:
`"812"`, `"#812"` and `"[#812]"` all name node 812) in a `Scope` (`scope_for` builds a request's:
its conversation and the ones cross-conversation recall reaches), raising `InvalidInput`,
`NotFound` or `PatternRejected`. `run_tool`, what the gateway's tool loop calls, turns those into
an `error: …` result instead, because a bad call is the model's mistake to correct, not a
failure of the client's request.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import tokens
from memory.embeddings import Embedder
from memory.errors import InvalidInput, MemstrataError
from memory.recall.browsing import (
    DEFAULT_LIMITS,
    DEFAULT_SEARCH_LIMIT,
    MAX_BROWSE,
    MAX_MATCHES,
    MAX_PATTERN_CHARS,
    MAX_QUERY_CHARS,
    MAX_SEARCH,
    Limits,
    Scope,
    browse,
    expand,
    find,
    search,
)
from memory.recall.recall_note import related_conversations
from memory.schema import conversations

__all__ = [
    "MAX_BROWSE",
    "MAX_MATCHES",
    "MAX_PATTERN_CHARS",
    "MAX_QUERY_CHARS",
    "MAX_SEARCH",
    "TOOL_NAMES",
    "Limits",
    "Scope",
    "call",
    "definitions",
    "run_tool",
    "scope_for",
    "tool_tokens",
]

TOOL_NAMES: Final = frozenset({"memory_expand", "memory_search", "memory_browse", "memory_find"})

DESCRIPTIONS: Final[Mapping[str, str]] = {
    "memory_expand": (
        "Open a [#id] of memory: a summary shows what it summarizes, a message its neighbours."
    ),
    "memory_search": "Search the whole history (messages and summaries) by meaning and words.",
    "memory_browse": (
        "List one memory level in order: 0 = messages by seq; 1+ = summaries, numbered from 0."
    ),
    "memory_find": "Find messages matching a regex ((?i) ignores case), optionally by seq range.",
}
"""Short on purpose: the definitions are reserved out of every prompt's budget (`tool_tokens`)."""

_PARAMETERS: Final[Mapping[str, dict[str, Any]]] = {
    "memory_expand": {
        "properties": {"node_id": {"type": "integer", "description": "812 for [#812]."}},
        "required": ["node_id"],
    },
    "memory_search": {
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer", "description": f"1-{MAX_SEARCH}"},
        },
        "required": ["query"],
    },
    "memory_browse": {
        "properties": {
            "level": {"type": "integer"},
            "start": {"type": "integer"},
            "end": {"type": "integer", "description": f"inclusive, at most {MAX_BROWSE} nodes"},
        },
        "required": ["level"],
    },
    "memory_find": {
        "properties": {
            "pattern": {"type": "string"},
            "start_seq": {"type": "integer"},
            "end_seq": {"type": "integer", "description": "inclusive"},
        },
        "required": ["pattern"],
    },
}


async def scope_for(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    cross_conversation: bool,
    abandoned_branches: bool = False,
) -> Scope:
    """The scope of a request in `conversation_id`: with cross-conversation recall, also the
    tenant's other conversations of the same OpenAI `user`, most recent first (as many as the
    prompt builder searches), so that every `[#id]` its memory block shows can be expanded;
    with `abandoned_branches`, messages off the current branches too."""
    recall: tuple[int, ...] = ()
    if cross_conversation:
        user = await conn.scalar(
            select(conversations.c.user_id).where(
                conversations.c.id == conversation_id, conversations.c.tenant_id == tenant_id
            )
        )
        recall = tuple(
            await related_conversations(
                conn, tenant_id=tenant_id, conversation_id=conversation_id, user=user
            )
        )
    return Scope(
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        recall=recall,
        abandoned=abandoned_branches,
    )


def definitions() -> list[dict[str, Any]]:
    """The four tools in OpenAI's `tools` format (a fresh copy each call)."""
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": DESCRIPTIONS[name],
                "parameters": {
                    "type": "object",
                    **json.loads(json.dumps(_PARAMETERS[name])),
                    "additionalProperties": False,
                },
            },
        }
        for name in ("memory_expand", "memory_search", "memory_browse", "memory_find")
    ]


@functools.lru_cache(maxsize=16)
def _tool_tokens(encoding: str) -> int:
    text = json.dumps(definitions(), ensure_ascii=False, separators=(",", ":"))
    return tokens.count_text(text, model="gpt-4o" if encoding == "o200k_base" else "gpt-4")


def tool_tokens(model: str) -> int:
    """Prompt tokens the tool definitions cost with `model` (their compact JSON, more than the
    TypeScript-like form providers render them in): what the prompt builder should reserve
    when they are offered."""
    return _tool_tokens(tokens.encoding_name_for_model(model))


# -- the entry point of the tool loop ----------------------------------------------------------


async def run_tool(
    conn: AsyncConnection,
    scope: Scope,
    *,
    name: str,
    arguments: str | Mapping[str, Any] | None,
    embedder: Embedder,
    limits: Limits = DEFAULT_LIMITS,
) -> str:
    """Run one call as the model made it; a mistake becomes an `error: …` result."""
    try:
        return await call(
            conn, scope, name=name, arguments=arguments, embedder=embedder, limits=limits
        )
    except MemstrataError as exc:
        return f"error: {exc}"


async def call(
    conn: AsyncConnection,
    scope: Scope,
    *,
    name: str,
    arguments: str | Mapping[str, Any] | None,
    embedder: Embedder,
    limits: Limits = DEFAULT_LIMITS,
) -> str:
    """Run one call with raw arguments (a JSON object, as text or parsed): `InvalidInput` for
    bad ones, `NotFound` for a node out of reach, `PatternRejected` for a costly pattern."""
    args = _arguments(arguments)
    if name == "memory_expand":
        return await expand(conn, scope, node_id=_int(args, "node_id"), limits=limits)
    if name == "memory_search":
        return await search(
            conn,
            scope,
            query=_str(args, "query"),
            limit=_int(args, "limit", DEFAULT_SEARCH_LIMIT),
            embedder=embedder,
            limits=limits,
        )
    if name == "memory_browse":
        return await browse(
            conn,
            scope,
            level=_int(args, "level"),
            start=_int(args, "start", 0),
            end=_optional_int(args, "end"),
            limits=limits,
        )
    if name == "memory_find":
        return await find(
            conn,
            scope,
            pattern=_str(args, "pattern"),
            start_seq=_optional_int(args, "start_seq"),
            end_seq=_optional_int(args, "end_seq"),
            limits=limits,
        )
    raise InvalidInput(f"there is no tool {name!r}; use one of {', '.join(sorted(TOOL_NAMES))}")


def _arguments(raw: str | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return raw
    if not isinstance(raw, str):  # what an upstream relays is any JSON value
        raise InvalidInput("the arguments must be a JSON object")
    try:
        parsed = json.loads(raw)
    except ValueError as exc:
        raise InvalidInput(f"the arguments are not valid JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise InvalidInput("the arguments must be a JSON object")
    return parsed


_INTEGER: Final = re.compile(r"-?[0-9]{1,30}")


def _optional_int(args: Mapping[str, Any], key: str) -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInput(f"{key} must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        # Models copy tags: "812", "#812" and "[#812]" all mean node 812. ASCII digits only,
        # and few: `int()` refuses "--5", "²" and numbers of more than 4,300 digits.
        cleaned = value.strip().strip("[]").lstrip("#").strip()
        if _INTEGER.fullmatch(cleaned):
            return int(cleaned)
    raise InvalidInput(f"{key} must be an integer, got {value!r}")


def _int(args: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = _optional_int(args, key)
    if value is not None:
        return value
    if default is None:
        raise InvalidInput(f"{key} is required")
    return default


def _str(args: Mapping[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InvalidInput(f"{key} is required and must be a non-empty string")
    return value
