"""Appending at the head in one statement (`memory.write.appends`), against a real Postgres: a
reply (`memory.write.replies`) while the conversation is as its turn left it, and a turn of one
new message after the head; the long way (`store.append`, `store.store_new`'s statements)
otherwise, and the same rows, figures and jobs either way."""

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
import pytest
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.build import jobs
from memory.schema import conversations, nodes
from memory.schema import jobs as jobs_table
from memory.write import appends, identity, replies, retries, store
from tests.inprocess import App

MODEL = "gpt-4o"
Message = dict[str, Any]
STATS = appends.RequestStats(
    sent=120,
    full=900,
    reused=64,
    upstream_prompt=118,
    upstream_cached=64,
    upstream_completion=9,
    fingerprint=[[3, "ab", 100]],
    prepare_context=True,
)
REPLY: Message = {
    "role": "assistant",
    "content": "The ferry leaves at nine.\x00",  # a NUL: stored escaped, hashed as sent
    "refusal": None,
    "annotations": [],
}


async def stored_turn(
    engine: AsyncEngine, tenant_id: int, external_id: str, sent: list[Message], key: str
) -> store.Appended:
    """`sent` stored as the gateway stores a request named `key`."""
    async with engine.begin() as conn:
        found = await identity.identify(
            conn,
            tenant_id=tenant_id,
            external_id=external_id,
            user=None,
            messages=sent,
            request=retries.RequestKey(value=key, explicit=True),
        )
        return await store.store_new(
            conn, tenant_id=tenant_id, found=found, messages=sent, model=MODEL, request_key=key
        )


@contextmanager
def statements(engine: AsyncEngine) -> Iterator[list[str]]:
    """The SQL statements `engine` sends while the block runs."""
    sent: list[str] = []

    def seen(*args: Any) -> None:
        sent.append(args[2])

    event.listen(engine.sync_engine, "before_cursor_execute", seen)
    try:
        yield sent
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", seen)


async def record(engine: AsyncEngine, tenant_id: int, turn: store.Appended, *, fast: bool) -> None:
    """The reply to `turn`, through `replies.record` (`fast`) or `store.append`."""
    async with engine.begin() as conn:
        if fast:
            await replies.record(
                conn,
                tenant_id=tenant_id,
                conversation_id=turn.conversation.id,
                reply=REPLY,
                model=MODEL,
                status="complete",
                request=STATS,
                reply_to=turn.reply_to,
            )
        else:
            await store.append(
                conn,
                tenant_id=tenant_id,
                conversation_id=turn.conversation.id,
                messages=[REPLY],
                model=MODEL,
                request=STATS,
                reply_to=turn.reply_to,
            )


async def state(engine: AsyncEngine, conversation_id: int) -> dict[str, Any]:
    """What a conversation holds, without what differs between two of them by nature (ids,
    times, the external id)."""
    unlike = {"id", "conversation_id", "external_id", "created_at", "updated_at", "superseded_at"}
    async with engine.connect() as conn:
        conversation = (
            await conn.execute(select(conversations).where(conversations.c.id == conversation_id))
        ).one()
        messages = await conn.execute(
            select(nodes).where(nodes.c.conversation_id == conversation_id).order_by(nodes.c.seq)
        )
        queued = await conn.execute(
            select(jobs_table.c.kind, jobs_table.c.payload, jobs_table.c.max_attempts)
            .where(jobs_table.c.conversation_id == conversation_id)
            .order_by(jobs_table.c.id)
        )
        return {
            "conversation": {k: v for k, v in conversation._mapping.items() if k not in unlike},
            "nodes": [
                {
                    **{k: v for k, v in row._mapping.items() if k not in unlike},
                    "current": row.superseded_at is None,
                }
                for row in messages
            ],
            "jobs": [tuple(row) for row in queued],
        }


async def twins(
    engine: AsyncEngine, tenant_id: int, turns: list[list[Message]]
) -> list[list[store.Appended]]:
    """Two conversations that stored the same `turns`, unanswered."""
    pair: list[list[store.Appended]] = []
    for _ in range(2):
        external_id = f"reply-{uuid.uuid4().hex}"
        pair.append(
            [
                await stored_turn(engine, tenant_id, external_id, sent, f"request-{index}")
                for index, sent in enumerate(turns)
            ]
        )
    return pair


async def test_a_reply_to_the_head_is_one_statement_that_stores_what_append_does(
    engine: AsyncEngine, tenant_id: int
) -> None:
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "When?"}]
    fast, slow = await twins(engine, tenant_id, [opening])
    with statements(engine) as sent:
        await record(engine, tenant_id, fast[0], fast=True)
    await record(engine, tenant_id, slow[0], fast=False)

    assert len(sent) == 1, sent
    one, other = (
        await state(engine, fast[0].conversation.id),
        await state(engine, slow[0].conversation.id),
    )
    assert one == other
    reply = one["nodes"][-1]
    assert (reply["seq"], reply["model"], reply["escaped"]) == (2, MODEL, True)
    assert one["conversation"]["requests"] == 1
    assert [kind for kind, *_ in one["jobs"]] == ["conversation", appends.CONTEXT_JOB]


async def test_a_turn_of_one_message_after_the_head_is_one_statement_as_well(
    engine: AsyncEngine, tenant_id: int
) -> None:
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "When?"}]
    asked = [{"role": "user", "content": "And the way back?"}]  # sent alone, conversation named
    fast, slow = await twins(engine, tenant_id, [opening])
    turns: list[store.Appended] = []
    for first, the_long_way in ((fast[0], False), (slow[0], True)):
        await record(engine, tenant_id, first, fast=True)
        external_id = first.conversation.external_id
        with statements(engine) as sent, pytest.MonkeyPatch.context() as patch:
            if the_long_way:
                patch.setattr(store, "_one_after_head", none)
            turns.append(await stored_turn(engine, tenant_id, external_id, asked, "second"))
        stores = [s for s in sent if "INSERT INTO nodes" in s]
        assert len(stores) == 1
        assert ("UPDATE conversations" in stores[0]) is not the_long_way

    one, other = (
        await state(engine, fast[0].conversation.id),
        await state(engine, slow[0].conversation.id),
    )
    assert one == other
    assert [row["seq"] for row in one["nodes"]] == [0, 1, 2, 3]
    same = ("first_seq", "token_count", "whole", "branched_at", "reply_to", "prompt_fingerprint")
    assert [getattr(turns[0], name) for name in same] == [getattr(turns[1], name) for name in same]


async def none(*args: Any, **kwargs: Any) -> None:
    """Stands for `store._one_after_head` finding the turn of another kind."""


async def test_a_reply_after_the_head_moved_is_placed_as_append_places_it(
    engine: AsyncEngine, tenant_id: int
) -> None:
    # Two requests that each sent only their new message, the second stored before the first
    # is answered: the first reply's guard misses, and it goes after the head.
    first = [{"role": "user", "content": "What time is the ferry?"}]
    second = [{"role": "user", "content": "And the bus?"}]
    fast, slow = await twins(engine, tenant_id, [first, second])
    for turns, through_one in ((fast, True), (slow, False)):
        for turn in turns:
            await record(engine, tenant_id, turn, fast=through_one)

    one, other = (
        await state(engine, fast[0].conversation.id),
        await state(engine, slow[0].conversation.id),
    )
    assert one == other
    assert [row["role"] for row in one["nodes"]] == ["user", "user", "assistant", "assistant"]
    assert one["conversation"]["requests"] == 2


async def test_a_retrys_reply_is_not_stored_twice(engine: AsyncEngine, tenant_id: int) -> None:
    external_id = f"reply-{uuid.uuid4().hex}"
    sent = [{"role": "user", "content": "Is the ferry on time?"}]
    turn = await stored_turn(engine, tenant_id, external_id, sent, "asked-once")
    await record(engine, tenant_id, turn, fast=True)
    # The same request sent again before its answer arrived: its turn points where the first
    # did, and the first answer is stored there by now.
    await record(engine, tenant_id, turn, fast=True)

    stored = await state(engine, turn.conversation.id)
    assert [row["role"] for row in stored["nodes"]] == ["user", "assistant"]
    assert stored["conversation"]["requests"] == 2


async def test_the_jobs_it_queues_wake_workers_at_commit(
    engine: AsyncEngine, tenant_id: int, database_url: str
) -> None:
    external_id = f"reply-{uuid.uuid4().hex}"
    turn = await stored_turn(
        engine, tenant_id, external_id, [{"role": "user", "content": "Hi"}], "wake"
    )
    async with engine.begin() as conn:  # the turn's build is queued already: drop it
        await conn.execute(
            jobs_table.delete().where(jobs_table.c.conversation_id == turn.conversation.id)
        )
    woken: asyncio.Queue[str] = asyncio.Queue()
    listener = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await listener.add_listener(jobs.CHANNEL, lambda *args: woken.put_nowait(args[-1]))
        await record(engine, tenant_id, turn, fast=True)
        kinds = {await asyncio.wait_for(woken.get(), timeout=5) for _ in range(2)}
    finally:
        await listener.close()
    assert kinds == {"conversation", appends.CONTEXT_JOB}


async def test_a_turn_that_finds_its_build_queued_holds_it_until_the_turn_commits(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """The build queued by the last write takes in this turn's message (deduplicated): no
    worker may start it before the turn commits, or the message would be left unbuilt."""
    first = await stored_turn(
        engine, tenant_id, f"held-{uuid.uuid4().hex}", [{"role": "user", "content": "Hi"}], "one"
    )
    conversation_id = first.conversation.id

    async def claimable() -> list[int]:
        # What a claim could take of the conversation's jobs now (it skips locked rows).
        async with engine.begin() as conn:
            found = await conn.scalars(
                select(jobs_table.c.id)
                .where(
                    jobs_table.c.conversation_id == conversation_id,
                    jobs_table.c.status == "queued",
                )
                .with_for_update(skip_locked=True)
            )
            return list(found)

    (build,) = await claimable()
    asked = [{"role": "user", "content": "And then?"}]  # sent alone, conversation named
    async with engine.connect() as conn:
        transaction = await conn.begin()
        found = await identity.identify(
            conn,
            tenant_id=tenant_id,
            external_id=first.conversation.external_id,
            user=None,
            messages=asked,
            request=retries.RequestKey(value="two", explicit=True),
        )
        with statements(engine) as sent:
            await store.store_new(
                conn, tenant_id=tenant_id, found=found, messages=asked, model=MODEL
            )
        assert len(sent) == 1  # the one statement of `appends.at_head`
        assert await claimable() == []
        await transaction.commit()
    assert await claimable() == [build]


async def test_a_gateways_turns_take_the_one_statement(app: App, fresh_upstream: None) -> None:
    # Whole histories resent, a named conversation, a stream: none of them needs the fallback.
    fallbacks: list[int] = []
    append = store.append

    async def counted(*args: Any, **kwargs: Any) -> store.Appended:
        fallbacks.append(kwargs["conversation_id"])
        return await append(*args, **kwargs)

    history: list[Message] = [{"role": "system", "content": "Be brief."}]
    headers = {"X-Memstrata-Conversation": f"reply-{uuid.uuid4().hex}"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(store, "append", counted)
        async with app.client() as client:
            for index, stream in enumerate((False, False, True)):
                history.append({"role": "user", "content": f"Question {index}?"})
                answer = await client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": history, "stream": stream},
                    headers=headers,
                )
                assert answer.status_code == 200, answer.text
                reply = await stored_reply(app, headers["X-Memstrata-Conversation"])
                history.append({"role": "assistant", "content": reply})
    assert fallbacks == []


async def stored_reply(app: App, external_id: str) -> Any:
    """The content of the conversation's newest message, which must be a reply."""
    async with app.state.engine.connect() as conn:
        role, content = (
            await conn.execute(
                select(nodes.c.role, nodes.c.content)
                .join(conversations, conversations.c.id == nodes.c.conversation_id)
                .where(conversations.c.external_id == external_id, nodes.c.level == 0)
                .order_by(nodes.c.seq.desc())
                .limit(1)
            )
        ).one()
    assert role == "assistant"
    return content
