"""Retrieval (`memory.recall.retrieval`) against a real Postgres with real local embeddings.

The main fixture imports a 2,000-message synthetic conversation (`devkit/synthetic.py`) with the
importer, plants four messages of our own in it (one to be found by meaning with no word in
common with the query, one holding an exact identifier, one sentence buried in a long message,
and a late travel episode), and builds its summary tree
(embeddings, segments, roll-ups) with the local MiniLM model and the extractive summarizer.
Tests then search it as the prompt builder and the memory tools do.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import synthetic
from gateway import importer
from memory.build import tree
from memory.build.summarize import ExtractiveSummarizer
from memory.embeddings import LocalEmbedder
from memory.recall import fusion, legs, nearest, recall_note, retrieval
from memory.recall.fusion import Candidates, Place
from memory.recall.query import Route
from memory.schema import nodes, tenants
from memory.write import identity, store, tree_nodes

# Embedding ~4,600 texts (messages, passages, summaries) on a busy 2-core machine takes minutes.
pytestmark = pytest.mark.timeout(900)

N_MESSAGES = 2000
MEANING_AT = 1234
IDENTIFIER_AT = 1789
MEANING = (
    "My grandmother's secret lasagna recipe puts a pinch of nutmeg into the bechamel, "
    "that is what makes it taste like home."
)
MEANING_QUERY = "Which spice goes in grandma's white sauce for the baked pasta?"
BURIED_AT = 1567
BURIED = (
    "Morning! The weather turned grey again and the bus was late, as usual. "
    "I spent most of the afternoon sorting laundry and answering emails. "
    "Oh, and my cousin finally adopted a three-legged greyhound from the shelter. "
    "Anyway, dinner tonight is leftover soup, nothing fancy."
)
BURIED_QUERY = "Which dog did the cousin take home from the rescue?"
# A late travel episode, for sequential questions to prefer over the generator's older ones.
LATE_AT = 1970
LATE = "Travel update: the flight to Porto is booked now, seat 14C, leaving Friday morning."
IDENTIFIER = "ZQX-88412-B"
IDENTIFIER_TEXT = f"The escrow reference is {IDENTIFIER}; keep it for the bank transfer."


@dataclass
class Corpus:
    tenant_id: int
    conversation_id: int
    conversation: synthetic.Conversation
    meaning_node: int
    identifier_node: int
    embedder: LocalEmbedder


async def new_tenant(engine: AsyncEngine) -> int:
    async with engine.begin() as conn:
        created = await conn.scalar(
            insert(tenants).values(name=f"test-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
    assert created is not None
    return int(created)


async def node_at(engine: AsyncEngine, conversation_id: int, seq: int) -> int:
    async with engine.connect() as conn:
        found = await conn.scalar(
            select(nodes.c.id).where(
                nodes.c.conversation_id == conversation_id, nodes.c.level == 0, nodes.c.seq == seq
            )
        )
    assert found is not None
    return int(found)


@pytest.fixture(scope="module")
async def corpus(engine: AsyncEngine) -> AsyncIterator[Corpus]:
    tenant = await new_tenant(engine)
    conversation = synthetic.generate(N_MESSAGES, seed=11)
    messages = list(conversation.messages)
    messages[MEANING_AT] = {"role": "user", "content": MEANING}
    messages[IDENTIFIER_AT] = {"role": "user", "content": IDENTIFIER_TEXT}
    messages[BURIED_AT] = {"role": "user", "content": BURIED}
    messages[LATE_AT] = {"role": "user", "content": LATE}
    await importer.import_messages(
        engine,
        tenant_id=tenant,
        external_id="retrieval-2000",
        messages=messages,
        created_at=conversation.created_at,
        model="gpt-4o",
        batch=1000,
    )
    async with engine.connect() as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant, external_id="retrieval-2000")
    embedder = LocalEmbedder()
    config = tree.TreeConfig(embedder=embedder, summarizer=ExtractiveSummarizer())
    await tree.build(engine, tenant_id=tenant, conversation_id=ref.id, config=config, final=True)
    yield Corpus(
        tenant_id=tenant,
        conversation_id=ref.id,
        conversation=conversation,
        meaning_node=await node_at(engine, ref.id, MEANING_AT),
        identifier_node=await node_at(engine, ref.id, IDENTIFIER_AT),
        embedder=embedder,
    )


async def search(
    engine: AsyncEngine,
    corpus: Corpus,
    query: str,
    *,
    vector: bool = True,
    tenant_id: int | None = None,
    conversation_ids: list[int] | None = None,
    **kwargs: object,
) -> list[retrieval.Hit]:
    query_vector = (await corpus.embedder.embed([query]))[0] if vector else None
    async with engine.begin() as conn:
        return await retrieval.search(
            conn,
            tenant_id=corpus.tenant_id if tenant_id is None else tenant_id,
            conversation_ids=conversation_ids or [corpus.conversation_id],
            query=query,
            query_vector=query_vector,
            **kwargs,  # type: ignore[arg-type]
        )


# -- the planted facts in 2,000 messages ----------------------------------------------------


async def test_finds_a_planted_fact_by_meaning(engine: AsyncEngine, corpus: Corpus) -> None:
    hits = await search(engine, corpus, MEANING_QUERY, limit=5)
    assert corpus.meaning_node in [hit.node_id for hit in hits]
    # The query shares no stemmed word with the message: full text alone cannot find it,
    # so the vector leg is what found it.
    text_only = await search(engine, corpus, MEANING_QUERY, vector=False, limit=5)
    assert corpus.meaning_node not in [hit.node_id for hit in text_only]


async def test_a_sentence_buried_in_a_long_message_is_found_by_its_passage(
    engine: AsyncEngine, corpus: Corpus
) -> None:
    """The message's own vector averages four unrelated sentences; the passage leg ranks it
    by the one that answers, above every other candidate of the vector leg."""
    [vector] = await corpus.embedder.embed([BURIED_QUERY])
    async with engine.connect() as conn:
        whole, parts = await nearest.vector_legs(
            conn,
            tenant_id=corpus.tenant_id,
            conversation_ids=[corpus.conversation_id],
            query_vector=vector,
            limit=400,
        )
    key = (corpus.conversation_id, 0, BURIED_AT)
    [found] = [place for place in parts.ranked if place.key == key]
    assert parts.ranked[0] == found and found.similarity is not None
    by_whole = {place.key: place.similarity for place in whole.ranked}
    assert found.similarity > (by_whole.get(key) or 0.0) + 0.2
    hits = await search(engine, corpus, BURIED_QUERY, limit=5)
    assert BURIED_AT in [hit.seq for hit in hits if hit.level == 0]


async def embedded_as(
    engine: AsyncEngine,
    corpus: Corpus,
    vectors: list[list[float]],
    *,
    order: list[int] | None = None,
) -> int:
    """A new conversation of the corpus's tenant holding a filler message for each of
    `vectors`, message `seq` embedded as `vectors[seq]` (written in `order`); its id."""
    filler = [{"role": "user", "content": f"Filler {number}."} for number in range(len(vectors))]
    external_id = f"embedded-{uuid.uuid4().hex}"
    await importer.import_messages(
        engine,
        tenant_id=corpus.tenant_id,
        external_id=external_id,
        messages=filler,
        created_at=[None] * len(filler),
        model="gpt-4o",
        batch=len(filler),
    )
    async with engine.begin() as conn:
        ref = await store.find_conversation(
            conn, tenant_id=corpus.tenant_id, external_id=external_id
        )
        for seq in order if order is not None else range(len(vectors)):
            await conn.execute(
                update(nodes)
                .where(nodes.c.conversation_id == ref.id, nodes.c.level == 0, nodes.c.seq == seq)
                .values(embedding=vectors[seq])
            )
    return ref.id


LIMIT = 48


async def test_an_index_scan_that_reaches_little_of_its_scope_is_run_exactly(
    engine: AsyncEngine, corpus: Corpus
) -> None:
    """A scope whose messages the HNSW scan does not reach gets the exact scan's rows from the
    vector leg, not the few the index gave. Here the scope is 300 messages whose vectors sit
    opposite the query (each a little apart), beside the corpus's 2,000: the scan, stopped
    after its first pass (`hnsw.max_scan_tuples`), finds the query's nearest, none of them."""
    [query] = await corpus.embedder.embed([MEANING_QUERY])
    away = [[-x for x in query] for _ in range(300)]
    for number, vector in enumerate(away):
        vector[number % len(vector)] += 0.05 * (1 + number // len(vector))
    conversation_id = await embedded_as(engine, corpus, away)
    scope: dict[str, Any] = {
        "tenant_id": corpus.tenant_id,
        "conversation_ids": [conversation_id],
        "query_vector": query,
        "levels": [0],
        "limit": LIMIT,
    }
    async with engine.connect() as conn:
        await conn.execute(text("SET hnsw.max_scan_tuples = 1"))
        # What the index alone gives, asked for as `vector_legs` asks.
        await conn.execute(nearest._INDEX_SETTINGS, {"ef": str(2 * LIMIT)})
        by_index = await conn.execute(
            nearest._VECTOR,
            {
                **legs.scope_params(
                    tenant_id=corpus.tenant_id,
                    conversation_ids=[conversation_id],
                    levels=[0],
                    exclude_from=None,
                    abandoned=False,
                ),
                "vector": query,
                "limit": LIMIT,
            },
        )
        assert len(legs.rows_of(by_index)) < LIMIT // nearest.UNDERFOUND  # the case under test
        await conn.rollback()
        await conn.execute(text("SET hnsw.max_scan_tuples = 1"))
        large = await nearest.vector_legs(conn, **scope, messages=nearest.EXACT_SCAN_MAX + 1)
        # The index scan's settings: sorting, off while it was planned, is back on.
        assert await conn.scalar(text("SELECT current_setting('enable_sort')")) == "on"
        exact = await nearest.vector_legs(conn, **scope, messages=len(away))
    assert len(exact[0].ranked) == LIMIT
    assert [p.key for p in large[0].ranked] == [p.key for p in exact[0].ranked]


async def test_equally_near_nodes_rank_newest_first_in_every_vector_leg(
    engine: AsyncEngine, corpus: Corpus
) -> None:
    """Nodes at the same distance from the query (a text said again) rank newest first, and the
    exact scan keeps the newest of them at its limit: the order does not depend on which
    connection, plan or heap order read them (a search beside its turn's connection must find
    what it finds alone)."""
    [query] = await corpus.embedder.embed([MEANING_QUERY])
    same = [query] * 60
    # Written in an order unlike their sequence, so heap order cannot pass for the rule.
    order = sorted(range(len(same)), key=lambda seq: (seq * 37) % len(same))
    conversation_id = await embedded_as(engine, corpus, same, order=order)
    async with engine.connect() as conn:
        whole, *_ = await nearest.vector_legs(
            conn,
            tenant_id=corpus.tenant_id,
            conversation_ids=[conversation_id],
            query_vector=query,
            levels=[0],
            limit=LIMIT,
            messages=len(same),
        )
    newest = range(len(same) - 1, len(same) - 1 - LIMIT, -1)
    expected = [(conversation_id, 0, seq) for seq in newest]
    assert [place.key for place in whole.ranked] == expected


async def test_finds_a_planted_identifier_exactly(engine: AsyncEngine, corpus: Corpus) -> None:
    for vector in (True, False):
        hits = await search(engine, corpus, f"what was {IDENTIFIER} again?", vector=vector)
        assert hits[0].node_id == corpus.identifier_node
        assert hits[0].text == IDENTIFIER_TEXT
        assert hits[0].level == 0 and hits[0].seq == IDENTIFIER_AT


async def test_finds_the_generators_own_planted_tickets(
    engine: AsyncEngine, corpus: Corpus
) -> None:
    messages = corpus.conversation.messages
    values = [fact.value for fact in corpus.conversation.facts if fact.kind == "ticket"]
    checked = 0
    for value in dict.fromkeys(values):
        holding = [i for i, m in enumerate(messages) if value in str(m.get("content") or "")]
        if not 1 <= len(holding) <= 3 or {MEANING_AT, IDENTIFIER_AT} & set(holding):
            continue
        hits = await search(engine, corpus, f"status of {value}", limit=len(holding) + 2)
        assert value in hits[0].text, value
        assert set(holding) <= {hit.seq for hit in hits if hit.level == 0}, value
        checked += 1
        if checked == 5:
            break
    assert checked, "the generator planted no ticket ids"


async def test_hits_carry_the_stored_message(engine: AsyncEngine, corpus: Corpus) -> None:
    [hit] = await search(engine, corpus, IDENTIFIER, limit=1)
    assert hit.conversation_id == corpus.conversation_id
    assert hit.role == "user"
    assert hit.span_start == hit.span_end == IDENTIFIER_AT
    assert hit.created_at == corpus.conversation.created_at[IDENTIFIER_AT]
    assert hit.score > 0


async def test_summaries_are_searchable_at_every_level(engine: AsyncEngine, corpus: Corpus) -> None:
    async with engine.connect() as conn:
        counts = await tree_nodes.level_counts(
            conn, tenant_id=corpus.tenant_id, conversation_id=corpus.conversation_id
        )
    top = max(counts)
    assert top >= 2, counts
    for level in range(1, top + 1):
        hits = await search(engine, corpus, "database migration rollback plan", levels=[level])
        assert hits and all(hit.level == level for hit in hits), level
        # A summary covers a span of messages.
        assert all(hit.span_start <= hit.span_end for hit in hits)
    mixed = await search(engine, corpus, "how does the hiring relate to the budget", limit=50)
    assert {hit.level for hit in mixed} - {0}, "relational queries must reach summaries"


async def test_excluded_tail_is_not_returned(engine: AsyncEngine, corpus: Corpus) -> None:
    hits = await search(
        engine,
        corpus,
        IDENTIFIER,
        limit=20,
        exclude_from=(corpus.conversation_id, IDENTIFIER_AT),
    )
    assert all(hit.span_start < IDENTIFIER_AT for hit in hits)
    assert corpus.identifier_node not in [hit.node_id for hit in hits]


async def test_sequential_queries_prefer_recent_episodes(
    engine: AsyncEngine, corpus: Corpus
) -> None:
    query = "the flight booking we discussed last time"
    assert retrieval.route(query) is Route.SEQUENTIAL
    flat = await search(engine, corpus, query, which=Route.FLAT, limit=10)
    recent = await search(engine, corpus, query, limit=10)
    assert recent[0].span_end == LATE_AT
    assert flat[0].span_end < LATE_AT
    assert mean_end(recent) > mean_end(flat)


async def test_messages_not_embedded_yet_are_found_by_full_text(
    engine: AsyncEngine, corpus: Corpus
) -> None:
    fresh = f"The new gate code is {uuid.uuid4().hex[:10]} starting Monday."
    code = fresh.split()[5]
    async with engine.begin() as conn:
        appended = await store.append(
            conn,
            tenant_id=corpus.tenant_id,
            conversation_id=corpus.conversation_id,
            messages=[{"role": "user", "content": fresh}],
            model="gpt-4o",
        )
    try:
        hits = await search(engine, corpus, f"what is the gate code {code}", limit=3)
        assert hits[0].node_id == appended.node_ids[0]
    finally:
        async with engine.begin() as conn:
            await conn.execute(nodes.delete().where(nodes.c.id == appended.node_ids[0]))


def mean_end(hits: list[retrieval.Hit]) -> float:
    return sum(hit.span_end for hit in hits) / len(hits)


# -- tenant isolation -------------------------------------------------------------------------


async def test_another_tenant_sees_nothing(engine: AsyncEngine, corpus: Corpus) -> None:
    other = await new_tenant(engine)
    # Even naming the conversation's id, another tenant finds nothing in it.
    assert await search(engine, corpus, IDENTIFIER, tenant_id=other) == []
    assert await search(engine, corpus, MEANING_QUERY, tenant_id=other) == []
    # The other tenant's own conversation holding the same text is found only by its owner.
    async with engine.begin() as conn:
        history = [{"role": "user", "content": IDENTIFIER_TEXT}]
        found = await identity.identify(
            conn, tenant_id=other, external_id="isolation", user=None, messages=history
        )
        own = await store.store_new(
            conn, tenant_id=other, found=found, messages=history, model="gpt-4o"
        )
    mine = await search(
        engine,
        corpus,
        IDENTIFIER,
        tenant_id=other,
        conversation_ids=[own.conversation.id, corpus.conversation_id],
    )
    assert [hit.node_id for hit in mine] == own.node_ids
    theirs = await search(
        engine, corpus, IDENTIFIER, conversation_ids=[corpus.conversation_id, own.conversation.id]
    )
    assert own.node_ids[0] not in [hit.node_id for hit in theirs]
    assert theirs[0].node_id == corpus.identifier_node


async def test_conversations_of_one_tenant_are_searched_together(
    engine: AsyncEngine, corpus: Corpus
) -> None:
    async with engine.begin() as conn:
        history = [{"role": "user", "content": "My locker combination is 4-19-33, QV-7781."}]
        found = await identity.identify(
            conn,
            tenant_id=corpus.tenant_id,
            external_id=f"sibling-{uuid.uuid4().hex}",
            user=None,
            messages=history,
        )
        other = await store.store_new(
            conn, tenant_id=corpus.tenant_id, found=found, messages=history, model="gpt-4o"
        )
    hits = await search(
        engine,
        corpus,
        "locker combination QV-7781",
        conversation_ids=[corpus.conversation_id, other.conversation.id],
        limit=3,
    )
    assert hits[0].node_id == other.node_ids[0]
    assert hits[0].conversation_id == other.conversation.id


# -- pure parts -------------------------------------------------------------------------------


def test_route() -> None:
    assert retrieval.route("what did we say last time about the trip?") is Route.SEQUENTIAL
    assert retrieval.route("Did I mention this earlier") is Route.SEQUENTIAL
    assert retrieval.route("what happened before the launch") is Route.SEQUENTIAL
    assert retrieval.route("anything recently?") is Route.SEQUENTIAL
    assert retrieval.route("How does the budget relate to hiring?") is Route.RELATIONAL
    assert retrieval.route("why did we pick Postgres") is Route.RELATIONAL
    assert retrieval.route("What is the invoice number?") is Route.FLAT


def test_websearch_query_ors_words_and_keeps_phrases() -> None:
    assert retrieval.websearch_query("red apple") == "red or apple"
    assert retrieval.websearch_query('find "exact phrase" now') == '"exact phrase" or find or now'
    assert retrieval.websearch_query("-not or this") == "not or this"
    assert retrieval.websearch_query("   ") == ""


def test_identifiers_are_the_words_with_digits() -> None:
    assert retrieval.identifiers("is PO-2314 done, or v2.3.1 on 2025-11-15 at 9am?") == [
        "PO-2314",
        "v2.3.1",
        "2025-11-15",
    ]
    assert retrieval.identifiers("nothing here") == []


def test_identifiers_of_a_long_word_are_read_once() -> None:
    """A long run of word characters (a pasted blob, a path) is read once, not once per
    character: the search a model or a chat turn asks for must not stall the event loop. Read
    once per character, these words take hours (8,000 characters took 4 s), past the suite's
    timeout; no time is asserted here."""
    words = ("x" * 500_000, "9" + "x" * 500_000, "a/" * 250_000)
    assert [retrieval.identifiers(f"see {word} now") for word in words] == [[], [], []]
    assert retrieval.identifiers("x" * 500_000 + "7") == ["x" * 500_000 + "7"]


_OLD_IDENTIFIER = re.compile(r"[\w][\w./:#-]*\d[\w./:#-]*|[\w][\w./:#-]*[./:#-]\d+")


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab1_./:#- ,?é٣", max_size=30))
def test_identifiers_are_what_the_plain_pattern_finds(query: str) -> None:
    found = (word.strip(".,;:!?#-/") for word in _OLD_IDENTIFIER.findall(query))
    assert retrieval.identifiers(query) == list(
        dict.fromkeys(word for word in found if len(word) >= 4)
    )


def test_names_are_found_and_stripped() -> None:
    names = {"Caroline", "Mel"}
    assert retrieval.participants_named("What did Caroline's sister say?", names) == {"Caroline"}
    assert retrieval.participants_named("Melanie and Carol", names) == set()
    assert retrieval.without_names("What did Caroline's sister say?", names) == (
        "What did sister say?"
    )
    assert retrieval.without_names("Caroline", names) == "Caroline"  # nothing else to search


def test_periods_a_query_names() -> None:
    assert retrieval.periods("What did we do in March 2023?") == [
        (date(2023, 3, 1), date(2023, 4, 7))  # a month, and the week after
    ]
    assert retrieval.periods("on March 16, 2022 and 3 Oct 2023") == [
        (date(2022, 3, 16), date(2022, 3, 23)),
        (date(2023, 10, 3), date(2023, 10, 10)),
    ]
    assert retrieval.periods("the 2023-12 report") == [(date(2023, 12, 1), date(2024, 1, 7))]
    assert retrieval.periods("May I ask about Feb 30, 2023 or PO-2314?") == []


def place(
    seq: int,
    *,
    conv: int = 1,
    level: int = 0,
    name: str | None = None,
    created_at: datetime | None = None,
) -> Place:
    return Place(key=(conv, level, seq), span_end=seq, name=name, created_at=created_at)


def test_the_named_speaker_and_period_raise_their_own_messages_not_their_neighbours() -> None:
    march = datetime(2023, 3, 20, tzinfo=UTC)
    leg = Candidates([place(10), place(30, name="Ann"), place(50, created_at=march)])
    plain = fusion.fuse([leg], which=Route.FLAT, newest={1: 100})
    named = fusion.fuse([leg], which=Route.FLAT, newest={1: 100}, speakers={"Ann"})
    assert named[(1, 0, 30)] > named[(1, 0, 10)] and plain[(1, 0, 30)] < plain[(1, 0, 10)]
    assert named[(1, 0, 31)] == plain[(1, 0, 31)]  # what it lends is not raised
    dated = fusion.fuse(
        [leg], which=Route.FLAT, newest={1: 100}, within=retrieval.periods("in March 2023")
    )
    assert dated[(1, 0, 50)] > dated[(1, 0, 10)] and plain[(1, 0, 50)] < plain[(1, 0, 10)]
    assert dated[(1, 0, 51)] == plain[(1, 0, 51)]
    may = fusion.fuse(
        [leg], which=Route.FLAT, newest={1: 100}, within=retrieval.periods("in May 2023")
    )
    assert may == plain


def test_fusion_rewards_agreement_contiguity_and_the_named_speaker() -> None:
    a = Candidates([place(10), place(20), place(30, name="Ann")])
    b = Candidates([place(20), place(40)])
    scores = fusion.fuse([a, b], which=Route.FLAT, newest={1: 100}, kernel=(0.5,))
    assert max(scores, key=scores.__getitem__) == (1, 0, 20)  # found by both legs
    # Neighbours of hits get a share of their score though neither leg found them.
    assert scores[(1, 0, 21)] > 0 and scores[(1, 0, 19)] > 0
    assert (1, 0, 22) not in scores
    named = fusion.fuse([a, b], which=Route.FLAT, newest={1: 100}, speakers={"Ann"})
    plain = fusion.fuse([a, b], which=Route.FLAT, newest={1: 100})
    assert named[(1, 0, 30)] > plain[(1, 0, 30)]
    excluded = fusion.fuse([a, b], which=Route.FLAT, newest={1: 100}, exclude_from=(1, 25))
    assert all(key[2] < 25 for key in excluded)
    # An exact identifier match outranks rank fusion, and its bonus is not lent to neighbours.
    exact = Candidates([place(20), Place(key=(1, 0, 60), span_end=60, name=None, exact=True)])
    boosted = fusion.fuse([exact], which=Route.FLAT, newest={1: 100}, kernel=(0.8,))
    assert max(boosted, key=boosted.__getitem__) == (1, 0, 60)
    assert boosted[(1, 0, 61)] < boosted[(1, 0, 21)]
    # Nothing past the newest message is invented.
    assert all(key[2] <= 41 for key in fusion.fuse([b], which=Route.FLAT, newest={1: 40}))


def test_an_identifier_match_outranks_a_standout_first_in_both_vector_legs() -> None:
    # The full-text leg finds only the message holding the code; the vector and passage legs
    # rank a near-miss first, standing out of a tight field, with its neighbours close behind.
    fulltext = Candidates([Place(key=(1, 0, 90), span_end=90, name=None, exact=True)])
    sims = [0.40, 0.37, 0.37, *(0.36 for _ in range(47))]
    seqs = [40, 41, 39, *range(100, 147)]
    vector, passage = (
        Candidates(
            [
                Place(key=(1, 0, seq), span_end=seq, name=None, similarity=sim)
                for seq, sim in zip(seqs, sims, strict=True)
            ]
        )
        for _ in range(2)
    )
    scores = fusion.fuse([fulltext, vector, passage], which=Route.FLAT, newest={1: 200})
    assert fusion.ranked(scores, 2)[0] == (1, 0, 90)
    # The standout keeps a bonus of its own over its neighbours.
    assert scores[(1, 0, 40)] > scores[(1, 0, 41)] + fusion.EXACT_BONUS / (fusion.RRF_K + 2)


_DAYS = [datetime(2023, 3, day, tzinfo=UTC) for day in (1, 15, 30)]
_PLACES = st.builds(
    lambda conv, level, seq, name, exact, sim, day: Place(
        key=(conv, level, seq),
        span_end=seq + 3 * level,
        name=name,
        exact=exact,
        similarity=sim,
        created_at=day,
    ),
    st.sampled_from([1, 2]),
    st.sampled_from([0, 0, 0, 1]),
    st.integers(0, 60),
    st.sampled_from([None, "Ann", "Bo"]),
    st.booleans(),
    st.one_of(st.none(), st.floats(0.0, 1.0)),
    st.sampled_from([None, *_DAYS]),
)


@settings(max_examples=200, deadline=None)
@given(
    legs=st.lists(st.lists(_PLACES, max_size=30), min_size=1, max_size=3),
    which=st.sampled_from(list(Route)),
    speakers=st.sampled_from([set(), {"Ann"}, {"Ann", "Bo"}]),
    exclude=st.sampled_from([None, (1, 40), (2, 10)]),
    within=st.sampled_from([[], retrieval.periods("in March 2023")]),
)
def test_one_fusion_pass_gives_the_fused_and_the_own_scores_exactly(
    legs: list[list[Place]],
    which: Route,
    speakers: set[str],
    exclude: tuple[int, int] | None,
    within: list[tuple[date, date]],
) -> None:
    """The recall note's one pass (`fuse` filling `own`) is, float for float, `fuse` with and
    without contiguity."""
    candidates = [Candidates(leg) for leg in legs]
    same: dict[str, Any] = {
        "which": which,
        "newest": {1: 50},
        "primary": 1,
        "speakers": speakers,
        "exclude_from": exclude,
        "within": within,
    }
    own: dict[fusion.Key, float] = {}
    fused = fusion.fuse(candidates, own=own, **same)
    assert fused == fusion.fuse(candidates, **same)
    assert own == fusion.fuse(candidates, kernel=(), **same)


def test_a_long_neighbour_keeps_little_of_what_contiguity_lent_it() -> None:
    """The note's worth (`recall_note._worth`): a message's own fused score counts in full, what
    its neighbours lent it only up to `LENT_TOKENS` of its length, so a long answer next to the
    best match gives way to a shorter match of its own."""
    leg = Candidates([place(10), *(place(seq) for seq in range(30, 36)), place(50)])
    fused = fusion.fuse([leg], which=Route.FLAT, newest={1: 100})
    own = fusion.fuse([leg], which=Route.FLAT, newest={1: 100}, kernel=())

    def hit(seq: int, length: int) -> retrieval.Hit:
        return retrieval.Hit(
            node_id=seq,
            conversation_id=1,
            level=0,
            seq=seq,
            span_start=seq,
            span_end=seq,
            role="assistant",
            text="x",
            created_at=datetime(2024, 1, 1, tzinfo=UTC),
            score=fused[(1, 0, seq)],
            token_count=length,
        )

    long_answer, short_answer, match = hit(11, 600), hit(12, 80), hit(50, 600)
    assert long_answer.score > match.score  # lent the best match's score, it outranked it
    worth = recall_note._worth([long_answer, short_answer, match], own=own)
    assert [one.seq for _, one in worth] == [50, 12, 11]
    by_seq = {one.seq: value for value, one in worth}
    assert by_seq[50] == pytest.approx(own[(1, 0, 50)])  # its own score, whatever its length
    assert by_seq[11] == pytest.approx(fused[(1, 0, 11)] * recall_note.LENT_TOKENS / 600)
    assert by_seq[12] == pytest.approx(fused[(1, 0, 12)])  # short: lent in full
