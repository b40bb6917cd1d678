"""Identifying a request below the HTTP edge (`memory.write.identity`), against a real Postgres:
what a request finds when it waited for another request's lock on its conversation."""

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.schema import nodes
from memory.write import identity, placement, retries, store

MODEL = "gpt-4o"
Message = dict[str, Any]


async def stored(
    engine: AsyncEngine, tenant_id: int, external_id: str | None, sent: list[Message]
) -> None:
    """`sent` stored as the gateway stores a request."""
    async with engine.begin() as conn:
        found = await identity.identify(
            conn, tenant_id=tenant_id, external_id=external_id, user=None, messages=sent
        )
        await store.store_new(conn, tenant_id=tenant_id, found=found, messages=sent, model=MODEL)


@pytest.mark.parametrize("started", [True, False], ids=["ongoing", "opening"])
@pytest.mark.parametrize("named", [True, False], ids=["header", "no-header"])
async def test_a_twin_that_waited_for_the_lock_is_a_retry(
    engine: AsyncEngine, tenant_id: int, named: bool, started: bool
) -> None:
    """The same request twice at once: the second waits for the first's lock on the
    conversation (or, opening one, for the first to create it) while the first stores its
    message, then must see that message as the head and take itself for a retry, storing
    nothing. Before, a twin that waited for the row's lock read the head as it was when its
    statement began (read committed), found no request there, and stored the message again (a
    client sending only its new messages with a conversation id)."""
    external_id = f"twin-{uuid.uuid4().hex}" if named else None
    system: Message = {"role": "system", "content": f"Twins {uuid.uuid4().hex}."}
    opening = [system, {"role": "user", "content": "Hello there."}] if started else [system]
    if started:
        await stored(engine, tenant_id, external_id, opening)
    question: Message = {"role": "user", "content": "Is the ferry on time?"}
    # With an id the client sends its new message; without, its whole history.
    sent = [system, question] if named else [*opening, question]
    request = retries.RequestKey.of(
        body={"model": MODEL, "messages": sent}, idempotency_key=None, retry_count=None
    )

    def identify(conn: Any) -> Any:
        return identity.identify(
            conn,
            tenant_id=tenant_id,
            external_id=external_id,
            user=None,
            messages=sent,
            request=request,
        )

    def store_sent(conn: Any, found: placement.Found) -> Any:
        return store.store_new(
            conn,
            tenant_id=tenant_id,
            found=found,
            messages=sent,
            model=MODEL,
            request_key=request.value,
        )

    async with engine.connect() as first, engine.connect() as twin:
        await first.begin()
        found = await identify(first)
        assert not found.retry
        conversation_id = found.row.id
        await store_sent(first, found)
        await twin.begin()
        waiting = asyncio.ensure_future(identify(twin))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # it waits for the first's lock
        await first.commit()
        again = await asyncio.wait_for(waiting, timeout=30)
        assert again.row.id == conversation_id
        assert again.retry
        assert again.row.head_request == request.value
        assert (await store_sent(twin, again)).node_ids == []
        await twin.commit()
    async with engine.connect() as conn:
        contents = await conn.scalars(
            select(nodes.c.content).where(
                nodes.c.conversation_id == conversation_id, nodes.c.level == 0
            )
        )
        assert list(contents).count(question["content"]) == 1
