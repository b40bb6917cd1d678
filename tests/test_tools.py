"""The memory tools (`memory.recall.tools`) against a real Postgres: what each returns, how they are
scoped, and how they fail.

Every test builds its own tenant (the `tenant_id` fixture) with one conversation of messages
stored by `store.ingest` and a small summary tree inserted beside them (two level-1 segments
under one level-2 node), and a second tenant holding look-alike data that must never show.
Embeddings come from a deterministic fake (`embedding_vector` of the fake upstream), a real
implementation of the `Embedder` interface.
"""

import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import insert, update
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.upstream_script import embedding_vector
from memory.recall import browsing, tools
from memory.schema import nodes, tenants
from memory.write import identity, store

MODEL = "gpt-4o-mini"


class FakeEmbedder:
    name = "fake"
    dim = 384

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [embedding_vector(text, self.dim) for text in texts]


@dataclass
class Stored:
    tenant_id: int
    conversation_id: int
    message_ids: list[int]
    segment_ids: list[int]
    root_id: int

    @property
    def scope(self) -> tools.Scope:
        return tools.Scope(tenant_id=self.tenant_id, conversation_id=self.conversation_id)


MESSAGES: list[Mapping[str, Any]] = [
    {"role": "system", "content": "You are a travel assistant."},
    {"role": "user", "content": "Book flight LX318 to Zurich for March 3."},
    {"role": "assistant", "content": "Booked LX318, seat 14C, confirmation QX7Z2."},
    {"role": "user", "content": "Also a hotel near the lake, budget 180 CHF a night."},
    {"role": "assistant", "content": "Hotel Seeblick, 165 CHF, breakfast included."},
    {"role": "user", "content": "Thanks. New topic: my garden tomatoes have yellow leaves."},
    {"role": "assistant", "content": "Likely nitrogen deficiency; try a balanced fertilizer."},
    {"role": "user", "content": "a" * 5000 + "!"},
]


async def store_conversation(
    engine: AsyncEngine, tenant_id: int, messages: Sequence[Mapping[str, Any]] = MESSAGES
) -> Stored:
    async with engine.begin() as conn:
        history = list(messages)
        found = await identity.identify(
            conn,
            tenant_id=tenant_id,
            external_id=f"tools-{uuid.uuid4().hex}",
            user=None,
            messages=history,
        )
        appended = await store.store_new(
            conn, tenant_id=tenant_id, found=found, messages=history, model=MODEL
        )
        conversation_id = appended.conversation.id
        segments = []
        for seq, (first, last, text) in enumerate(
            [(0, 4, "Travel: flight LX318 and Hotel Seeblick booked."), (5, 7, "Garden advice.")]
        ):
            segments.append(
                await conn.scalar(
                    insert(nodes)
                    .values(
                        tenant_id=tenant_id,
                        conversation_id=conversation_id,
                        level=1,
                        seq=seq,
                        span_start=first,
                        span_end=last,
                        text=text,
                        meta={"started_at": "2025-03-01T10:00:00+00:00"},
                    )
                    .returning(nodes.c.id)
                )
            )
            await conn.execute(
                update(nodes)
                .where(
                    nodes.c.conversation_id == conversation_id,
                    nodes.c.level == 0,
                    nodes.c.seq.between(first, last),
                )
                .values(parent_id=segments[-1])
            )
        root = await conn.scalar(
            insert(nodes)
            .values(
                tenant_id=tenant_id,
                conversation_id=conversation_id,
                level=2,
                seq=0,
                span_start=0,
                span_end=len(messages) - 1,
                text="A trip to Zurich, then gardening.",
            )
            .returning(nodes.c.id)
        )
        await conn.execute(update(nodes).where(nodes.c.id.in_(segments)).values(parent_id=root))
    assert root is not None
    return Stored(tenant_id, conversation_id, appended.node_ids, [int(s) for s in segments], root)


@pytest.fixture
async def stored(engine: AsyncEngine, tenant_id: int) -> Stored:
    return await store_conversation(engine, tenant_id)


@pytest.fixture
async def other(engine: AsyncEngine) -> Stored:
    """Another tenant with the same conversation."""
    async with engine.begin() as conn:
        other_tenant = await conn.scalar(
            insert(tenants).values(name=f"test-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
    assert other_tenant is not None
    return await store_conversation(engine, int(other_tenant))


async def run(
    engine: AsyncEngine,
    scope: tools.Scope,
    name: str,
    arguments: object,
    limits: tools.Limits | None = None,
) -> str:
    async with engine.connect() as conn:
        return await tools.run_tool(
            conn,
            scope,
            name=name,
            arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            embedder=FakeEmbedder(),
            limits=limits or tools.Limits(),
        )


def ids(text: str) -> list[int]:
    return [int(found) for found in re.findall(r"\[#(\d+)\]", text)]


# -- definitions ---------------------------------------------------------------------------------


def test_definitions_are_openai_function_tools() -> None:
    definitions = tools.definitions()
    assert [d["function"]["name"] for d in definitions] == [
        "memory_expand",
        "memory_search",
        "memory_browse",
        "memory_find",
    ]
    for definition in definitions:
        assert definition["type"] == "function"
        parameters = definition["function"]["parameters"]
        assert parameters["type"] == "object"
        assert set(parameters["required"]) <= set(parameters["properties"])
        assert definition["function"]["description"]
    definitions[0]["function"]["name"] = "changed"
    assert tools.definitions()[0]["function"]["name"] == "memory_expand"  # a fresh copy


def test_tool_tokens_counts_the_definitions() -> None:
    cost = tools.tool_tokens("gpt-4o")
    assert 150 < cost < 400  # short: they are reserved out of every prompt's budget
    assert tools.tool_tokens("gpt-4o-mini") == cost  # same encoding
    assert tools.tool_tokens("llama-3") > 0


# -- expand --------------------------------------------------------------------------------------


async def test_expand_a_segment_shows_its_messages_verbatim(
    engine: AsyncEngine, stored: Stored
) -> None:
    result = await run(engine, stored.scope, "memory_expand", {"node_id": stored.segment_ids[0]})
    assert ids(result) == [stored.segment_ids[0], *stored.message_ids[:5]]
    assert "level-1 summary 0" in result and "messages 0-4" in result
    assert "Booked LX318, seat 14C, confirmation QX7Z2." in result
    assert "assistant: Booked LX318" in result
    assert "tomatoes" not in result


async def test_expand_a_high_summary_shows_its_summaries(
    engine: AsyncEngine, stored: Stored
) -> None:
    result = await run(engine, stored.scope, "memory_expand", {"node_id": stored.root_id})
    assert ids(result) == [stored.root_id, *stored.segment_ids]
    assert "Travel: flight LX318" in result and "Garden advice." in result


async def test_expand_a_message_shows_its_neighbours(engine: AsyncEngine, stored: Stored) -> None:
    target = stored.message_ids[3]
    result = await run(engine, stored.scope, "memory_expand", {"node_id": f"[#{target}]"})
    assert ids(result)[0] == target  # the header
    assert ids(result)[1:] == stored.message_ids[1:6]
    [marked] = [line for line in result.splitlines() if line.startswith(browsing.MARK)]
    assert f"[#{target}]" in marked and "budget 180 CHF" in marked


async def test_expand_falls_back_to_the_span_without_parent_links(
    engine: AsyncEngine, stored: Stored
) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            update(nodes).where(nodes.c.parent_id == stored.segment_ids[1]).values(parent_id=None)
        )
    result = await run(engine, stored.scope, "memory_expand", {"node_id": stored.segment_ids[1]})
    assert ids(result) == [stored.segment_ids[1], *stored.message_ids[5:]]


async def test_another_tenants_node_is_missing(
    engine: AsyncEngine, stored: Stored, other: Stored
) -> None:
    theirs = await run(engine, stored.scope, "memory_expand", {"node_id": other.message_ids[2]})
    assert theirs == f"error: node {other.message_ids[2]} does not exist"
    nowhere = 2**62
    missing = await run(engine, stored.scope, "memory_expand", {"node_id": nowhere})
    assert missing == f"error: node {nowhere} does not exist"
    # The other way round too, and for every tool.
    result = await run(engine, other.scope, "memory_expand", {"node_id": stored.root_id})
    assert result == f"error: node {stored.root_id} does not exist"


async def test_a_conversation_outside_the_scope_is_missing(
    engine: AsyncEngine, stored: Stored
) -> None:
    sibling = await store_conversation(engine, stored.tenant_id, MESSAGES[:3])
    result = await run(engine, stored.scope, "memory_expand", {"node_id": sibling.message_ids[1]})
    assert result == f"error: node {sibling.message_ids[1]} does not exist"
    recall = tools.Scope(
        tenant_id=stored.tenant_id,
        conversation_id=stored.conversation_id,
        recall=(sibling.conversation_id,),
    )
    result = await run(engine, recall, "memory_expand", {"node_id": sibling.message_ids[1]})
    assert sibling.message_ids[1] in ids(result)


# -- browse --------------------------------------------------------------------------------------


async def test_browse_messages_by_seq(engine: AsyncEngine, stored: Stored) -> None:
    result = await run(engine, stored.scope, "memory_browse", {"level": 0, "start": 1, "end": 3})
    assert result.splitlines()[0] == "messages 1-3:"
    assert ids(result) == stored.message_ids[1:4]
    assert "message 1 ·" in result and "user: Book flight LX318" in result


async def test_browse_summaries(engine: AsyncEngine, stored: Stored) -> None:
    result = await run(engine, stored.scope, "memory_browse", {"level": 1})
    assert ids(result) == stored.segment_ids
    assert "of messages 5-7" in result


async def test_browse_an_empty_range_says_what_exists(engine: AsyncEngine, stored: Stored) -> None:
    result = await run(engine, stored.scope, "memory_browse", {"level": 3})
    assert result == (
        "no level-3 nodes in 0-49; the conversation holds level 0: 8 nodes (0-7), "
        "level 1: 2 nodes (0-1), level 2: 1 nodes (0-0)"
    )
    other_tenant = tools.Scope(tenant_id=stored.tenant_id + 10**9, conversation_id=1)
    result = await run(engine, other_tenant, "memory_browse", {"level": 0})
    assert result.endswith("the conversation holds none")


async def test_browse_caps_the_result(engine: AsyncEngine, stored: Stored) -> None:
    small = tools.Limits(result_chars=1000)
    result = await run(engine, stored.scope, "memory_browse", {"level": 0}, limits=small)
    assert len(result) <= 1000 + 200  # the note after the cut
    assert "more lines not shown" in result and "memory_browse(level=0" in result


# -- find ----------------------------------------------------------------------------------------


async def test_find_matches_in_order_within_the_range(engine: AsyncEngine, stored: Stored) -> None:
    result = await run(engine, stored.scope, "memory_find", {"pattern": r"LX\d+"})
    assert ids(result) == stored.message_ids[1:3]
    assert result.startswith("2 messages match 'LX\\\\d+':")
    ranged = await run(
        engine, stored.scope, "memory_find", {"pattern": "(?i)lx318", "start_seq": 2, "end_seq": 9}
    )
    assert ids(ranged) == [stored.message_ids[2]]
    none = await run(engine, stored.scope, "memory_find", {"pattern": "kangaroo"})
    assert none == "0 messages match 'kangaroo'."


async def test_find_never_reads_another_tenant(
    engine: AsyncEngine, stored: Stored, other: Stored
) -> None:
    result = await run(engine, stored.scope, "memory_find", {"pattern": "Seeblick"})
    assert ids(result) == [stored.message_ids[4]]


async def test_find_refuses_a_catastrophic_pattern_quickly(
    engine: AsyncEngine, stored: Stored
) -> None:
    started = time.monotonic()
    result = await run(
        engine,
        stored.scope,
        "memory_find",
        {"pattern": "(a|aa)+$"},
        limits=tools.Limits(regex_timeout=0.3),
    )
    elapsed = time.monotonic() - started
    assert result.startswith("error: the pattern '(a|aa)+$' ran out of time at message 7"), result
    assert elapsed < 2.0


@pytest.mark.parametrize(
    ("arguments", "error"),
    [
        ({"pattern": "("}, "error: the pattern is not a valid regular expression"),
        ({"pattern": "a" * 501}, "error: the pattern is longer than 500 characters"),
        ({"pattern": ""}, "error: pattern is required"),
        ({}, "error: pattern is required"),
    ],
)
async def test_find_refuses_bad_patterns(
    engine: AsyncEngine, stored: Stored, arguments: dict[str, object], error: str
) -> None:
    result = await run(engine, stored.scope, "memory_find", arguments)
    assert result.startswith(error), result


async def test_find_stops_at_the_match_cap(engine: AsyncEngine, tenant_id: int) -> None:
    many: list[Mapping[str, Any]] = [
        {"role": "user", "content": f"ping {n}"} for n in range(tools.MAX_MATCHES + 5)
    ]
    stored = await store_conversation(engine, tenant_id, many)
    result = await run(engine, stored.scope, "memory_find", {"pattern": "ping"})
    assert len(ids(result)) == tools.MAX_MATCHES
    assert result.endswith(
        f"more may match after message {tools.MAX_MATCHES - 1}: continue with start_seq"
    )


# -- search --------------------------------------------------------------------------------------


async def test_search_finds_nodes_of_this_tenant_only(
    engine: AsyncEngine, stored: Stored, other: Stored
) -> None:
    result = await run(engine, stored.scope, "memory_search", {"query": "Seeblick hotel"})
    found = ids(result)
    assert stored.message_ids[4] in found
    assert not set(found) & {*other.message_ids, *other.segment_ids, other.root_id}
    assert all(node in {*stored.message_ids, *stored.segment_ids, stored.root_id} for node in found)
    limited = await run(engine, stored.scope, "memory_search", {"query": "LX318", "limit": 1})
    assert len(ids(limited)) == 1


# -- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "arguments", "error"),
    [
        ("memory_expand", "{not json", "error: the arguments are not valid JSON"),
        ("memory_expand", "[1]", "error: the arguments must be a JSON object"),
        ("memory_expand", {}, "error: node_id is required"),
        ("memory_expand", {"node_id": "twelve"}, "error: node_id must be an integer"),
        ("memory_expand", {"node_id": True}, "error: node_id must be an integer"),
        ("memory_browse", {"level": -1}, "error: level must be 0"),
        ("memory_browse", {"level": 0, "start": 5, "end": 2}, "error: end must not be before"),
        ("memory_search", {"query": "  "}, "error: query is required"),
        ("memory_delete", {}, "error: there is no tool 'memory_delete'"),
    ],
)
async def test_bad_calls_are_errors_for_the_model(
    engine: AsyncEngine, stored: Stored, name: str, arguments: object, error: str
) -> None:
    result = await run(engine, stored.scope, name, arguments)
    assert result.startswith(error), result


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("memory_expand", {"node_id": "--5"}, "error: node_id must be an integer"),
        ("memory_expand", {"node_id": "\u00b2"}, "error: node_id must be an integer"),
        ("memory_expand", {"node_id": "9" * 5000}, "error: node_id must be an integer"),
        ("memory_expand", {"node_id": 2**70}, f"error: node {2**70} does not exist"),
        ("memory_expand", {"node_id": -(2**70)}, f"error: node {-(2**70)} does not exist"),
        ("memory_expand", {"node_id": 1e300}, "error: node 1000000000000000052504760255204"),
        ("memory_browse", {"level": 2**70}, f"no level-{2**70} nodes in 0-49;"),
        ("memory_browse", {"level": 0, "start": 2**63}, "no level-0 nodes in"),
        ("memory_browse", {"level": 0, "end": 2**70}, "messages 0-7:"),
        ("memory_find", {"pattern": "Zurich", "start_seq": -(2**70), "end_seq": 2**70}, "1 "),
        ("memory_find", {"pattern": "Zurich", "start_seq": 2**70}, "0 messages match"),
    ],
)
async def test_odd_numbers_are_answers_not_crashes(
    engine: AsyncEngine, stored: Stored, name: str, arguments: object, expected: str
) -> None:
    """Numbers a model may write that no column holds (or no int() reads) are an answer or a
    mistake to correct, never an exception out of the tool."""
    result = await run(engine, stored.scope, name, arguments)
    assert result.startswith(expected), result


@pytest.mark.parametrize(
    "query", ["Zurich\x00flight", "\x00", "\ud800 Zurich", "Zurich " + "x" * 100_000]
)
async def test_search_reads_any_text_a_model_writes(
    engine: AsyncEngine, stored: Stored, query: str
) -> None:
    """A NUL or an unpaired surrogate (JSON escapes carry both; Postgres and encoders refuse
    them) is searched as stored messages hold it, escaped; a huge query is answered."""
    result = await run(engine, stored.scope, "memory_search", {"query": query})
    assert not result.startswith("error"), result


@pytest.mark.parametrize("arguments", [5, ["node_id", 1], True])
async def test_arguments_neither_text_nor_object_are_an_error_for_the_model(
    engine: AsyncEngine, stored: Stored, arguments: Any
) -> None:
    """An upstream may relay a model's arguments as any JSON value, not only OpenAI's string."""
    async with engine.connect() as conn:
        result = await tools.run_tool(
            conn, stored.scope, name="memory_expand", arguments=arguments, embedder=FakeEmbedder()
        )
    assert result == "error: the arguments must be a JSON object", result
