"""Recording a reply: in one statement while the conversation is as its turn left it.

Every chat request records its reply, and a non-stream answer waits for it. `store.append`
takes five round trips (lock the conversation, queue its build, queue the next turn's
preparation, insert, move the head) because in general it must read the conversation to know
where a message goes. A reply usually needs no reading: when the head is still the message its
turn's prompt ended with (`ReplyTo`), the reply's seq, chain hash and row are known before
anything is read. `record` then sends one statement, whose parts are data-modifying CTEs:

* the head moves, and the request's figures are counted (`store.MOVE_HEAD`), only if the head,
  its seq and the next seq are still those the turn left: Postgres re-checks that under the
  row's lock, so a concurrent turn that moved the head first makes it match nothing;
* the reply is inserted, and the build and (for a prompt from the working context) the next
  turn's preparation are queued, deduplicated, from the moved row, so they happen exactly when
  the head moved;
* workers are woken for each job queued (delivered at commit, as `memory.build.jobs.enqueue`
  does).

When the guard misses (a retry's reply, a concurrent turn, a branch moved meanwhile) the
statement has changed nothing, and `store.append` records the reply in the same transaction,
placing it as it always has (`memory.write.branches.place_reply`). Either way the rows, the
conversation's figures and the jobs are the same.
"""

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Text,
    bindparam,
    func,
    insert,
    literal_column,
    select,
    text,
    union_all,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.build import jobs, tree
from memory.schema import conversations, nodes
from memory.schema import jobs as jobs_table
from memory.write import chains, store
from memory.write.branches import ReplyTo


def _text(value: str) -> ColumnElement[str]:
    return literal_column(f"'{value}'", Text)


# Parameters are not named after a column of `conversations`: an UPDATE would take them for
# values to SET.
_MOVED = (
    store.MOVE_HEAD.where(
        conversations.c.tenant_id == bindparam("the_tenant"),
        conversations.c.head_hash == bindparam("parent"),
        conversations.c.head_seq == bindparam("parent_seq"),
        conversations.c.next_seq == bindparam("seq"),
    )
    .returning(conversations.c.id, conversations.c.tenant_id)
    .cte("moved")
)
# The columns `store.node_row` fills, each a parameter named after its column.
_NODE_COLUMNS = (
    "tenant_id",
    "conversation_id",
    "level",
    "seq",
    "span_start",
    "span_end",
    *store.MESSAGE_FIELDS,
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
    select(_MOVED.c.tenant_id, _MOVED.c.id, _text(tree.JOB_KIND), bindparam("build_key")),
    select(
        _MOVED.c.tenant_id, _MOVED.c.id, _text(store.CONTEXT_JOB), bindparam("context_key")
    ).where(bindparam("prepare", type_=Boolean)),
)
_QUEUED = (
    pg_insert(jobs_table)
    .from_select(["tenant_id", "conversation_id", "kind", "dedupe_key"], _WANTED)
    .on_conflict_do_nothing(
        index_elements=[jobs_table.c.dedupe_key], index_where=text("status = 'queued'")
    )
    .returning(jobs_table.c.kind)
    .cte("queued")
)
_RECORD = select(
    _INSERTED.c.id,
    select(func.count(func.pg_notify(jobs.CHANNEL, _QUEUED.c.kind))).scalar_subquery(),
)


async def record(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    reply: Mapping[str, Any],
    model: str,
    status: str,
    request: store.RequestStats,
    reply_to: ReplyTo | None,
) -> None:
    """Store `reply`, the answer `model` gave to the turn `reply_to` stored, and count what its
    request cost (`request`), as `store.append` would, in the caller's transaction."""
    if reply_to is not None and reply_to.parent_seq is not None:
        seq = reply_to.parent_seq + 1
        row = store.node_row(
            reply,
            tenant_id=tenant_id,
            conversation_id=conversation_id,
            seq=seq,
            chain_hash=chains.chain([reply], reply_to.parent)[0],
            follows_seq=None,
            model=model,
            status=status,
            request_key=reply_to.request_key,
            replied_by=model,
        )
        stored = await conn.scalar(
            _RECORD,
            {
                "conversation": conversation_id,
                "the_tenant": tenant_id,
                "parent": reply_to.parent,
                "parent_seq": reply_to.parent_seq,
                "seq": seq,
                **store.head_values(
                    stored=1,
                    added=row["token_count"],
                    head=(row["chain_hash"], seq),
                    system=reply.get("content") if row["role"] in store.SYSTEM_ROLES else None,
                    request=request,
                ),
                **{f"node_{name}": row[name] for name in _NODE_COLUMNS},
                "build_key": tree.dedupe_key(conversation_id),
                "context_key": store.context_key(conversation_id),
                "prepare": request.prepare_context,
            },
        )
        if stored is not None:
            return
    await store.append(
        conn,
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        messages=[reply],
        model=model,
        status=status,
        request=request,
        reply_to=reply_to,
    )
