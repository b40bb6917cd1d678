"""Prompt assembly (`memory.recall.prompt`, `memory.recall.assemble`, `gateway.openai.chat.dry_run`)
against a real Postgres: the budget is never exceeded (a property test over random conversations
with tool calls), the layout holds (system prompt, one memory message with tags, recent turns whose
tool calls and results are never split, new messages last), a conversation that fits goes unchanged,
and end to end through a real gateway process the upstream receives a prompt within the budget
with the token headers set.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import synthetic
from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.openai import chat
from gateway.settings import Settings
from gateway.state import State
from memory import tokens
from memory.build import tree
from memory.build.summarize import ExtractiveSummarizer
from memory.embeddings import LocalEmbedder
from memory.errors import ContextOverflow
from memory.recall import prompt
from memory.recall.assemble import Assembled
from memory.schema import tenants
from memory.write import identity, store

MODEL = "gpt-4o"
WORDS = [
    *("alpha", "budget", "invoice", "flight", "Lisbon", "migration", "schema", "rollback"),
    *("ticket", "deploy", "garden", "tile", "plumber", "offer", "salary", "candidate"),
    *("venue", "cake", "balloons", "postgres", "index", "vacuum"),
]

Message = dict[str, Any]


async def new_tenant(engine: AsyncEngine) -> int:
    async with engine.begin() as conn:
        created = await conn.scalar(
            insert(tenants).values(name=f"test-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
    assert created is not None
    return int(created)


async def store_conversation(
    engine: AsyncEngine, tenant_id: int, messages: Sequence[Message], *, start: int = 0
) -> tuple[int, list[int]]:
    stamps = [
        datetime(2025, 3, 1, 9, tzinfo=UTC) + timedelta(minutes=i)
        for i in range(start, start + len(messages))
    ]
    async with engine.begin() as conn:
        ref, _ = await store.open_conversation(
            conn, tenant_id=tenant_id, external_id=f"ctx-{uuid.uuid4().hex}"
        )
        appended = await store.append(
            conn,
            tenant_id=tenant_id,
            conversation_id=ref.id,
            messages=messages,
            model=MODEL,
            created_at=stamps,
        )
    return ref.id, appended.node_ids


async def build(
    engine: AsyncEngine,
    tenant_id: int,
    conversation_id: int,
    *,
    system: Sequence[Message],
    new: Sequence[Message],
    new_from: int,
    budget: int,
    reserved: int = 0,
    embedder: LocalEmbedder | None = None,
) -> prompt.BuiltPrompt:
    query = " ".join(tokens.message_text(m) for m in new)
    embed = None
    if embedder is not None:
        local = embedder

        async def embed_one(text: str) -> list[float]:
            return (await local.embed([text]))[0]

        embed = embed_one
    async with engine.begin() as conn:
        return await prompt.build(
            conn,
            tenant_id=tenant_id,
            conversation_id=conversation_id,
            system=system,
            new_messages=new,
            new_from=new_from,
            query=query,
            embed=embed,
            budget=budget,
            model=MODEL,
            reserved_tokens=reserved,
        )


def check_tool_pairs(messages: Sequence[Message]) -> None:
    """Every tool result follows its call's assistant message (only results between), and
    every call of an assistant message in the prompt has its result right after it."""
    open_calls: set[str] = set()
    for message in messages:
        if message["role"] == "tool":
            assert message["tool_call_id"] in open_calls, "a tool result without its call"
            open_calls.discard(message["tool_call_id"])
            continue
        assert not open_calls, f"calls without results: {open_calls}"
        if message["role"] == "assistant" and message.get("tool_calls"):
            open_calls = {call["id"] for call in message["tool_calls"]}
    assert not open_calls or messages[-1]["role"] == "assistant"


def check_layout(
    built: prompt.BuiltPrompt,
    *,
    system: Sequence[Message],
    stored: Sequence[Message],
    new: Sequence[Message],
) -> None:
    messages = built.messages
    assert messages[: len(system)] == list(system)
    if len(messages) == len(system) + len(new):  # a budget too small for any memory
        assert messages[len(system) :] == list(new) and not built.retrieved
        return
    memory = messages[len(system)]
    assert memory["role"] == "system" and memory["content"].startswith("[Memory")
    assert "memory_search" in memory["content"]  # the tools guide
    assert messages[len(messages) - len(new) :] == list(new)
    # Between the memory message and the new messages: a contiguous run of stored messages
    # that ends where the history ends (the recent turns, verbatim and in order).
    recent = messages[len(system) + 1 : len(messages) - len(new)]
    if recent:
        assert list(stored[len(stored) - len(recent) :]) == recent
        assert recent[0]["role"] != "tool"
    check_tool_pairs(messages)
    # Every retrieved message is tagged with its node id and speaker.
    for line in memory["content"].splitlines():
        if line.startswith("[#") and "level" not in line.split("]")[0]:
            assert re.match(
                r"\[#\d+ (user|assistant|tool|[A-Za-z_-]+)(, other conversation)?\] ", line
            ), line


# -- the budget property -----------------------------------------------------------------


def text_of(draw: st.DrawFn, low: int, high: int) -> str:
    count = draw(st.integers(low, high))
    return " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=count, max_size=count)))


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    messages: list[Message] = []
    for turn in range(draw(st.integers(1, 40))):
        messages.append({"role": "user", "content": text_of(draw, 1, 120)})
        if draw(st.booleans()):
            calls = [
                {
                    "id": f"call_{turn}_{n}",
                    "type": "function",
                    "function": {
                        "name": "lookup",
                        "arguments": json.dumps({"q": text_of(draw, 1, 5)}),
                    },
                }
                for n in range(draw(st.integers(1, 3)))
            ]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            messages.extend(
                {"role": "tool", "tool_call_id": call["id"], "content": text_of(draw, 1, 80)}
                for call in calls
            )
        messages.append({"role": "assistant", "content": text_of(draw, 1, 150)})
    return messages


@pytest.fixture(scope="module")
async def property_tenant(engine: AsyncEngine) -> int:
    return await new_tenant(engine)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    history=conversations(),
    budget=st.integers(150, 4000),
    reserved=st.integers(0, 200),
    with_system=st.booleans(),
    question=st.integers(1, 300),
)
async def test_the_prompt_never_exceeds_the_budget(
    engine: AsyncEngine,
    property_tenant: int,
    history: list[Message],
    budget: int,
    reserved: int,
    with_system: bool,
    question: int,
) -> None:
    system = [{"role": "system", "content": "You are helpful."}] if with_system else []
    new = [{"role": "user", "content": " ".join(WORDS[i % len(WORDS)] for i in range(question))}]
    conversation_id, _ = await store_conversation(engine, property_tenant, history + new)
    needed = tokens.count_messages([*system, *new], model=MODEL)
    if needed > budget - reserved:
        with pytest.raises(ContextOverflow):
            await build(
                engine,
                property_tenant,
                conversation_id,
                system=system,
                new=new,
                new_from=len(history),
                budget=budget,
                reserved=reserved,
            )
        return
    built = await build(
        engine,
        property_tenant,
        conversation_id,
        system=system,
        new=new,
        new_from=len(history),
        budget=budget,
        reserved=reserved,
    )
    assert built.tokens == tokens.count_messages(built.messages, model=MODEL)
    assert built.tokens + reserved <= budget
    check_layout(built, system=system, stored=history, new=new)


# -- layout on a real tree ---------------------------------------------------------------------

FACT = "The storage unit door code is 5821-KESTREL, remember that."


@pytest.fixture(scope="module")
async def built_tree(engine: AsyncEngine) -> tuple[int, int, list[Message], list[int]]:
    """A 600-message conversation with tool calls and a planted fact, its tree built."""
    tenant_id = await new_tenant(engine)
    messages = synthetic.messages(600, seed=5)
    messages[150] = {"role": "user", "content": FACT}
    # Keep the newest turns a tool exchange, so the recent turns must start cleanly.
    conversation_id, node_ids = await store_conversation(engine, tenant_id, messages)
    config = tree.TreeConfig(embedder=LocalEmbedder(), summarizer=ExtractiveSummarizer())
    await tree.build(
        engine, tenant_id=tenant_id, conversation_id=conversation_id, config=config, final=True
    )
    return tenant_id, conversation_id, messages, node_ids


async def test_layout_with_summaries_retrieval_and_recent_turns(
    engine: AsyncEngine, built_tree: tuple[int, int, list[Message], list[int]]
) -> None:
    tenant_id, conversation_id, messages, node_ids = built_tree
    system = [{"role": "system", "content": "Be precise."}]
    new = [{"role": "user", "content": "What was the storage unit door code again?"}]
    built = await build(
        engine,
        tenant_id,
        conversation_id,
        system=system,
        new=new,
        new_from=len(messages),
        budget=3000,
        embedder=LocalEmbedder(),
    )
    assert built.tokens <= 3000
    # The exact count corrects the estimates both ways: little of the budget is left unused.
    assert built.tokens >= 3000 - 60
    check_layout(built, system=system, stored=messages, new=new)
    memory = built.messages[1]["content"]
    # The planted message, verbatim, tagged with its id and speaker under its date and time.
    line = f"[#{node_ids[150]} user] {FACT}"
    assert line in memory
    heading = memory.split(line)[0].rstrip("\n").splitlines()
    sittings = [h for h in heading if re.fullmatch(r"\d{4}-\d\d-\d\d \w{3} \d\d:\d\d:", h)]
    assert sittings and sittings[-1].startswith("2025-03-01 Sat 11:30")  # message 150: 11:30
    # Summaries first (coarse for the oldest history), then milestones and messages.
    assert memory.index("Summaries, oldest first:") < memory.index("Earlier messages:")
    summary_tags = re.findall(r"\[#(\d+) level (\d+), messages (\d+)-(\d+)", memory)
    assert summary_tags
    starts = [int(start) for _, _, start, _ in summary_tags]
    assert min(starts) == 0, "the oldest history is covered"
    assert node_ids[150] in built.retrieved
    assert built.recent_from > 150


async def test_tool_results_keep_their_call(
    engine: AsyncEngine, built_tree: tuple[int, int, list[Message], list[int]]
) -> None:
    """New messages that are tool results bring the assistant message that called them."""
    tenant_id, _conversation_id, messages, _ = built_tree
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }
    conv, _ = await store_conversation(engine, tenant_id, [*messages[:300], call])
    new = [
        {"role": "tool", "tool_call_id": "call_a", "content": "result a"},
        {"role": "tool", "tool_call_id": "call_b", "content": "result b"},
    ]
    built = await build(engine, tenant_id, conv, system=[], new=new, new_from=301, budget=600)
    assert built.messages[-3:] == [call, *new]
    check_tool_pairs(built.messages)


async def test_tool_results_keep_the_question_of_their_exchange_while_it_fits(
    engine: AsyncEngine, built_tree: tuple[int, int, list[Message], list[int]]
) -> None:
    """Tool results that leave the recent turns no room still bring the question their
    exchange answers (its earlier rounds too); with no room even for it, only their call."""
    tenant_id, _conversation_id, messages, _ = built_tree

    def call(call_id: str) -> Message:
        function = {"name": "lookup", "arguments": "{}"}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }

    question = {"role": "user", "content": "Which invoice did the plumber send in March?"}
    earlier = [call("call_1"), {"role": "tool", "tool_call_id": "call_1", "content": "none yet"}]
    history = [*messages[:300], question, *earlier, call("call_2")]
    conv, _ = await store_conversation(engine, tenant_id, history)
    new = [{"role": "tool", "tool_call_id": "call_2", "content": "invoice line " * 150}]
    exchange = [question, *earlier, call("call_2"), *new]
    for budget in (700, tokens.count_messages(exchange, model=MODEL) + 5):
        built = await build(
            engine, tenant_id, conv, system=[], new=new, new_from=len(history), budget=budget
        )
        assert built.messages[-5:] == exchange
        assert built.tokens <= budget
        check_tool_pairs(built.messages)
    tight = tokens.count_messages([call("call_2"), *new], model=MODEL) + 10
    built = await build(
        engine, tenant_id, conv, system=[], new=new, new_from=len(history), budget=tight
    )
    assert built.messages == [call("call_2"), *new]


async def test_system_prompt_and_new_messages_over_the_budget(
    engine: AsyncEngine, built_tree: tuple[int, int, list[Message], list[int]]
) -> None:
    tenant_id, conversation_id, messages, _ = built_tree
    new = [{"role": "user", "content": "word " * 500}]
    with pytest.raises(ContextOverflow, match="budget"):
        await build(
            engine,
            tenant_id,
            conversation_id,
            system=[],
            new=new,
            new_from=len(messages),
            budget=300,
        )


# -- budgets and the fit ------------------------------------------------------------------------


def test_budget_is_capped_by_the_models_window() -> None:
    defaults = {"default_window": 32768, "default_reserve": 4096}
    assert prompt.budget_for("gpt-4o", requested=8000, **defaults) == 8000
    assert prompt.budget_for("gpt-4", requested=8000, **defaults) == 8192 - 2048
    assert prompt.budget_for("gpt-4-0613", requested=100_000, **defaults) == 8192 - 2048
    assert prompt.budget_for("gpt-4o-mini", requested=500_000, **defaults) == 128_000 - 16_384
    assert prompt.budget_for("openai/gpt-4.1", requested=10**7, **defaults) == 1_047_576 - 32_768
    assert prompt.budget_for("llama-3-8b", requested=50_000, **defaults) == 32768 - 4096
    assert prompt.budget_for("gpt-4", requested=8000, max_output=192, **defaults) == 8000
    assert prompt.budget_for("gpt-4", requested=8000, max_output=7000, **defaults) == 1192
    # An unknown model's window is a guess: a larger output than the default reserve asks for
    # cuts the budget no further (a smaller one still frees room).
    assert prompt.budget_for("llama-3-8b", requested=50_000, max_output=64_000, **defaults) == (
        32768 - 4096
    )
    assert prompt.budget_for("llama-3-8b", requested=50_000, max_output=96, **defaults) == (
        32768 - 96
    )


def state_for(engine: AsyncEngine, **overrides: Any) -> State:
    return State(
        settings=Settings(_env_file=None, **overrides),
        engine=engine,
        upstream=cast(Any, None),
        embedder=LocalEmbedder(),
        default_tenant_id=0,
    )


async def test_dry_run_of_a_conversation_that_fits_is_the_history(engine: AsyncEngine) -> None:
    tenant_id = await new_tenant(engine)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
    ]
    async with engine.begin() as conn:
        found = await identity.identify(
            conn, tenant_id=tenant_id, external_id="fits", user=None, messages=history
        )
        await store.store_new(conn, tenant_id=tenant_id, found=found, messages=history, model=MODEL)
    assembled = await chat.dry_run(
        state_for(engine), tenant_id=tenant_id, external_id="fits", query="and now?", budget=None
    )
    assert assembled.messages == [*history, {"role": "user", "content": "and now?"}]
    assert assembled.tokens == tokens.count_messages(assembled.messages, model=MODEL)
    assert assembled.labels == ["system", "history", "history", "history"]
    assert assembled.context_version is None
    assert assembled.why == []


async def dry_run_of_the_tree(
    engine: AsyncEngine, built_tree: tuple[int, int, list[Message], list[int]], **settings: Any
) -> Assembled:
    """The dry run of the built tree's conversation for the door code, in 1,500 tokens."""
    tenant_id, conversation_id, _messages, _node_ids = built_tree
    async with engine.connect() as conn:
        external_id = await conn.scalar(
            text("SELECT external_id FROM conversations WHERE id = :i"),
            {"i": conversation_id},
        )
    return await chat.dry_run(
        state_for(engine, **settings),
        tenant_id=tenant_id,
        external_id=str(external_id),
        query="what is the storage unit door code",
        budget=1500,
    )


async def test_dry_run_rebuilds_when_the_history_does_not_fit(
    engine: AsyncEngine, built_tree: tuple[int, int, list[Message], list[int]]
) -> None:
    node_ids = built_tree[3]
    assembled = await dry_run_of_the_tree(engine, built_tree)
    messages = assembled.messages
    assert assembled.tokens == tokens.count_messages(messages, model=MODEL) <= 1500
    assert messages[-1] == {"role": "user", "content": "what is the storage unit door code"}
    # The working context: stable memory, verbatim turns, the recall note, the question; the
    # planted fact, a milestone ("remember that"), is in stable memory, tagged.
    assert assembled.labels[0] == "stable" and assembled.labels[-2:] == ["note", "new"]
    # Each message counted: the parts add up to the prompt, less the priming.
    assert sum(assembled.counts) + tokens.REPLY_PRIMING_TOKENS == assembled.tokens
    # Why the note's messages are there: each explained message is one the note quotes, found
    # by a leg or lent a neighbour's score, best rank first.
    note = messages[assembled.labels.index("note")]["content"]
    assert assembled.why and all(f"[#{one.node_id} " in note for one in assembled.why)
    assert all(one.legs or one.lent for one in assembled.why)
    assert [one.rank for one in assembled.why] == sorted(one.rank for one in assembled.why)
    assert f"[#{node_ids[150]} user] {FACT}" in messages[0]["content"]


async def test_dry_run_rebuilt_per_query_says_why_the_memory_message_quotes_each(
    engine: AsyncEngine, built_tree: tuple[int, int, list[Message], list[int]]
) -> None:
    node_ids = built_tree[3]
    assembled = await dry_run_of_the_tree(engine, built_tree, context_mode="rebuild")
    messages = assembled.messages
    # Each message labelled and counted: the parts add up to the prompt, less the priming.
    assert assembled.labels[0] == "memory" and assembled.labels[-1] == "new"
    assert set(assembled.labels[1:-1]) == {"verbatim"}
    assert sum(assembled.counts) + tokens.REPLY_PRIMING_TOKENS == assembled.tokens
    # Why the planted fact is there: a pinned milestone ("remember that") that the legs found
    # too, ranked first; every message explained is one the memory message quotes.
    why = {one.node_id: one for one in assembled.why}
    fact = why[node_ids[150]]
    assert fact.pinned and fact.legs and not fact.lent and fact.rank == 1
    assert all(f"[#{node_id} " in messages[0]["content"] for node_id in why)
    assert [one.rank for one in assembled.why] == sorted(one.rank for one in assembled.why)


# -- end to end through the gateway ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as process:
        yield process


def test_a_long_conversation_costs_the_upstream_a_prompt_within_the_budget(
    gateway: GatewayProcess, upstream: UpstreamServer
) -> None:
    conversation = f"e2e-budget-{uuid.uuid4().hex}"
    history = synthetic.messages(2000, seed=9)
    history[400] = {"role": "user", "content": FACT}
    with httpx.Client(base_url=gateway.root_url, timeout=60) as http:
        imported = http.post(
            f"/admin/conversations/{conversation}/messages",
            json={"messages": history, "model": MODEL},
        )
        assert imported.status_code == 201, imported.text
        upstream.reset()
        question = {"role": "user", "content": "What is the storage unit door code?"}
        response = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [question]},
            headers={"X-Memstrata-Conversation": conversation, "X-Memstrata-Budget": "2500"},
        )
        assert response.status_code == 200, response.text
        [sent] = upstream.requests("/v1/chat/completions")
        prompt = sent["body"]["messages"]
        assert tokens.count_messages(prompt, model=MODEL) <= 2500
        assert int(response.headers["X-Memstrata-Context-Tokens"]) == tokens.count_messages(
            prompt, model=MODEL
        )
        assert int(response.headers["X-Memstrata-Full-Tokens"]) > 2500
        assert float(response.headers["X-Memstrata-Overhead-Ms"]) > 0
        assert prompt[-1] == question
        # Recalled in the note right before the question, found by full text: no worker has
        # embedded or summarized anything, so stable memory only names the range to browse.
        assert prompt[-2]["content"].startswith("[Recalled") and FACT in prompt[-2]["content"]
        assert "memory_browse (level 0, start 0" in prompt[0]["content"]

        # A small conversation goes as the client sent it, with the same headers.
        small = [{"role": "user", "content": f"hello {uuid.uuid4().hex}"}]
        upstream.reset()
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": small})
        [sent] = upstream.requests("/v1/chat/completions")
        assert sent["body"]["messages"] == small
        assert (
            response.headers["X-Memstrata-Context-Tokens"]
            == response.headers["X-Memstrata-Full-Tokens"]
        )

        refused = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": small},
            headers={"X-Memstrata-Budget": "lots"},
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "X-Memstrata-Budget"
