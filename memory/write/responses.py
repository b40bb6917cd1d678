"""Responses of the Responses API: which conversation each continued, and where it ended.

A response is kept beside the messages it stored (they are stored as any chat turn's are), so
that a later request naming it as `previous_response_id` continues its conversation from that
point (`history`: the path to it, whichever branch holds it now), and so that it can be read
back as the client saw it (`body`, its `input_items`), and its output items by their ids
(`output_items`: a client resends an earlier reply as an `item_reference`). `delete` forgets a
response, not the messages it stored. Every
function is scoped by `tenant_id`: another tenant's response behaves as missing. `save` runs
in the transaction that recorded the reply, after the conversation's row was locked by it, so
the point it records (`last_seq`, `head_hash`) is the one the reply made.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete as delete_rows
from sqlalchemy import select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.errors import NotFound
from memory.schema import OUTPUT_IDS, conversations, nodes, responses
from memory.write import store


@dataclass(frozen=True)
class ResponseRecord:
    """A stored response, with its conversation as it is now."""

    response_id: str
    conversation_id: int
    external_id: str
    last_seq: int
    """The seq of the response's last stored message."""
    at_head: bool
    """Whether the conversation has not moved on since: nothing was stored after it."""
    body: dict[str, Any]
    input_items: list[dict[str, Any]]


async def save(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    response_id: str,
    body: dict[str, Any],
    input_items: list[dict[str, Any]],
) -> None:
    """Keep a response as ending where its conversation's head is now (a response id seen
    again keeps its first record)."""
    head = (
        await conn.execute(
            select(conversations.c.next_seq, conversations.c.head_hash).where(
                conversations.c.id == conversation_id, conversations.c.tenant_id == tenant_id
            )
        )
    ).one()
    await conn.execute(
        insert(responses)
        .values(
            tenant_id=tenant_id,
            response_id=response_id,
            conversation_id=conversation_id,
            last_seq=head.next_seq - 1,
            head_hash=head.head_hash,
            body=body,
            input_items=input_items,
        )
        .on_conflict_do_nothing()
    )


async def find(
    conn: AsyncConnection, *, tenant_id: int, response_id: str, lock: bool = False
) -> ResponseRecord:
    """The response `response_id` of this tenant, or `NotFound`; `lock` locks its
    conversation's row until the transaction ends."""
    if "\x00" in response_id:
        # Postgres text cannot hold a NUL, so no stored response has such an id; asked for
        # one, Postgres would refuse the statement.
        raise NotFound(f"Response with id {response_id!r} not found.")
    query = (
        select(
            responses,
            conversations.c.external_id,
            (conversations.c.head_hash == responses.c.head_hash).label("at_head"),
        )
        .join(conversations, conversations.c.id == responses.c.conversation_id)
        .where(responses.c.tenant_id == tenant_id, responses.c.response_id == response_id)
    )
    if lock:
        query = query.with_for_update(of=conversations, key_share=True)
    row = (await conn.execute(query)).one_or_none()
    if row is None:
        raise NotFound(f"Response with id '{response_id}' not found.")
    return ResponseRecord(
        response_id=row.response_id,
        conversation_id=row.conversation_id,
        external_id=row.external_id,
        last_seq=row.last_seq,
        at_head=bool(row.at_head),
        body=row.body,
        input_items=row.input_items,
    )


_OUTPUT_ITEMS = text(
    f"""
    SELECT DISTINCT ON (item->>'id') item
    FROM responses r CROSS JOIN LATERAL jsonb_array_elements(r.body->'output') AS item
    WHERE r.tenant_id = :tenant_id AND {OUTPUT_IDS} ?| CAST(:ids AS text[])
      AND item->>'id' = ANY(CAST(:ids AS text[]))
    ORDER BY item->>'id', r.created_at
    """
)


async def output_items(
    conn: AsyncConnection, *, tenant_id: int, item_ids: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """The output items of this tenant's stored responses that `item_ids` name, by id (an id
    no stored response answered is missing from the result)."""
    wanted = [item_id for item_id in item_ids if "\x00" not in item_id]  # text holds no NUL
    if not wanted:
        return {}
    rows = await conn.execute(_OUTPUT_ITEMS, {"tenant_id": tenant_id, "ids": wanted})
    return {row.item["id"]: row.item for row in rows}


async def delete(conn: AsyncConnection, *, tenant_id: int, response_id: str) -> None:
    """Forget the response `response_id` of this tenant (`NotFound` if there is none): it can
    no longer be read back nor continued. Its messages stay in its conversation."""
    deleted = await conn.execute(
        delete_rows(responses)
        .where(responses.c.tenant_id == tenant_id, responses.c.response_id == response_id)
        .returning(responses.c.response_id)
    )
    if deleted.one_or_none() is None:
        raise NotFound(f"Response with id '{response_id}' not found.")


async def history(
    conn: AsyncConnection, *, tenant_id: int, found: ResponseRecord
) -> list[dict[str, Any]]:
    """The messages of the response `found`'s conversation up to its last one, as a prompt
    carries them (`store.prompt_message`): the path from the root to that message, followed
    across branches. The current branch may no longer hold it (the client forked from an
    earlier response since): read from the current branch, a response of an abandoned
    branch was continued without its own turns."""
    rows = await conn.execute(
        select(
            nodes.c.seq, nodes.c.follows_seq, nodes.c.system_prompt, *store.PROMPT_COLUMNS
        ).where(
            nodes.c.tenant_id == tenant_id,
            nodes.c.conversation_id == found.conversation_id,
            nodes.c.level == 0,
            nodes.c.seq <= found.last_seq,
        )
    )
    by_seq = {row.seq: row for row in rows}
    path = []
    seq = found.last_seq
    while (row := by_seq.get(seq)) is not None:
        path.append(row)
        seq = row.seq - 1 if row.follows_seq is None else row.follows_seq
    # A system prompt that replaced the conversation's is no turn (`store.history`).
    return [store.prompt_message(row) for row in reversed(path) if not row.system_prompt]
