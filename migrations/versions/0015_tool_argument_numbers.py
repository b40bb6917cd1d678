"""Chain hashes compare the numbers of tool-call arguments as doubles (`memory.write.chains`):
`{"x": 2.0}` and `{"x":2}` are one message, as a JavaScript client writes the one back as the
other.

The hashes that change are recomputed for existing data, so that existing conversations keep
matching: in each conversation holding a tool call, a message whose canonical form changes and
every message chained after it (following `follows_seq` across branches); then the
conversation's head and the responses that ended at a changed hash. A message whose form and
parent are unchanged keeps its hash (one stored escaped included: its original text is not
stored, only the hash over it). The formulas are copied from `memory.write.chains` (a migration
must not change when that module does); the downgrade puts back the previous ones.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27 23:00:00.000000
"""

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_MESSAGE_FIELDS = ("role", "name", "content", "tool_calls", "tool_call_id")

# -- the canonical form (memory.write.chains, revision 0014 and this one) -----------------------


def _canonical_content(content: Any) -> Any:
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


def _as_doubles(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _as_doubles(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_doubles(item) for item in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            double = float(value)
        except OverflowError:
            return value
        return int(double) if double.is_integer() else double
    return value


def _arguments(written: Any, *, doubles: bool) -> Any:
    try:
        parsed = json.loads(written) if isinstance(written, str) else written
        return _as_doubles(parsed) if doubles else parsed
    except (ValueError, RecursionError):
        return written


def _canonical(message: Mapping[str, Any], *, doubles: bool) -> dict[str, Any]:
    def function(raw: Any) -> dict[str, Any]:
        found = raw if isinstance(raw, Mapping) else {}
        arguments = _arguments(found.get("arguments"), doubles=doubles)
        return {"name": found.get("name"), "arguments": arguments}

    def call(raw: Any) -> dict[str, Any]:
        if not isinstance(raw, Mapping):
            return {"raw": raw}
        return {"id": raw.get("id"), **function(raw.get("function"))}

    found: dict[str, Any] = {
        "role": message.get("role"),
        "name": message.get("name") or None,
        "content": _canonical_content(message.get("content")),
        "tool_calls": [call(raw) for raw in message.get("tool_calls") or []],
        "tool_call_id": message.get("tool_call_id"),
    }
    legacy = message.get("function_call")
    if isinstance(legacy, Mapping):
        found["function_call"] = function(legacy)
    return found


def _canonical_json(value: Any) -> bytes:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "surrogatepass")


def _hash(parent: str, canonical: Any) -> str:
    return hashlib.sha256(f"{parent}\n".encode() + _canonical_json(canonical)).hexdigest()


# -- rehashing ---------------------------------------------------------------------------------

_WITH_CALLS = sa.text(
    "SELECT DISTINCT conversation_id FROM nodes WHERE level = 0 "
    "AND (tool_calls IS NOT NULL OR meta -> 'function_call' IS NOT NULL) ORDER BY conversation_id"
)
_NODES = sa.text(
    "SELECT id, seq, follows_seq, role, name, content, tool_calls, tool_call_id, meta, "
    "chain_hash FROM nodes WHERE conversation_id = :conversation AND level = 0 ORDER BY seq"
).columns(
    id=sa.BigInteger(),
    seq=sa.Integer(),
    follows_seq=sa.Integer(),
    content=postgresql.JSONB(),
    tool_calls=postgresql.JSONB(),
    meta=postgresql.JSONB(),
)
_SET_NODE = sa.text("UPDATE nodes SET chain_hash = :new WHERE id = :id")
_SET_HEAD = sa.text(
    "UPDATE conversations SET head_hash = :new WHERE id = :conversation AND head_hash = :old"
)
_SET_RESPONSES = sa.text(
    "UPDATE responses SET head_hash = :new WHERE conversation_id = :conversation "
    "AND head_hash = :old"
)


def _rehash(*, doubles: bool) -> None:
    """Recompute the chain hashes that the numbers' form changes (`doubles`: as doubles, the
    form of this revision; else as parsed, revision 0014's), with what points at them."""
    bind = op.get_bind()
    for conversation in list(bind.scalars(_WITH_CALLS)):
        by_seq: dict[int, tuple[str, str]] = {-1: ("", "")}  # seq → (hash before, hash now)
        changed: dict[str, str] = {}
        for row in bind.execute(_NODES, {"conversation": conversation}):
            message = {**(row.meta or {}), **{f: getattr(row, f) for f in _MESSAGE_FIELDS}}
            parent_seq = row.seq - 1 if row.follows_seq is None else row.follows_seq
            canonical = _canonical(message, doubles=doubles)
            parents = by_seq.get(parent_seq)
            if parents is None or (
                parents[0] == parents[1]
                # As JSON: Python takes 2 and 2.0 for equal.
                and _canonical_json(canonical)
                == _canonical_json(_canonical(message, doubles=not doubles))
            ):
                digest = row.chain_hash  # unchanged (or its parent unknown: left as it is)
            else:
                digest = _hash(parents[1], canonical)
            by_seq[row.seq] = (row.chain_hash, digest)
            if digest != row.chain_hash:
                changed[row.chain_hash] = digest
                bind.execute(_SET_NODE, {"new": digest, "id": row.id})
        for old, new in changed.items():
            values = {"conversation": conversation, "old": old, "new": new}
            bind.execute(_SET_HEAD, values)
            bind.execute(_SET_RESPONSES, values)


def upgrade() -> None:
    _rehash(doubles=True)


def downgrade() -> None:
    _rehash(doubles=False)
