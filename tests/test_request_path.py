"""What the request path does ahead of time or beside itself gives the same prompt, and stores
nothing more, against a real Postgres:

* the query's embedding, started as soon as the conversation is identified
  (`memory.recall.early`, `gateway.openai.chat.start_query`): the turn sends the prompt it
  would have sent (the dry run's, byte for byte) with the query embedded once; a turn refused
  after it started stores nothing and the work is cancelled; for a named conversation found
  past its budget, a guess of the query starts as the request arrives, and a wrong one gives
  way;
* retrieval's vector legs in a spare connection (`memory.db.spare`) beside the full-text leg
  in the turn's own, and `retrieval.search`'s beside its full-text leg: the same legs, ranks,
  similarities and hits; a failing leg cancels the other; no spare from a busy pool.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.openai import chat
from gateway.state import State
from memory import db
from memory.embeddings import Embedder
from memory.errors import ContextOverflow
from memory.recall import recall_note, retrieval
from memory.recall import working_context as wc
from memory.recall.assemble import Budget, Recall, StoredTurn, assemble, query_ahead, query_guess
from memory.recall.early import Early
from memory.schema import nodes
from memory.write import store
from tests.inprocess import App
from tests.test_working_context import (
    EMBEDDER,
    FACT,
    FACT_QUESTION,
    MODEL,
    SYSTEM,
    asked_for_fact,
    gateway_state,
    raw,
)

Message = dict[str, Any]


class CountingEmbedder:
    """The local embedder, counting what it is asked to embed; with `gate`, each call waits
    for it (and records a cancellation)."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.name, self.dim = EMBEDDER.name, EMBEDDER.dim
        self.texts: list[str] = []
        self.cancelled = 0
        self._gate = gate

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.texts += texts
        if self._gate is not None:
            try:
                await self._gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await EMBEDDER.embed(texts)


@dataclass(frozen=True)
class Ahead:
    """The chat handler's store step for one request, starting its query's embedding once the
    conversation is identified (`chat.start_query`)."""

    early: Early
    recall: Recall
    tenant_id: int
    external_id: str
    budget: Budget

    @classmethod
    def of(cls, state: State, embedder: Embedder, external_id: str, *, limit: int) -> Ahead:
        """For a request to `external_id` within `limit`, the query embedded by `embedder`."""
        early = Early(embedder)
        recall = chat.recall_of(state, embedder=early)
        return cls(early, recall, state.default_tenant_id, external_id, Budget(limit, 0))

    async def store(self, conn: AsyncConnection, messages: list[Message]) -> StoredTurn:
        stored, _ = await chat.store_turn(
            conn,
            tenant_id=self.tenant_id,
            external_id=self.external_id,
            user=None,
            messages=messages,
            model=MODEL,
            budget=self.budget,
            identified=functools.partial(
                chat.start_query,
                self.early,
                messages=messages,
                budget=self.budget,
                recall=self.recall,
                model=MODEL,
            ),
        )
        return stored


async def test_a_query_embedded_ahead_gives_the_prompt_of_the_dry_run(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """The chat handler's store step starts the query's embedding once the conversation is
    identified; the turn then sends the prompt the dry run showed, byte for byte, and the query
    was embedded once (the read path awaited the started work)."""
    limit = 2000
    state, conversation, dry = await asked_for_fact(engine, tenant_id, limit=limit)
    assert FACT in dry.messages[-2]["content"]
    counting = CountingEmbedder()
    ahead = Ahead.of(state, counting, conversation.external_id, limit=limit)
    early = ahead.early
    try:
        async with engine.begin() as conn:
            stored = await ahead.store(conn, [SYSTEM, {"role": "user", "content": FACT_QUESTION}])
            assert early.started == FACT_QUESTION  # begun before the turn was stored
            sent = await assemble(conn, stored, ahead.budget, ahead.recall, tools_guide=False)
    finally:
        early.close()
    assert raw(sent.messages) == raw(dry.messages) and sent.labels == dry.labels
    assert counting.texts == [FACT_QUESTION]
    assert (await conversation.state()).upto == stored.next_seq


async def test_a_refused_turn_whose_query_started_stores_nothing(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """A new message that alone exceeds the budget is refused inside the store step's
    transaction after its query began embedding: nothing is stored, and closing the request's
    `Early` cancels the work nobody awaited."""
    limit = 2000
    state, conversation, _ = await asked_for_fact(engine, tenant_id, limit=limit)
    counting = CountingEmbedder(gate=asyncio.Event())
    ahead = Ahead.of(state, counting, conversation.external_id, limit=limit)
    early = ahead.early
    huge = {"role": "user", "content": "Why " + "the storage unit " * 1500 + "?"}

    async def stored_rows() -> tuple[int, int]:
        async with engine.begin() as conn:
            count = await conn.scalar(
                select(func.count()).where(nodes.c.conversation_id == conversation.id)
            )
            row = await wc.load(conn, tenant_id=tenant_id, conversation_id=conversation.id)
        return int(count or 0), 0 if row is None else row.upto

    before = await stored_rows()
    with pytest.raises(ContextOverflow):
        async with engine.begin() as conn:
            await ahead.store(conn, [SYSTEM, huge])
    query = recall_note.query_of([huge])
    assert early.started == query
    await asyncio.sleep(0)  # the started task reaches the embedder
    early.close()
    await asyncio.sleep(0)
    assert counting.texts == [query] and counting.cancelled == 1
    assert await stored_rows() == before


async def test_no_query_starts_for_a_conversation_that_fits(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """A conversation that fits its budget goes as sent: nothing is embedded for it."""
    counting = CountingEmbedder()
    state = gateway_state(engine, tenant_id)
    ahead = Ahead.of(state, counting, f"fits-{uuid.uuid4().hex}", limit=2000)
    early = ahead.early
    async with engine.begin() as conn:
        stored = await ahead.store(conn, [SYSTEM, {"role": "user", "content": "What is it?"}])
        sent = await assemble(conn, stored, ahead.budget, ahead.recall, tools_guide=False)
    early.close()
    assert early.started is None and counting.texts == []
    assert not sent.rebuilt


async def test_a_wrong_guess_gives_way_to_the_query_identified() -> None:
    """`Early.start` with another text cancels the guess's work and embeds the new text; the
    text already started is not embedded again; an empty text cancels a guess."""
    counting = CountingEmbedder(gate=asyncio.Event())
    early = Early(counting)
    early.start("what was the guess?")
    await asyncio.sleep(0)  # the guess reaches the embedder
    early.start("what was the question?")
    early.start("what was the question?")
    await asyncio.sleep(0)
    assert counting.cancelled == 1 and early.started == "what was the question?"
    assert counting.texts == ["what was the guess?", "what was the question?"]
    early.start("")
    await asyncio.sleep(0)
    assert counting.cancelled == 2 and early.started is None
    early.close()


@pytest.mark.parametrize(
    ("messages", "new_from"),
    [
        ([SYSTEM, {"role": "user", "content": "Where is the storage unit?"}], 1),
        (
            [
                SYSTEM,
                {"role": "user", "content": "We rented a unit."},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "Which floor?"},
                {"role": "user", "content": "And what is its number?"},
            ],
            3,
        ),
    ],
)
def test_the_guess_is_the_query_identifying_finds(messages: list[Message], new_from: int) -> None:
    """Whether the client sends the new message alone or resends its history, the guess made
    before identifying is the query identifying finds for a conversation past its budget."""
    recall = Recall(embedder=EMBEDDER)
    found = query_ahead(
        messages,
        new_from=new_from,
        stored_tokens=10_000,
        budget=Budget(2000, 0),
        recall=recall,
        model=MODEL,
    )
    assert found and query_guess(messages, recall=recall) == found


async def test_a_conversation_past_its_budget_starts_its_query_on_arrival(
    app: App, engine: AsyncEngine
) -> None:
    """Through the chat endpoint: a named conversation that fits embeds nothing; once this
    process found one past its budget, its next request's query starts as the request arrives
    (a guess, which identifying confirms), and each turn embeds its query once."""
    counting = CountingEmbedder()
    state, tenant = app.state, app.state.default_tenant_id
    fits, past = f"fits-{uuid.uuid4().hex}", f"past-{uuid.uuid4().hex}"
    long_ago = [
        {"role": "user" if n % 2 == 0 else "assistant", "content": f"Item {n}: " + "words " * 40}
        for n in range(80)
    ]
    async with engine.begin() as conn:
        ref, _ = await store.open_conversation(conn, tenant_id=tenant, external_id=past)
        await store.append(
            conn, tenant_id=tenant, conversation_id=ref.id, messages=long_ago, model=MODEL
        )
    questions = ["Where is the storage unit?", "Which floor is it on?"]

    async def send(client: httpx.AsyncClient, conversation: str, messages: list[Message]) -> None:
        headers = {"X-Memstrata-Conversation": conversation, "X-Memstrata-Budget": "1500"}
        answer = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages}, headers=headers
        )
        assert answer.status_code == 200, answer.text

    state.embedder, embedder = counting, state.embedder
    try:
        async with app.client() as client:
            await send(client, fits, [SYSTEM, {"role": "user", "content": questions[0]}])
            assert counting.texts == [] and not state.past_budget.holds(tenant, fits)
            await send(client, past, [SYSTEM, {"role": "user", "content": questions[0]}])
            assert counting.texts == [questions[0]] and state.past_budget.holds(tenant, past)
            arrivals: list[str | None] = []
            start = Early.start

            def noted(early: Early, text: str) -> None:
                arrivals.append(early.started)
                start(early, text)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(Early, "start", noted)
                await send(client, past, [SYSTEM, {"role": "user", "content": questions[1]}])
    finally:
        state.embedder = embedder
    # The first start found nothing started; identifying found the guess already running.
    assert arrivals == [None, questions[1]]
    assert counting.texts == questions


async def test_vector_legs_beside_the_turn_are_the_turns_own(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """In a transaction that just stored a message, the vector legs run in a spare connection
    (beside the full-text leg) find what they find in the transaction's own connection."""
    _, conversation, _ = await asked_for_fact(engine, tenant_id, limit=2000)
    question = FACT_QUESTION
    [vector] = await EMBEDDER.embed([question])
    async with engine.begin() as conn:
        appended = await store.append(
            conn,
            tenant_id=tenant_id,
            conversation_id=conversation.id,
            messages=[{"role": "user", "content": question}],
            model=MODEL,
        )
        search = functools.partial(
            recall_note.search_legs,
            conn,
            tenant_id=tenant_id,
            conversation_ids=[conversation.id],
            query=question,
            vector=vector,
            exclude=(conversation.id, appended.first_seq - 20),
            newest=appended.first_seq - 1,
            abandoned=False,
        )
        alone = await search()
        async with db.spare(conn) as aside:
            assert aside is not None
            beside = await search(aside=aside)
    assert len(alone) == len(beside) == 3  # full text, vectors, passages
    for one, other in zip(alone, beside, strict=True):
        assert [(p.key, p.similarity) for p in one.ranked] == [
            (p.key, p.similarity) for p in other.ranked
        ]
    assert alone[1].ranked  # the vector leg found something


async def test_a_search_beside_its_connection_finds_what_it_finds_alone(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """`retrieval.search` (the memory tools' and admin search's) with its vector legs in a
    spare connection returns the same hits, scores and order as in its own."""
    _, conversation, _ = await asked_for_fact(engine, tenant_id, limit=2000)
    [vector] = await EMBEDDER.embed([FACT_QUESTION])
    async with engine.connect() as conn:
        search = functools.partial(
            retrieval.search,
            conn,
            tenant_id=tenant_id,
            conversation_ids=[conversation.id],
            query=FACT_QUESTION,
            query_vector=vector,
            limit=12,
        )
        alone = await search()
        async with db.spare(conn) as aside:
            assert aside is not None
            beside = await search(aside=aside)
    assert alone, "the search found nothing to compare"
    assert [(h.node_id, h.score) for h in alone] == [(h.node_id, h.score) for h in beside]


async def test_one_failing_leg_cancels_the_other() -> None:
    """`beside` raises the failure and leaves nothing running in the other connection."""
    other_cancelled = asyncio.Event()

    async def fails() -> int:
        await asyncio.sleep(0)
        raise RuntimeError("leg failed")

    async def waits() -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            other_cancelled.set()
            raise
        return 1

    with pytest.raises(RuntimeError, match="leg failed"):
        await retrieval.beside(fails(), waits())
    await asyncio.wait_for(other_cancelled.wait(), timeout=5)


async def test_a_busy_pool_lends_no_spare(database_url: str) -> None:
    """With every connection of the pool in use, `spare` gives None rather than waiting."""
    engine = db.connect(database_url, pool_size=1, pool_timeout=1)
    try:
        async with engine.connect() as conn, db.spare(conn) as aside:
            assert aside is None
    finally:
        await engine.dispose()
