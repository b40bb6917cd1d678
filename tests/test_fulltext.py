"""The full-text leg of retrieval on common words (`memory.recall.retrieval.fulltext_candidates`)
and the lexeme statistics it reads (`lexemes`, kept by a trigger on `nodes`, migration 0011).

The conversations are small and made of words chosen so that some are held by every message;
the leg is run with a small `reads` so that those words are the common ones it must not read.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from typing import Any

from sqlalchemy import func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.recall import retrieval
from memory.recall.fusion import Candidates
from memory.schema import conversations, lexemes, tenants
from memory.write import conversations as conversation_store
from memory.write import store

FILLER = 40
LARGE = 3000
RARE = "zeppelin"


async def new_conversation(
    engine: AsyncEngine, messages: list[dict[str, Any]], *, batch: int = 7
) -> tuple[int, int]:
    """A new tenant's conversation holding `messages`, stored `batch` at a time (so that the
    counts of several inserts add up): (tenant id, conversation id)."""
    async with engine.begin() as conn:
        tenant = await conn.scalar(
            insert(tenants).values(name=f"fulltext-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
        assert tenant is not None
        ref, _ = await store.open_conversation(conn, tenant_id=tenant, external_id="c")
        for start in range(0, len(messages), batch):
            await store.append(
                conn,
                tenant_id=tenant,
                conversation_id=ref.id,
                messages=messages[start : start + batch],
                model="gpt-4o",
            )
    return int(tenant), ref.id


def weather_reports() -> list[dict[str, Any]]:
    """Every message holds "weather" and "report"; two also hold the rare word, one of them
    with the common words, one without."""
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"weather report {i}"}
        for i in range(FILLER)
    ]
    messages[10] = {"role": "user", "content": f"{RARE} weather report"}
    messages[20] = {"role": "user", "content": f"{RARE} sighted today"}
    return messages


async def leg(
    engine: AsyncEngine, tenant: int, conversation: int, query: str, *, reads: int
) -> Candidates:
    async with engine.connect() as conn:
        return await retrieval.fulltext_candidates(
            conn, tenant_id=tenant, conversation_ids=[conversation], query=query, reads=reads
        )


def seqs(found: Candidates) -> list[int]:
    return [place.key[2] for place in found.ranked if place.key[1] == 0]


async def nodes_read(
    engine: AsyncEngine, tenant: int, conversation: int, query: str, *, reads: int
) -> int:
    """Rows of `nodes` the leg's statement reads (EXPLAIN ANALYZE: rows every scan of `nodes`
    returned or filtered out, over all its loops)."""
    params = {
        "tenant_id": tenant,
        "conversation_ids": [conversation],
        "levels": None,
        "abandoned": False,
        "exclude_conversation": None,
        "exclude_from": None,
        "query": query,
        "websearch": retrieval.websearch_query(query),
        "identifiers": retrieval.identifiers(query),
        "limit": retrieval.CANDIDATES,
        "reads": reads,
    }
    statement = text("EXPLAIN (ANALYZE, FORMAT JSON) " + str(retrieval._FULLTEXT.text))
    async with engine.connect() as conn:
        plan = await conn.scalar(statement, params)
    [root] = plan if isinstance(plan, list) else json.loads(plan)

    def walk(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield node
        for child in node.get("Plans", []):
            yield from walk(child)

    return sum(
        (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        for node in walk(root["Plan"])
        if node.get("Relation Name") == "nodes"
    )


async def test_lexeme_counts_follow_the_stored_messages(engine: AsyncEngine) -> None:
    messages = [
        {"role": "system", "content": "weather bureau rules"},  # never returned, not counted
        *weather_reports(),
        {"role": "assistant", "content": "Weather! weather, WEATHER."},  # counted once
    ]
    tenant, conversation = await new_conversation(engine, messages)
    async with engine.connect() as conn:
        counts = dict(
            (
                await conn.execute(
                    select(lexemes.c.lexeme, lexemes.c.messages).where(
                        lexemes.c.conversation_id == conversation
                    )
                )
            ).all()
        )
    assert counts["report"] == FILLER - 1  # all but the one of message 20
    assert counts["weather"] == FILLER  # and the last message, once
    assert counts["zeppelin"] == 2 and counts["sight"] == 1
    assert "bureau" not in counts and "rule" not in counts
    async with engine.begin() as conn:
        await conversation_store.delete_conversation(conn, tenant_id=tenant, external_id="c")
        left = await conn.scalar(
            select(func.count()).where(lexemes.c.conversation_id == conversation)
        )
    assert left == 0


async def test_common_words_are_scored_on_what_rarer_words_find_not_read(
    engine: AsyncEngine,
) -> None:
    tenant, conversation = await new_conversation(engine, weather_reports())
    query = f"{RARE} weather report"
    every = await leg(engine, tenant, conversation, query, reads=10_000)
    rare_only = await leg(engine, tenant, conversation, query, reads=5)
    # Reading every word finds every message; reading the rare word only, its two messages,
    # ranked as reading every word ranks them: the common words still count where they are.
    assert sorted(seqs(every)) == list(range(FILLER))
    assert seqs(rare_only) == [10, 20] == seqs(every)[:2]
    # A question of common words only finds nothing here (the vector legs still search).
    assert seqs(await leg(engine, tenant, conversation, "weather report", reads=5)) == []


async def test_within_the_reads_the_ranking_is_that_of_every_word(engine: AsyncEngine) -> None:
    tenant, conversation = await new_conversation(engine, weather_reports())
    for query in (f"{RARE} weather report", "weather report 7", "sighted weather"):
        default = await leg(engine, tenant, conversation, query, reads=retrieval.FULLTEXT_READS)
        every = await leg(engine, tenant, conversation, query, reads=10**9)
        assert default == every and default.ranked


async def test_another_tenants_counts_are_not_read(engine: AsyncEngine) -> None:
    """Counts are read within the tenant: another tenant's conversation in the scope, where
    the rare word is common, changes nothing (its nodes are out of scope anyway)."""
    tenant, conversation = await new_conversation(engine, weather_reports())
    other, theirs = await new_conversation(
        engine, [{"role": "user", "content": f"{RARE} {i}"} for i in range(10)]
    )
    async with engine.connect() as conn:
        both = await retrieval.fulltext_candidates(
            conn,
            tenant_id=tenant,
            conversation_ids=[conversation, theirs],
            query=f"{RARE} weather report",
            reads=5,
        )
        owner = await conn.scalar(
            select(conversations.c.tenant_id).where(conversations.c.id == theirs)
        )
    assert owner == other != tenant
    assert seqs(both) == [10, 20]


async def test_an_identifier_is_read_by_its_rarest_lexeme(engine: AsyncEngine) -> None:
    """A phrase term (an identifier the parser splits) counts as held by at most as many
    messages as its rarest lexeme: "AB-4471" is read where "ab" is too common to be."""
    messages = [{"role": "user", "content": f"ab {i} note"} for i in range(30)]
    messages.append({"role": "user", "content": "ticket AB-4471 was closed"})
    tenant, conversation = await new_conversation(engine, messages)
    query = "what happened to AB-4471"
    found = await leg(engine, tenant, conversation, query, reads=2)
    assert seqs(found) == [30] and found.ranked[0].exact


async def test_what_is_read_does_not_grow_with_common_words(engine: AsyncEngine) -> None:
    """On a conversation large enough for the planner to use the indexes, the leg reads the
    nodes of the rare word only, however many messages hold the common ones."""
    messages = [{"role": "user", "content": f"weather report {i}"} for i in range(LARGE)]
    messages[777] = {"role": "user", "content": f"{RARE} weather report"}
    tenant, conversation = await new_conversation(engine, messages, batch=1000)
    async with engine.begin() as conn:
        await conn.execute(text("ANALYZE nodes"))
        await conn.execute(text("ANALYZE lexemes"))
    query = f"{RARE} weather report"
    # The planner may look the rare word up in the whole index and filter by conversation on
    # the rows it finds (other tests' conversations hold it too): still none of the common.
    async with engine.connect() as conn:
        holding_rare = await conn.scalar(
            text("SELECT count(*) FROM nodes WHERE tsv @@ to_tsquery('english', :word)"),
            {"word": RARE},
        )
    assert await nodes_read(engine, tenant, conversation, query, reads=100) <= holding_rare + 10
    assert await nodes_read(engine, tenant, conversation, query, reads=10**9) >= LARGE
    found = await leg(engine, tenant, conversation, query, reads=100)
    assert seqs(found) == [777]


async def test_the_ranking_is_bm25_without_term_frequency(engine: AsyncEngine) -> None:
    """The order is that of Σ idf over the query words a message holds, normalized by its
    length, computed here by hand. The three rarer words are read, each message once however
    many of them it holds; the common word, not read, still scores."""
    words = (RARE, "marmalade", "quokka", "weather")
    contents = [
        "a quokka and marmalade at the weather desk",
        "marmalade weather noon",  # the common word breaks its tie with the next, not seq
        "marmalade at noon",
        "quokka pending, weather permitting, much later than anyone had wanted it to be",
        f"{RARE} over the quokka",
        f"a {RARE} report on the weather",
        *(f"weather report {i}" for i in range(20)),
    ]
    messages = [{"role": "user", "content": content} for content in contents]
    tenant, conversation = await new_conversation(engine, messages)
    found = await leg(engine, tenant, conversation, " ".join(words), reads=10)
    holds = ", ".join(f"tsv @@ to_tsquery('english', :w{i})" for i in range(len(words)))
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    f"SELECT seq, token_count, {holds} FROM nodes"
                    " WHERE conversation_id = :c AND level = 0 ORDER BY seq"
                ),
                {"c": conversation, **{f"w{i}": word for i, word in enumerate(words)}},
            )
        ).all()
    held = {seq: terms for seq, _, *terms in rows}
    tokens = {seq: count for seq, count, *_ in rows}
    df = [sum(terms[i] for terms in held.values()) for i in range(len(words))]
    assert df == [2, 3, 3, 24]  # the common word, held by 24 messages, is not read at 10
    idf = [math.log(1 + (len(rows) - d + 0.5) / (d + 0.5)) for d in df]
    reached = [seq for seq, terms in held.items() if any(terms[:3])]
    average = sum(tokens[seq] for seq in reached) / len(reached)
    score = {
        seq: sum(w for w, has in zip(idf, held[seq], strict=True) if has)
        * 2.2
        / (1 + 1.2 * (0.25 + 0.75 * tokens[seq] / average))
        for seq in reached
    }
    expected = sorted(reached, key=lambda seq: (score[seq], seq), reverse=True)
    assert seqs(found) == expected and sorted(expected) == [0, 1, 2, 3, 4, 5]
    assert expected.index(1) < expected.index(2)
