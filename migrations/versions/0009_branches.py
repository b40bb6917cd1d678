"""Branches and retries: messages leave the current branch instead of being copied, chain
hashes over the canonical form, the request that brought each message.

* `nodes.superseded_at`: when a message left its conversation's current branch (an edit or a
  regenerated answer branched off before it); `nodes.follows_seq`: the message it follows when
  that is not the one stored just before it; `nodes.request_key`: the request that brought it
  (`memory.write.retries.RequestKey`); `conversations.head_seq`: the seq of the head.
* `ix_nodes_chain` finds where an incoming history leaves a stored one; `ix_nodes_request` the
  messages of a retried request.
* Chain hashes are now taken over the canonical form of a message (tool-call arguments as
  parsed JSON, no content as `""`, text parts as one string): `nodes.chain_hash`,
  `conversations.head_hash` and `conversations.system_hash` are recomputed for existing data,
  a few thousand messages at a time and only where they change (a conversation of plain text
  messages keeps its hashes), so existing conversations keep matching. The formulas are copied
  from `memory.write.identity` (a migration must not change when that module does); the
  downgrade puts back those of revision 0006.

Replies recorded before this revision carry no model, so they are no proof that a client saw a
conversation (`identity`'s branch rule): such a conversation branches on its latest exchange,
or with a conversation id.

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-12 09:00:00.000000
"""

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH = 5000
_MESSAGE_FIELDS = ("role", "name", "content", "tool_calls", "tool_call_id")


# -- the canonical form (memory.write.identity, revision 0008) ----------------------------------


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
    if isinstance(part, dict) and part.get("type") == "text":
        text = part.get("text")
        return text if isinstance(text, str) else None
    return None


def _function(function: dict[str, Any]) -> dict[str, Any]:
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return {"name": function.get("name"), "arguments": arguments}


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        return {"raw": call}
    function = call.get("function")
    return {"id": call.get("id"), **_function(function if isinstance(function, dict) else {})}


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _chain_hash(parent: str, message: dict[str, Any]) -> str:
    found: dict[str, Any] = {
        "role": message.get("role"),
        "name": message.get("name") or None,
        "content": _canonical_content(message.get("content")),
        "tool_calls": [_call(call) for call in message.get("tool_calls") or []],
        "tool_call_id": message.get("tool_call_id"),
    }
    legacy = message.get("function_call")
    if isinstance(legacy, dict):
        found["function_call"] = _function(legacy)
    return hashlib.sha256(f"{parent}\n{_dumps(found)}".encode()).hexdigest()


def _content_hash(content: Any) -> str:
    return hashlib.sha256(_dumps(_canonical_content(content)).encode()).hexdigest()


# -- the form of revision 0006 (for the downgrade) ---------------------------------------------


def _old_chain_hash(parent: str, message: dict[str, Any]) -> str:
    identity = {
        "role": message.get("role"),
        "name": message.get("name"),
        "content": message.get("content") or "",
        "tool_calls": [
            {
                "id": call.get("id"),
                "name": (call.get("function") or {}).get("name"),
                "arguments": (call.get("function") or {}).get("arguments"),
            }
            for call in message.get("tool_calls") or []
        ],
        "tool_call_id": message.get("tool_call_id"),
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{parent}\n{canonical}".encode()).hexdigest()


def _old_content_hash(content: Any) -> str:
    return hashlib.sha256(_dumps(content).encode()).hexdigest()


# -- rehashing ---------------------------------------------------------------------------------

_NODES = sa.text(
    "SELECT id, conversation_id, seq, role, name, content, tool_calls, tool_call_id, meta, "
    "chain_hash FROM nodes WHERE level = 0 AND (conversation_id, level, seq) > (:conv, 0, :seq) "
    "ORDER BY conversation_id, level, seq LIMIT :limit"
).columns(
    id=sa.BigInteger(),
    conversation_id=sa.BigInteger(),
    seq=sa.Integer(),
    content=postgresql.JSONB(),
    tool_calls=postgresql.JSONB(),
    meta=postgresql.JSONB(),
)


def _messages(bind: sa.Connection) -> Iterator[Any]:
    """Every message, by conversation then seq, read `_BATCH` at a time."""
    after = (-1, -1)
    while True:
        rows = bind.execute(_NODES, {"conv": after[0], "seq": after[1], "limit": _BATCH}).all()
        yield from rows
        if len(rows) < _BATCH:
            return
        after = (rows[-1].conversation_id, rows[-1].seq)


def _rehash(
    chain_hash: Callable[[str, dict[str, Any]], str], content_hash: Callable[[Any], str]
) -> None:
    """Recompute every message's chain hash (a conversation's messages chained in seq order)
    and every conversation's head and system prompt hashes; write only what changed."""
    bind = op.get_bind()
    set_node = sa.text("UPDATE nodes SET chain_hash = :hash WHERE id = :id")
    set_conversation = sa.text(
        "UPDATE conversations SET head_hash = :head, system_hash = COALESCE(:system, system_hash)"
        " WHERE id = :id"
    )
    nodes: list[dict[str, Any]] = []
    heads: list[dict[str, Any]] = []
    current, parent, system = None, "", None
    for row in _messages(bind):
        if row.conversation_id != current:
            if current is not None:
                heads.append({"id": current, "head": parent, "system": system})
            current, parent, system = row.conversation_id, "", None
        message = {**(row.meta or {}), **{field: getattr(row, field) for field in _MESSAGE_FIELDS}}
        parent = chain_hash(parent, message)
        if row.role in ("system", "developer"):
            system = content_hash(row.content)
        if parent != row.chain_hash:
            nodes.append({"id": row.id, "hash": parent})
        if len(nodes) >= _BATCH:
            bind.execute(set_node, nodes)
            nodes = []
        if len(heads) >= _BATCH:
            bind.execute(set_conversation, heads)
            heads = []
    if current is not None:
        heads.append({"id": current, "head": parent, "system": system})
    if nodes:
        bind.execute(set_node, nodes)
    if heads:
        bind.execute(set_conversation, heads)


def upgrade() -> None:
    op.add_column("nodes", sa.Column("superseded_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("nodes", sa.Column("follows_seq", sa.Integer(), nullable=True))
    op.add_column("nodes", sa.Column("request_key", sa.Text(), nullable=True))
    op.add_column("conversations", sa.Column("head_seq", sa.Integer(), nullable=True))
    op.execute("UPDATE conversations SET head_seq = next_seq - 1 WHERE next_seq > 0")
    _rehash(_chain_hash, _content_hash)
    op.create_index(
        "ix_nodes_chain",
        "nodes",
        ["tenant_id", "chain_hash"],
        postgresql_where=sa.text("level = 0"),
    )
    op.create_index(
        "ix_nodes_request",
        "nodes",
        ["conversation_id", "request_key"],
        postgresql_where=sa.text("request_key IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_nodes_request", table_name="nodes")
    op.drop_index("ix_nodes_chain", table_name="nodes")
    _rehash(_old_chain_hash, _old_content_hash)
    op.drop_column("conversations", "head_seq")
    op.drop_column("nodes", "request_key")
    op.drop_column("nodes", "follows_seq")
    op.drop_column("nodes", "superseded_at")
