"""What every append to a conversation shares, and one message appended at its head in one
statement.

A message is stored as a level-0 row (`node_row`: escaped where Postgres cannot hold it,
counted in the model's tokens, chained by the original's hash); the conversation's head moves
past it and a request's figures are counted with it (`MOVE_HEAD`, `head_values`).
`memory.write.store` does this in a few statements after reading (and locking) the
conversation. On the request path the common cases need no reading first: a turn that adds one
message after the head, and the reply to it (`memory.write.replies`), know the seq, chain hash
and row beforehand. `at_head` then sends one statement, whose parts are data-modifying CTEs:

* the head moves and the figures are counted only if the head, its seq and the next seq are
  those the caller expects: Postgres re-checks that under the row's lock, so a concurrent write
  that moved the head first makes it match nothing;
* the message is inserted, and the conversation's build and (for a reply to a prompt from the
  working context) the next turn's preparation (`CONTEXT_JOB`) are queued, deduplicated, from
  the moved row, so they happen exactly when the head moved (a job already queued is held
  until commit instead: `memory.build.jobs.deduplicated`);
* workers are woken for each job queued, at commit (as `memory.build.jobs.enqueue` does).

When the guard misses nothing has changed, and the caller stores the message its usual way in
the same transaction. Either way the rows, the conversation's figures and the jobs are the same
(`tests/test_write_appends.py`).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Boolean,
    Integer,
    Text,
    bindparam,
    case,
    func,
    insert,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import tokens
from memory.build import jobs, tree
from memory.schema import conversations, nodes
from memory.schema import jobs as jobs_table
from memory.text import escape_unstorable
from memory.write import chains

MESSAGE_FIELDS = ("role", "name", "content", "tool_calls", "tool_call_id")
"""Fields of an OpenAI message stored in columns; the rest are kept in `meta`."""
"""Roles whose message is a system prompt (the conversation keeps the newest one's hash)."""

CONTEXT_JOB = "context"
"""The job that prepares a conversation's next turn after a reply: its likely recall, and its
next compaction when one nears (run by the read path; queued with the reply)."""


def context_key(conversation_id: int) -> str:
    """The key that keeps one `CONTEXT_JOB` of the conversation queued at a time."""
    return f"{CONTEXT_JOB}:{conversation_id}"


@dataclass(frozen=True)
class RequestStats:
    """What one answered request cost, counted on the conversation with its reply."""

    sent: int
    """Prompt tokens sent upstream, as the gateway counted them."""
    full: int
    """Tokens the whole history would have cost."""
    reused: int = 0
    """Prompt tokens that repeated the previous prompt's prefix."""
    upstream_prompt: int = 0
    upstream_cached: int = 0
    upstream_completion: int = 0
    """What the upstream reported in `usage` (summed over hidden tool rounds)."""
    fingerprint: Any = None
    """The prompt's fingerprint, kept for the next request's reuse figure (None: unchanged)."""
    prepare_context: bool = False
    """The prompt came from the working context: queue the preparation of the next turn."""


# Moves the head (a NULL hash keeps the stored one), counts what was stored and a request
# (`head_values`). `store` runs it after its inserts; `at_head` guards it.
MOVE_HEAD = (
    update(conversations)
    .where(conversations.c.id == bindparam("conversation"))
    .values(
        next_seq=conversations.c.next_seq + bindparam("stored"),
        token_count=conversations.c.token_count + bindparam("added"),
        head_hash=func.coalesce(bindparam("new_head", type_=Text), conversations.c.head_hash),
        head_seq=case(
            (bindparam("new_head", type_=Text).is_(None), conversations.c.head_seq),
            else_=bindparam("new_head_seq", type_=Integer),
        ),
        system_hash=func.coalesce(bindparam("new_system", type_=Text), conversations.c.system_hash),
        requests=conversations.c.requests + bindparam("requests"),
        tokens_sent=conversations.c.tokens_sent + bindparam("sent"),
        tokens_full=conversations.c.tokens_full + bindparam("full"),
        tokens_reused=conversations.c.tokens_reused + bindparam("reused"),
        usage_prompt_tokens=conversations.c.usage_prompt_tokens + bindparam("upstream_prompt"),
        usage_cached_tokens=conversations.c.usage_cached_tokens + bindparam("upstream_cached"),
        usage_completion_tokens=(
            conversations.c.usage_completion_tokens + bindparam("upstream_completion")
        ),
        prompt_fingerprint=func.coalesce(
            bindparam("fingerprint", type_=JSONB(none_as_null=True)),
            conversations.c.prompt_fingerprint,
        ),
        updated_at=func.now(),
    )
)
_NO_REQUEST = RequestStats(sent=0, full=0)


def head_values(
    *,
    stored: int,
    added: int,
    head: tuple[str, int | None] | None,
    system: Any = None,
    request: RequestStats | None = None,
) -> dict[str, Any]:
    """`MOVE_HEAD`'s parameters but the conversation: `stored` messages and `added` tokens of
    the current branch counted, the head moved to `head` (None: where it is), the newest
    system prompt `system` noted, a request's figures counted."""
    stats = request or _NO_REQUEST
    return {
        "stored": stored,
        "added": added,
        "new_head": head[0] if head is not None else None,
        "new_head_seq": head[1] if head is not None else None,
        "new_system": chains.content_hash(system) if system is not None else None,
        "requests": 0 if request is None else 1,
        "sent": stats.sent,
        "full": stats.full,
        "reused": stats.reused,
        "upstream_prompt": stats.upstream_prompt,
        "upstream_cached": stats.upstream_cached,
        "upstream_completion": stats.upstream_completion,
        "fingerprint": stats.fingerprint,
    }


def node_row(
    message: Mapping[str, Any],
    *,
    tenant_id: int,
    conversation_id: int,
    seq: int,
    chain_hash: str,
    follows_seq: int | None,
    model: str,
    status: str,
    request_key: str | None,
    replied_by: str | None,
) -> dict[str, Any]:
    """The `nodes` row that stores `message` at `seq` (its columns but `superseded_at` and
    `created_at`): escaped where Postgres cannot hold it, counted with `model`'s tokenizer.
    `chain_hash` is the original's, so that a client resending it still matches."""
    stored, escaped = escape_unstorable(dict(message))
    return {
        "tenant_id": tenant_id,
        "conversation_id": conversation_id,
        "level": 0,
        "seq": seq,
        "span_start": seq,
        "span_end": seq,
        **{field: stored.get(field) for field in MESSAGE_FIELDS},
        "chain_hash": chain_hash,
        "text": tokens.message_text(stored),
        "token_count": tokens.count_message(stored, model=model),
        "status": status,
        "escaped": escaped,
        "meta": {k: v for k, v in stored.items() if k not in MESSAGE_FIELDS},
        "follows_seq": follows_seq,
        "request_key": request_key,
        "model": replied_by,
    }


# Parameters are not named after a column of `conversations`: an UPDATE would take them for
# values to SET.
_MOVED = (
    MOVE_HEAD.where(
        conversations.c.tenant_id == bindparam("the_tenant"),
        conversations.c.head_hash == bindparam("parent"),
        conversations.c.head_seq == bindparam("parent_seq"),
        conversations.c.next_seq == bindparam("seq"),
    )
    .returning(conversations.c.id, conversations.c.tenant_id)
    .cte("moved")
)
# The columns `node_row` fills, each a parameter named after its column.
_NODE_COLUMNS = (
    "tenant_id",
    "conversation_id",
    "level",
    "seq",
    "span_start",
    "span_end",
    *MESSAGE_FIELDS,
    "chain_hash",
    "text",
    "token_count",
    "status",
    "escaped",
    "meta",
    "follows_seq",
    "request_key",
    "model",
)
_INSERTED = (
    insert(nodes)
    .from_select(
        _NODE_COLUMNS,
        select(
            *(bindparam(f"node_{name}", type_=nodes.c[name].type) for name in _NODE_COLUMNS)
        ).select_from(_MOVED),
    )
    .returning(nodes.c.id)
    .cte("inserted")
)
# The build first, then the preparation behind it: jobs of one conversation run in id order.
_WANTED = union_all(
    select(_MOVED.c.tenant_id, _MOVED.c.id, bindparam("build_kind"), bindparam("build_key")),
    select(
        _MOVED.c.tenant_id, _MOVED.c.id, bindparam("context_kind"), bindparam("context_key")
    ).where(bindparam("prepare", type_=Boolean)),
)
_QUEUED = (
    jobs.deduplicated(
        pg_insert(jobs_table).from_select(
            ["tenant_id", "conversation_id", "kind", "dedupe_key"], _WANTED
        )
    )
    .returning(jobs_table.c.kind)
    .cte("queued")
)
# The node's id (no row: the guard missed), workers woken once per job queued (at commit).
_AT_HEAD = select(
    _INSERTED.c.id,
    select(func.count(func.pg_notify(jobs.CHANNEL, _QUEUED.c.kind))).scalar_subquery(),
)


@dataclass(frozen=True)
class Stored:
    """The message `at_head` stored: its node, seq, chain hash and tokens."""

    node_id: int
    seq: int
    chain_hash: str
    tokens: int


async def at_head(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    message: Mapping[str, Any],
    after: tuple[str, int],
    model: str,
    status: str = "complete",
    request_key: str | None = None,
    replied_by: str | None = None,
    request: RequestStats | None = None,
) -> Stored | None:
    """Append `message` right after the conversation's head when the head is `after` (its
    chain hash and seq) and the next seq follows it; queue the build, and for a `request`
    that asks it the next turn's preparation; count `request`'s figures. What was stored, or
    None, having changed nothing, when the head is elsewhere. `node_row` says what the other
    arguments store."""
    parent, parent_seq = after
    seq = parent_seq + 1
    row = node_row(
        message,
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        seq=seq,
        chain_hash=chains.chain([message], parent)[0],
        follows_seq=None,
        model=model,
        status=status,
        request_key=request_key,
        replied_by=replied_by,
    )
    system = message.get("content") if message.get("role") in chains.SYSTEM_ROLES else None
    node_id = await conn.scalar(
        _AT_HEAD,
        {
            "conversation": conversation_id,
            "the_tenant": tenant_id,
            "parent": parent,
            "parent_seq": parent_seq,
            "seq": seq,
            **head_values(
                stored=1,
                added=row["token_count"],
                head=(row["chain_hash"], seq),
                system=system,
                request=request,
            ),
            **{f"node_{name}": row[name] for name in _NODE_COLUMNS},
            "build_kind": tree.JOB_KIND,
            "build_key": tree.dedupe_key(conversation_id),
            "context_kind": CONTEXT_JOB,
            "context_key": context_key(conversation_id),
            "prepare": request is not None and request.prepare_context,
        },
    )
    if node_id is None:
        return None
    return Stored(
        node_id=int(node_id), seq=seq, chain_hash=row["chain_hash"], tokens=row["token_count"]
    )
