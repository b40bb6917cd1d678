"""The working context (`memory.recall.working_context`, `compaction`, `anticipation`,
`recall_note`, through `memory.recall.assemble`) against a real Postgres, turn by turn as the
gateway drives it (store the turn, assemble under the conversation's lock, record the reply):

* consecutive prompts share a byte-identical prefix until a compaction, the budget is kept and
  a tool call is never split from its results (a property test over random conversations);
* tool results whose call alone passes the budget are refused, not sent past it;
* compaction keeps the budget and loses nothing: every compacted message is under a summary
  the prompt tags, and the summary expands;
* masked tool results expand back to the original;
* a branch inside the context makes a new version of it (cut back to the branch point, or
  rebuilt when the turn that made it fit its budget);
* a prepared recall candidate is used, a stale one ignored;
* prepared candidates come back best first, each with its own similarity (its message's or
  its best passage's);
* a follow-up on the latest exchange gets no note;
* the dry run (what the recall benchmarks and the admin context endpoint measure) is the prompt
  the next turn sends, and saves nothing.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import synthetic
from gateway.openai import chat
from gateway.settings import Settings
from gateway.state import State
from memory import tokens
from memory.build import tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer
from memory.embeddings import LocalEmbedder
from memory.errors import ContextOverflow
from memory.recall import anticipation, browsing, explain, recall_note, tool_hints, tools
from memory.recall import working_context as wc
from memory.recall.assemble import Assembled, Budget, Recall, StoredTurn, assemble
from memory.recall.working_context import Policy
from memory.schema import nodes, passages, working_contexts
from memory.write import appends, store, tree_nodes

MODEL = "gpt-4o"
SYSTEM = {"role": "system", "content": "You are a careful assistant."}
WORDS = [
    *("alpha", "budget", "invoice", "flight", "Lisbon", "migration", "schema", "rollback"),
    *("ticket", "deploy", "garden", "tile", "plumber", "offer", "salary", "candidate"),
]
# A prompt forwarded as the client's history, or one from the working context.
LABELS = re.compile(r"(system )*((history )+|(stable )*((verbatim|note) )*(new )+)")

Message = dict[str, Any]

EMBEDDER = LocalEmbedder()


class Conversation:
    """One conversation driven turn by turn, as the gateway does."""

    def __init__(
        self, engine: AsyncEngine, tenant_id: int, conversation_id: int, external_id: str
    ) -> None:
        self.engine = engine
        self.tenant_id = tenant_id
        self.id = conversation_id
        self.external_id = external_id

    @classmethod
    async def start(
        cls, engine: AsyncEngine, tenant_id: int, history: Sequence[Message] = ()
    ) -> Conversation:
        async with engine.begin() as conn:
            ref, _ = await store.open_conversation(
                conn, tenant_id=tenant_id, external_id=f"wc-{uuid.uuid4().hex}"
            )
            await store.append(
                conn,
                tenant_id=tenant_id,
                conversation_id=ref.id,
                messages=[SYSTEM, *history],
                model=MODEL,
            )
        return cls(engine, tenant_id, ref.id, ref.external_id)

    async def turn(
        self,
        new: Sequence[Message],
        *,
        limit: int,
        recall: Recall,
        branched_at: int | None = None,
        explained: bool = False,
        tools_guide: bool = True,
    ) -> Assembled:
        """Store `new` and assemble its prompt in one transaction (the row lock held);
        `explained`: with why the note quotes each message; `tools_guide`: the memory tools
        are offered."""
        async with self.engine.begin() as conn:
            appended = await store.append(
                conn,
                tenant_id=self.tenant_id,
                conversation_id=self.id,
                messages=new,
                model=MODEL,
            )
            stored = StoredTurn(
                tenant_id=self.tenant_id,
                conversation_id=self.id,
                model=MODEL,
                system=[SYSTEM],
                new_messages=list(new),
                first_seq=appended.first_seq,
                whole=None,
                stored_tokens=appended.token_count,
                next_seq=appended.first_seq + len(appended.node_ids),
                branched_at=branched_at,
                previous_fingerprint=appended.prompt_fingerprint,
            )
            return await assemble(
                conn,
                stored,
                Budget(limit=limit, reserved=0),
                recall,
                tools_guide=tools_guide,
                explained=explained,
            )

    async def reply(self, message: Message, assembled: Assembled) -> None:
        async with self.engine.begin() as conn:
            await store.append(
                conn,
                tenant_id=self.tenant_id,
                conversation_id=self.id,
                messages=[message],
                model=MODEL,
                request=appends.RequestStats(
                    sent=assembled.tokens,
                    full=assembled.full_tokens,
                    reused=assembled.reused,
                    fingerprint=assembled.fingerprint,
                    prepare_context=assembled.context_version is not None,
                ),
            )

    async def state(self) -> wc.State:
        async with self.engine.begin() as conn:
            found = await wc.load(conn, tenant_id=self.tenant_id, conversation_id=self.id)
        assert found is not None
        return found

    async def build_tree(self, policy: SegmentPolicy | None = None) -> None:
        config = tree.TreeConfig(
            embedder=EMBEDDER,
            summarizer=ExtractiveSummarizer(),
            policy=policy or SegmentPolicy(),
        )
        await tree.build(
            self.engine, tenant_id=self.tenant_id, conversation_id=self.id, config=config
        )


def raw(messages: Sequence[Message]) -> list[str]:
    """The messages as the upstream receives them, byte for byte."""
    return [json.dumps(m, ensure_ascii=False, separators=(",", ":")) for m in messages]


def check_tool_pairs(messages: Sequence[Message]) -> None:
    """Every tool result follows its call's assistant message (only results between)."""
    open_calls: set[str] = set()
    for message in messages:
        if message["role"] == "tool":
            assert message["tool_call_id"] in open_calls, "a tool result without its call"
            open_calls.discard(message["tool_call_id"])
            continue
        assert not open_calls, f"calls without results: {open_calls}"
        if message["role"] == "assistant" and message.get("tool_calls"):
            open_calls = {call["id"] for call in message["tool_calls"]}


def check_prompt(assembled: Assembled, limit: int) -> None:
    assert assembled.tokens == tokens.count_messages(assembled.messages, model=MODEL)
    assert assembled.tokens <= limit
    assert LABELS.fullmatch("".join(f"{label} " for label in assembled.labels))
    check_tool_pairs(assembled.messages)


def stable_end(assembled: Assembled) -> int:
    """How many leading messages are the system prompt and the context (before any note of
    this turn and the new messages)."""
    labels = assembled.labels
    end = len(labels) - labels.count("new")
    if end and labels[end - 1] == "note":
        end -= 1
    return end


# -- the prefix property -----------------------------------------------------------------------


def words(draw: st.DrawFn, low: int, high: int) -> str:
    count = draw(st.integers(low, high))
    return " ".join(draw(st.lists(st.sampled_from(WORDS), min_size=count, max_size=count)))


@st.composite
def scripts(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """Turns: ("user", text: a question or not) answered by ("reply", text) or by ("calls",
    [(id, result)]), the client then sending the results as its next turn."""
    turns: list[tuple[str, Any]] = []
    for number in range(draw(st.integers(6, 24))):
        turns.append(("user", words(draw, 1, 60) + draw(st.sampled_from(["", "?"]))))
        if draw(st.integers(0, 3)) == 0:
            results = [
                (f"call_{number}_{n}", words(draw, 1, 150)) for n in range(draw(st.integers(1, 2)))
            ]
            turns.append(("calls", results))
        turns.append(("reply", words(draw, 1, 80)))
    return turns


@pytest.fixture(scope="module")
async def property_tenant(engine: AsyncEngine) -> int:
    async with engine.begin() as conn:
        return await store.tenant_id_by_name(conn)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    script=scripts(),
    history=st.integers(0, 60),
    limit=st.integers(500, 1600),
    keep_notes=st.booleans(),
    note=st.sampled_from([0.0, 0.1, 0.25]),
    marks=st.sampled_from([(0.3, 0.7), (0.45, 0.85), (0.6, 0.95)]),
)
async def test_consecutive_prompts_share_a_prefix_until_a_compaction(
    engine: AsyncEngine,
    property_tenant: int,
    script: list[tuple[str, Any]],
    history: int,
    limit: int,
    keep_notes: bool,
    note: float,
    marks: tuple[float, float],
) -> None:
    policy = Policy(low=marks[0], high=marks[1], note=note, keep_notes=keep_notes)
    recall = Recall(embedder=EMBEDDER, policy=policy)
    conversation = await Conversation.start(
        engine, property_tenant, synthetic.messages(history, seed=history)
    )
    previous: Assembled | None = None
    pending: list[Message] = []
    for kind, value in script:
        if kind == "user":
            pending = [{"role": "user", "content": value}]
            continue
        assembled = await conversation.turn(pending, limit=limit, recall=recall)
        check_prompt(assembled, limit)
        if previous is not None and previous.context_version is not None:
            same = assembled.context_version == previous.context_version
            assert same != assembled.compacted
            if same:
                # Everything before the previous turn's note (all of it, notes kept) is
                # repeated byte for byte.
                end = len(previous.messages) if keep_notes else stable_end(previous)
                assert raw(assembled.messages[:end]) == raw(previous.messages[:end])
                assert assembled.reused >= sum(previous.counts[:end])
        previous = assembled
        if kind == "calls":
            calls = [
                {"id": call, "type": "function", "function": {"name": "look", "arguments": "{}"}}
                for call, _ in value
            ]
            await conversation.reply(
                {"role": "assistant", "content": None, "tool_calls": calls}, assembled
            )
            pending = [
                {"role": "tool", "tool_call_id": call, "content": result} for call, result in value
            ]
        else:
            await conversation.reply({"role": "assistant", "content": value}, assembled)


async def test_results_past_the_budget_keep_their_call(engine: AsyncEngine, tenant_id: int) -> None:
    """The first turn past the budget whose new messages are tool results larger than the
    low-water mark: the context is built with no room left, and still keeps the call the
    results answer (found by the prefix property, at a 500-token budget)."""
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(10, seed=3))
    policy = Policy(low=0.3, high=0.7, note=0.0, keep_notes=False)
    recall = Recall(embedder=EMBEDDER, policy=policy)
    first = await conversation.turn(
        [{"role": "user", "content": "look it up"}], limit=500, recall=recall
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    await conversation.reply({"role": "assistant", "content": None, "tool_calls": [call]}, first)
    result = " ".join(["alpha salary offer candidate"] * 60)
    assembled = await conversation.turn(
        [{"role": "tool", "tool_call_id": "call_1", "content": result}], limit=500, recall=recall
    )
    assert assembled.context_version is not None
    check_tool_pairs(assembled.messages)
    assert [m["role"] for m in assembled.messages[-2:]] == ["assistant", "tool"]
    # The question the call serves stays verbatim too: compacted, the model got a tool result
    # and no word of what it was for.
    assert {"role": "user", "content": "look it up"} in assembled.messages


@pytest.mark.parametrize(
    ("question", "size", "kept"),
    [
        ("find the bug in parse_config", 60, True),  # with stable memory
        ("find the bug in parse_config", 114, True),  # without: no room for it
        (" ".join(["find the bug in parse_config"] * 12), 114, False),  # nor for the question
    ],
)
async def test_results_that_leave_no_room_for_memory_keep_their_question(
    engine: AsyncEngine, tenant_id: int, question: str, size: int, kept: bool
) -> None:
    """A tool result that takes nearly the whole budget (a file read whole): the turn goes
    without stable memory, and without the compacted turns, but with the question the call
    serves, while it still fits. Before, it went out as the system prompt, the call and its
    result, with nothing saying what the result was for. A question too long for what is left
    is compacted, as the turns before it are."""
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(10, seed=4))
    policy = Policy(low=0.3, high=0.7, note=0.0, keep_notes=False)
    recall = Recall(embedder=EMBEDDER, policy=policy)
    first = await conversation.turn(
        [{"role": "user", "content": question}], limit=500, recall=recall
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    await conversation.reply({"role": "assistant", "content": None, "tool_calls": [call]}, first)
    result = " ".join(["alpha salary offer candidate"] * size)
    assembled = await conversation.turn(
        [{"role": "tool", "tool_call_id": "call_1", "content": result}], limit=500, recall=recall
    )
    check_prompt(assembled, 500)
    assert [m["role"] for m in assembled.messages[-2:]] == ["assistant", "tool"]
    assert ({"role": "user", "content": question} in assembled.messages) is kept
    assert ("stable" in assembled.labels) is (size < 100)


async def test_a_new_question_lets_the_compaction_take_the_exchange_before_it(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """Only tool results hold their exchange back from a compaction. After a long answer, a new
    question compacts that answer too, and the context comes back under the low-water mark.
    Before, every turn kept the exchange before it whole: a long one held the context over the
    mark, to be compacted again on the next turn."""
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(10, seed=5))
    policy = Policy(low=0.3, high=0.7, note=0.0, keep_notes=False)
    recall = Recall(embedder=EMBEDDER, policy=policy)
    first = await conversation.turn(
        [{"role": "user", "content": "tell me all of it"}], limit=500, recall=recall
    )
    answer = {"role": "assistant", "content": " ".join(["alpha salary offer candidate"] * 50)}
    await conversation.reply(answer, first)
    assembled = await conversation.turn(
        [{"role": "user", "content": "and what comes next?"}], limit=500, recall=recall
    )
    check_prompt(assembled, 500)
    assert assembled.context_version is not None
    assert answer not in assembled.messages
    assert assembled.tokens <= policy.low * 500


async def test_a_call_too_large_for_the_budget_with_its_results_is_refused(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """Tool results whose call (an assistant message with large arguments) alone passes the
    budget: the call cannot be compacted away from its results, so the turn is refused
    (`ContextOverflow`: a 400) rather than sent past the budget."""
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(10, seed=3))
    policy = Policy(low=0.3, high=0.7, note=0.0, keep_notes=False)
    recall = Recall(embedder=EMBEDDER, policy=policy)
    first = await conversation.turn(
        [{"role": "user", "content": "write it down"}], limit=500, recall=recall
    )
    text = " ".join(["alpha salary offer candidate"] * 200)
    arguments = json.dumps({"text": text})
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "save", "arguments": arguments},
    }
    await conversation.reply({"role": "assistant", "content": None, "tool_calls": [call]}, first)
    with pytest.raises(ContextOverflow):
        await conversation.turn(
            [{"role": "tool", "tool_call_id": "call_1", "content": "saved"}],
            limit=500,
            recall=recall,
        )


# -- compaction on a real tree -----------------------------------------------------------------

FACT = "The storage unit door code is 5821-KESTREL."


async def test_compaction_keeps_the_budget_and_loses_nothing(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """Turn after turn on a summarized conversation (the tree built after each reply, as the
    background worker would): every compaction keeps the prompt within its budget and every
    message before the compaction point is under a summary the prompt tags, which expands."""
    limit = 2500
    segments = SegmentPolicy(token_cap=400, min_tokens=64)
    history = synthetic.messages(400, seed=21)
    conversation = await Conversation.start(engine, tenant_id, history)
    await conversation.build_tree(segments)
    # Marks close together: a compaction every few turns.
    recall = Recall(embedder=EMBEDDER, policy=Policy(low=0.45, high=0.6))
    compactions = 0
    asks = [m for m in synthetic.messages(200, seed=22) if m["role"] == "user"][:40]
    for number, message in enumerate(asks):
        assembled = await conversation.turn([message], limit=limit, recall=recall)
        check_prompt(assembled, limit)
        compactions += assembled.compacted
        await conversation.reply({"role": "assistant", "content": f"noted {number}"}, assembled)
        await conversation.build_tree(segments)
        state = await conversation.state()
        stable = "\n".join(part.text for part in state.stable)
        assert "not summarized here" not in stable
        tagged = {int(node) for node in re.findall(r"\[#(\d+) level \d+", stable)}
        async with engine.begin() as conn:
            nodes = [
                await tree_nodes.get_node(conn, tenant_id=tenant_id, node_id=node)
                for node in tagged
            ]
        covered: set[int] = set()
        for node in nodes:
            covered.update(range(node.span_start, node.span_end + 1))
        # Every message before the compaction point (the system prompt aside) is under one.
        assert set(range(1, state.verbatim_from)) <= covered
    assert compactions >= 2
    # A summary of the prompt expands to what it summarizes.
    scope = browsing.Scope(tenant_id=tenant_id, conversation_id=conversation.id)
    async with engine.begin() as conn:
        opened = await browsing.expand(conn, scope, node_id=nodes[-1].id)
    assert f"summarizes {len(nodes[-1].children)} nodes" in opened


async def test_a_cache_control_breakpoint_marks_the_last_stable_message(
    engine: AsyncEngine, tenant_id: int
) -> None:
    limit = 1500
    recall = Recall(embedder=EMBEDDER, policy=Policy(cache_control=True))
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(200, seed=4))
    prompts = []
    for number in range(2):
        ask = {"role": "user", "content": f"and the budget {number}?"}
        assembled = await conversation.turn([ask], limit=limit, recall=recall)
        check_prompt(assembled, limit)
        await conversation.reply({"role": "assistant", "content": "noted"}, assembled)
        prompts.append(assembled)
    first, second = prompts
    last = max(i for i, label in enumerate(first.labels) if label == "stable")
    [part] = first.messages[last]["content"]
    assert part["cache_control"] == {"type": "ephemeral"} and part["type"] == "text"
    assert part["text"].startswith("[Memory of this conversation")
    assert raw(second.messages[: last + 1]) == raw(first.messages[: last + 1])


# -- masking -----------------------------------------------------------------------------------


async def test_masked_tool_results_expand_back_to_the_original(
    engine: AsyncEngine, tenant_id: int
) -> None:
    limit = 2400
    # A low-water mark that masking alone reaches: the old results are most of the context.
    recall = Recall(embedder=EMBEDDER, policy=Policy(note=0.0, low=0.6))
    conversation = await Conversation.start(engine, tenant_id)
    results: dict[str, str] = {}
    masked_only = False
    previous: wc.State | None = None

    async def turn(new: list[Message]) -> Assembled:
        nonlocal masked_only, previous
        assembled = await conversation.turn(new, limit=limit, recall=recall)
        check_prompt(assembled, limit)
        state = await conversation.state() if assembled.context_version else None
        if assembled.compacted and previous is not None and state is not None:
            # Masking comes first: here it was enough, the compaction point stayed.
            masked_only |= (
                state.verbatim_from == previous.verbatim_from
                and state.mask_before > previous.mask_before
            )
        previous = state
        return assembled

    for number in range(24):
        ask = {"role": "user", "content": f"look up record {number} please"}
        assembled = await turn([ask])
        call = f"call_{number}"
        await conversation.reply(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call,
                        "type": "function",
                        "function": {"name": "lookup", "arguments": json.dumps({"n": number})},
                    }
                ],
            },
            assembled,
        )
        results[call] = f"record {number}: " + " ".join(
            WORDS[(number + i) % len(WORDS)] for i in range(220)
        )
        assembled = await turn([{"role": "tool", "tool_call_id": call, "content": results[call]}])
        await conversation.reply({"role": "assistant", "content": f"done {number}"}, assembled)
    assert masked_only
    placeholders = [
        (found, message["tool_call_id"])
        for message in assembled.messages
        if message["role"] == "tool"
        and (
            found := re.fullmatch(
                r"\[#(\d+) tool result, [\d,]+ tokens, masked: memory_expand to read\]",
                message["content"],
            )
        )
    ]
    assert placeholders
    # The newest results (the fresh tail) stay whole.
    assert assembled.messages[-1]["content"] == results["call_23"]
    # A turn not offered the memory tools gets the same prompt without their hints.
    bare, costs = tool_hints.without(
        assembled.messages, assembled.labels, assembled.counts, model=MODEL
    )
    assert "memory_" in json.dumps(assembled.messages) and "memory_" not in json.dumps(bare)
    assert costs == tokens.count_each(bare, model=MODEL) and sum(costs) < sum(assembled.counts)
    assert [m["role"] for m in bare] == [m["role"] for m in assembled.messages]
    assert all(
        re.fullmatch(r"\[#\d+ tool result, [\d,]+ tokens, masked\]", bare[i]["content"])
        for i, m in enumerate(assembled.messages)
        if m["role"] == "tool" and m["content"].endswith("memory_expand to read]")
    )
    found, call = placeholders[0]
    scope = await _scope(engine, tenant_id, conversation.id)
    async with engine.begin() as conn:
        opened = await tools.run_tool(
            conn,
            scope,
            name="memory_expand",
            arguments=json.dumps({"node_id": int(found.group(1))}),
            embedder=EMBEDDER,
        )
    assert results[call] in opened


async def _scope(engine: AsyncEngine, tenant_id: int, conversation_id: int) -> tools.Scope:
    async with engine.begin() as conn:
        return await tools.scope_for(
            conn, tenant_id=tenant_id, conversation_id=conversation_id, cross_conversation=False
        )


# -- branches ----------------------------------------------------------------------------------


async def test_a_branch_inside_the_context_makes_a_new_version(
    engine: AsyncEngine, tenant_id: int
) -> None:
    limit = 1500
    recall = Recall(embedder=EMBEDDER, policy=Policy())
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(200, seed=3))
    for number in range(3):
        ask = {"role": "user", "content": f"what about the invoice {number}?"}
        assembled = await conversation.turn([ask], limit=limit, recall=recall)
        await conversation.reply({"role": "assistant", "content": "checking"}, assembled)
    state = await conversation.state()
    # A branch after the context's end: the prefix stays.
    ask = {"role": "user", "content": "and the flight?"}
    kept = await conversation.turn([ask], limit=limit, recall=recall, branched_at=state.upto)
    assert kept.context_version == state.version and not kept.compacted
    await conversation.reply({"role": "assistant", "content": "checking"}, kept)
    # A branch inside it (an edit of a message the context holds): cut back, a new version.
    edit = {"role": "user", "content": "actually, the hotel?"}
    rebuilt = await conversation.turn(
        [edit], limit=limit, recall=recall, branched_at=state.verbatim_from + 1
    )
    check_prompt(rebuilt, limit)
    assert rebuilt.context_version == state.version + 1
    assert (await conversation.state()).notes == ()
    assert rebuilt.messages[-1] == edit


async def test_a_branch_a_forwarded_turn_made_rebuilds_the_context(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """An edit inside the context on a turn that fits its budget (here: the client asks for a
    larger one) is forwarded as sent, without the context; the next turn past the budget
    rebuilds it rather than send stable memory of the branch the edit abandoned (summaries it
    deleted)."""
    limit = 1500
    recall = Recall(embedder=EMBEDDER, policy=Policy())
    history = [SYSTEM, *synthetic.messages(200, seed=7)]
    conversation = await Conversation.start(engine, tenant_id, history[1:])
    async with engine.begin() as conn:  # replies the gateway recorded: the client saw them
        await conn.execute(
            update(nodes)
            .where(nodes.c.conversation_id == conversation.id, nodes.c.role == "assistant")
            .values(model=MODEL)
        )
    await conversation.build_tree()

    async def send(messages: list[Message], budget: int) -> Assembled:
        async with engine.begin() as conn:
            stored, _ = await chat.store_turn(
                conn,
                tenant_id=tenant_id,
                external_id=conversation.external_id,
                user=None,
                messages=messages,
                model=MODEL,
                budget=Budget(limit=budget, reserved=0),
            )
            return await assemble(
                conn, stored, Budget(limit=budget, reserved=0), recall, tools_guide=False
            )

    history.append({"role": "user", "content": "what about the invoice?"})
    first = await send(history, limit)
    await conversation.reply({"role": "assistant", "content": "checking"}, first)
    built = await conversation.state()
    fork = next(
        seq for seq in range(built.verbatim_from // 2, 0, -1) if history[seq]["role"] == "user"
    )
    edited = [*history[:fork], {"role": "user", "content": "actually, the hotel?"}]
    forwarded = await send(edited, 10**6)
    assert not forwarded.rebuilt and forwarded.messages == edited
    await conversation.reply({"role": "assistant", "content": "the hotel"}, forwarded)
    edited += [
        {"role": "assistant", "content": "the hotel"},
        {"role": "user", "content": "and the flight?"},
    ]
    after = await send(edited, limit)
    check_prompt(after, limit)
    tags = {int(tag) for m in after.messages for tag in re.findall(r"\[#(\d+)", str(m["content"]))}
    async with engine.begin() as conn:
        found = set(
            await conn.scalars(
                select(nodes.c.id).where(nodes.c.id.in_(tags), nodes.c.superseded_at.is_(None))
            )
        )
    assert tags and tags <= found, f"tags of messages gone from the branch: {tags - found}"
    assert f"its first {built.verbatim_from:,} messages" not in json.dumps(after.messages)


def gateway_state(engine: AsyncEngine, tenant_id: int) -> State:
    """The gateway's state under default settings (no memory tools, no upstream)."""
    return State(
        settings=Settings(_env_file=None, memory_tools="never"),
        engine=engine,
        upstream=cast(Any, None),
        embedder=EMBEDDER,
        default_tenant_id=tenant_id,
    )


FACT_QUESTION = "What is the code for the storage unit door?"


async def asked_for_fact(
    engine: AsyncEngine, tenant_id: int, *, limit: int
) -> tuple[State, Conversation, Assembled]:
    """The gateway's state, a summarized conversation of 301 messages holding `FACT`, and the
    gateway's dry run of `FACT_QUESTION` on it within `limit`."""
    state = gateway_state(engine, tenant_id)
    history = synthetic.messages(300, seed=31)
    history[60] = {"role": "user", "content": FACT}
    conversation = await Conversation.start(engine, tenant_id, history)
    await conversation.build_tree()
    dry = await chat.dry_run(
        state,
        tenant_id=tenant_id,
        external_id=conversation.external_id,
        query=FACT_QUESTION,
        budget=limit,
    )
    return state, conversation, dry


async def test_the_dry_run_is_the_prompt_the_next_turn_sends(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """A conversation imported at once has no working context yet: the gateway's dry run builds
    it as the first turn past the budget does (the newest turns verbatim, stable memory over the
    rest), adds the question's note and saves nothing; that turn then sends the same prompt,
    byte for byte."""
    limit = 2000
    state, conversation, dry = await asked_for_fact(engine, tenant_id, limit=limit)
    check_prompt(dry, limit)
    assert {"stable", "verbatim"} <= set(dry.labels) and dry.labels[-2:] == ["note", "new"]
    assert FACT in dry.messages[-2]["content"]
    async with engine.begin() as conn:
        assert await wc.load(conn, tenant_id=tenant_id, conversation_id=conversation.id) is None
    ask = {"role": "user", "content": FACT_QUESTION}
    sent = await conversation.turn([ask], limit=limit, recall=chat.recall_of(state))
    assert raw(sent.messages) == raw(dry.messages) and sent.labels == dry.labels
    assert (await conversation.state()).upto == 300 + 2  # the history, system prompt, the ask


async def test_a_turn_that_keeps_the_prefix_leaves_the_rest_as_stored(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """A turn without compaction writes its counts, how far the context reaches and its notes
    (`working_context.advance`); the stable memory and the compaction prepared for the version
    stay as stored, and the next turn finds them."""
    limit = 1500
    recall = Recall(embedder=EMBEDDER, policy=Policy(keep_notes=True))
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(200, seed=5))
    first = await conversation.turn([{"role": "user", "content": "ok"}], limit=limit, recall=recall)
    await conversation.reply({"role": "assistant", "content": "fine"}, first)
    built = await conversation.state()
    prepared = {"version": built.version, "stable": [], "verbatim_from": 1, "mask_before": 1}
    async with engine.begin() as conn:
        await conn.execute(
            update(working_contexts)
            .where(working_contexts.c.conversation_id == conversation.id)
            .values(prepared=prepared)
        )
    ask = {"role": "user", "content": "what did we say about the invoice?"}
    kept = await conversation.turn([ask], limit=limit, recall=recall)
    assert kept.context_version == built.version and not kept.compacted
    state = await conversation.state()
    assert state.prepared == prepared
    assert (state.stable, state.verbatim_from, state.version) == (
        built.stable,
        built.verbatim_from,
        built.version,
    )
    assert state.upto > built.upto
    noted = "note" in kept.labels
    assert len(state.notes) == len(built.notes) + noted
    assert state.tokens == sum(kept.counts[1 : stable_end(kept) + noted])


async def test_verbatim_turns_read_again_are_the_stored_ones(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """`read_items` keeps what it read of a conversation and reads only the rest next time:
    the turns come out as a fresh read gives them, a node found under a known id but stored
    at another time (a recreated database) is read again, not taken for the known one, and a
    known node that left the current branch is left out."""
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(40, seed=11))
    span: dict[str, Any] = {
        "tenant_id": tenant_id,
        "conversation_id": conversation.id,
        "model": MODEL,
    }

    async def read(start: int, end: int, *, fresh: bool = False) -> list[wc.Item]:
        if fresh:
            wc._read.clear()
        async with engine.begin() as conn:
            return await wc.read_items(conn, start=start, end=end, **span)

    first = await read(5, 30)
    assert [item.seq for item in first] == list(range(5, 30))
    wider = await read(10, 41)
    assert wider == await read(10, 41, fresh=True)
    assert wider[:20] == first[5:]

    async with engine.begin() as conn:
        await conn.execute(
            update(nodes)
            .where(nodes.c.conversation_id == conversation.id, nodes.c.seq == 20)
            .values(content="stored again", created_at=nodes.c.created_at + timedelta(seconds=1))
        )
    again = await read(10, 41)
    assert again[10].message["content"] == "stored again"
    assert again == await read(10, 41, fresh=True)

    # A known turn that left the current branch is no longer read.
    async with engine.begin() as conn:
        await conn.execute(
            update(nodes)
            .where(nodes.c.conversation_id == conversation.id, nodes.c.seq == 25)
            .values(superseded_at=func.now())
        )
    moved = await read(10, 41)
    assert [item.seq for item in moved] == [seq for seq in range(10, 41) if seq != 25]
    assert moved == await read(10, 41, fresh=True)


async def test_a_system_message_within_the_history_stays_in_the_verbatim_turns(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """A system (or developer) message a client sent within its history (not its opening system
    prompt, which the request's own replaces) is a verbatim turn like any other: the prompt
    holds it on every turn, as it does while the conversation fits its budget. It was left out
    of the working context, so a conversation past its budget lost it from the next turn on."""
    limit = 1500
    recall = Recall(embedder=EMBEDDER, policy=Policy())
    conversation = await Conversation.start(engine, tenant_id, synthetic.messages(200, seed=6))
    note = {"role": "developer", "content": f"From now on answer in French ({uuid.uuid4().hex})."}
    ask = {"role": "user", "content": "Bonjour, what is next?"}
    first = await conversation.turn([note, ask], limit=limit, recall=recall)
    await conversation.reply({"role": "assistant", "content": "Ensuite, le budget."}, first)
    assert first.messages.count(note) == 1
    later = await conversation.turn(
        [{"role": "user", "content": "Et puis?"}], limit=limit, recall=recall
    )
    assert later.messages.count(note) == 1
    assert later.messages.index(note) > later.messages.index(SYSTEM)
    assert later.messages.count(SYSTEM) == 1


def test_what_is_kept_of_read_turns_stays_within_its_tokens() -> None:
    """The turns kept for the next read stay within their token bound: the conversations read
    least recently go first, and one read again replaces what was kept of it."""
    stamp = datetime.now(UTC)

    def turns(conversation: int, count: int, size: int) -> wc.Read:
        return {
            node: (stamp, wc.Item(node, node, "user", None, {"role": "user"}, size))
            for node in range(conversation * 100, conversation * 100 + count)
        }

    recent = wc._Recent(tokens=1000)
    recent.put((1, "o200k_base"), turns(1, 4, 100))
    recent.put((2, "o200k_base"), turns(2, 4, 100))
    recent.put((1, "o200k_base"), turns(1, 5, 100))  # read again: 500, not 900
    assert len(recent.get((1, "o200k_base"))) == 5 and recent.get((2, "o200k_base"))
    recent.put((3, "o200k_base"), turns(3, 3, 100))  # 1,200: the least recent (2) goes
    assert recent.get((2, "o200k_base")) == {}
    assert recent.get((1, "o200k_base")) and recent.get((3, "o200k_base"))
    recent.put((4, "o200k_base"), turns(4, 20, 100))  # alone past the bound: kept, alone
    assert [recent.get((n, "o200k_base")) != {} for n in (1, 3, 4)] == [False, False, True]


# -- anticipatory recall -----------------------------------------------------------------------


async def test_a_prepared_candidate_is_used_and_a_stale_one_ignored(
    engine: AsyncEngine, tenant_id: int
) -> None:
    limit = 2000
    recall = Recall(embedder=EMBEDDER, policy=Policy(note=0.2))
    history = synthetic.messages(300, seed=8)
    history[40] = {"role": "user", "content": FACT}
    conversation = await Conversation.start(engine, tenant_id, history)
    await conversation.build_tree()
    ask = {"role": "user", "content": "I am moving boxes into the storage unit today."}
    assembled = await conversation.turn([ask], limit=limit, recall=recall)
    await conversation.reply(
        {"role": "assistant", "content": "Good luck with the move."}, assembled
    )
    await conversation.build_tree()
    prepared = await anticipation.prepare(
        engine,
        EMBEDDER,
        tenant_id=tenant_id,
        conversation_id=conversation.id,
        cross_conversation=False,
    )
    assert prepared
    state = await conversation.state()
    assert state.recall_after == state.upto and state.recall_ids
    async with engine.begin() as conn:
        fact = (
            await store.list_messages(
                conn, tenant_id=tenant_id, conversation_id=conversation.id, after_seq=40, limit=1
            )
        )[0]
    assert fact.node_id in state.recall_ids  # the exchange was about the storage unit
    # Only the fact is left among the candidates: a note built from them holds it and the
    # messages next to it (which it lends its relevance: an answer sits next to its question).
    async with engine.begin() as conn:
        await conn.execute(
            update(working_contexts)
            .where(working_contexts.c.conversation_id == conversation.id)
            .values(recall_ids=[fact.node_id])
        )
    follow = {"role": "user", "content": "What is the code for the storage unit door?"}
    used = await conversation.turn([follow], limit=limit, recall=recall, explained=True)
    assert used.prepared_recall and used.labels[-2:] == ["note", "new"]
    # Why: the fact was the prepared leg's only candidate; its neighbours were lent its score.
    why = {one.node_id: one for one in used.why}
    assert [(leg.leg, leg.rank) for leg in why[fact.node_id].legs][:1] == [("prepared", 1)]
    assert {leg.leg for one in used.why for leg in one.legs} <= {"prepared", "full text"}
    note = used.messages[-2]["content"]
    assert f"[#{fact.node_id} user] {FACT}" in note
    quoted = [int(node) for node in re.findall(r"^\[#(\d+) ", note, re.MULTILINE)]
    assert fact.node_id in quoted  # imported at once: ids follow the seqs
    assert all(abs(node - fact.node_id) <= 2 for node in quoted)
    await conversation.reply({"role": "assistant", "content": "It is 5821-KESTREL."}, used)
    # Stale: prepared before the last exchange (another turn since), so retrieval runs.
    async with engine.begin() as conn:
        await conn.execute(
            update(working_contexts)
            .where(working_contexts.c.conversation_id == conversation.id)
            .values(recall_after=state.recall_after, recall_ids=[fact.node_id])
        )
    again = {"role": "user", "content": "Which unit was it, the storage unit by the door?"}
    fresh = await conversation.turn([again], limit=limit, recall=recall, explained=True)
    assert not fresh.prepared_recall
    assert fresh.why and {leg.leg for one in fresh.why for leg in one.legs} <= set(explain.LEGS)


async def test_prepared_candidates_come_back_best_first_each_with_its_own_similarity(
    engine: AsyncEngine, tenant_id: int
) -> None:
    """The prepared leg ranks its candidates by the better of each message's similarity to the
    new message and its best passage's, every column of a candidate from its own row; beside
    them it scores the latest exchange's messages the same way, and gives the best of those."""
    history = synthetic.messages(60, seed=12)
    for seq in range(0, 60, 4):  # messages of several sentences: they get passages
        history[seq] = {
            "role": "user",
            "content": f"The {WORDS[seq % 16]} plan changed again. We moved the {WORDS[seq % 7]} "
            f"review to Thursday because the {WORDS[(seq + 3) % 16]} team was away all week.",
        }
    conversation = await Conversation.start(engine, tenant_id, history)
    await conversation.build_tree()
    [vector] = await EMBEDDER.embed(["When is the migration review for the garden team?"])
    query = np.asarray(vector)
    async with engine.begin() as conn:
        rows = (
            await conn.execute(
                select(nodes.c.id, nodes.c.seq, nodes.c.embedding).where(
                    nodes.c.conversation_id == conversation.id, nodes.c.level == 0
                )
            )
        ).all()
        best_passage = dict(
            (
                await conn.execute(
                    select(
                        passages.c.node_id,
                        func.max(1 - passages.c.embedding.cosine_distance(vector)),
                    ).group_by(passages.c.node_id)
                )
            ).all()
        )
        ids = [row.id for row in rows if row.seq % 3 != 1 and row.embedding is not None]
        latest = [row.id for row in rows if row.seq % 3 == 1]
        leg, exchange = await recall_note._prepared_leg(
            conn, tenant_id=tenant_id, ids=ids, vector=vector, abandoned=False, latest=latest
        )
        _, alone = await recall_note._prepared_leg(
            conn, tenant_id=tenant_id, ids=[], vector=vector, abandoned=False, latest=latest[:1]
        )
    assert best_passage  # some candidates were scored by a passage
    scores = {
        row.id: max(float(np.dot(query, np.asarray(row.embedding))), best_passage.get(row.id, 0))
        for row in rows
        if row.embedding is not None
    }
    expected = {row.seq: scores[row.id] for row in rows if row.id in ids}
    assert exchange == pytest.approx(max(scores[id_] for id_ in latest if id_ in scores), abs=1e-5)
    assert alone == pytest.approx(scores[latest[0]], abs=1e-5)
    assert exchange != pytest.approx(max(expected.values()), abs=1e-5)
    ranked = [(place.key[2], place.similarity or 0.0) for place in leg.ranked]
    assert sorted(seq for seq, _ in ranked) == sorted(expected)
    assert all(similarity == pytest.approx(expected[seq], abs=1e-5) for seq, similarity in ranked)
    similarities = [similarity for _, similarity in ranked]
    assert similarities == sorted(similarities, reverse=True)


async def test_a_follow_up_on_the_latest_exchange_gets_no_note(
    engine: AsyncEngine, tenant_id: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A message closer to the latest exchange than to anything outside the context gets no
    note, though an older message bears on it, and the log says why; one that asks about the
    past, after the same kind of exchange, gets its note."""
    caplog.set_level(logging.DEBUG, logger=recall_note.__name__)
    limit = 2000
    recall = Recall(embedder=EMBEDDER, policy=Policy(note=0.3))
    history = synthetic.messages(300, seed=9)
    history[40] = {"role": "user", "content": FACT}
    bread = "We baked bread together last spring and the crust came out too hard."
    history[80] = {"role": "user", "content": bread}
    conversation = await Conversation.start(engine, tenant_id, history)
    await conversation.build_tree()

    async def exchange(ask: str, answer: str) -> Assembled:
        assembled = await conversation.turn(
            [{"role": "user", "content": ask}], limit=limit, recall=recall, explained=True
        )
        await conversation.reply({"role": "assistant", "content": answer}, assembled)
        await conversation.build_tree()  # embeds the exchange, as the worker does
        return assembled

    await exchange(
        "My sourdough starter doubles in six hours now. When should I feed it?",
        "Feed the sourdough starter right after it peaks, about every six hours.",
    )
    follow = await exchange(
        "How long should the sourdough proof before I bake it?",
        "Let the sourdough proof until it has grown by half, three to five hours.",
    )
    check_prompt(follow, limit)
    assert "note" not in follow.labels
    assert any(r.getMessage().startswith("no recall note") for r in caplog.records)
    # The older message bears on it all the same: a note could have quoted it.
    asked_vector, bread_vector = await EMBEDDER.embed([follow.messages[-1]["content"], bread])
    assert float(np.dot(asked_vector, bread_vector)) >= recall_note.RELEVANCE
    asked = await exchange(FACT_QUESTION, "It is 5821-KESTREL.")
    assert asked.labels[-2:] == ["note", "new"] and FACT in asked.messages[-2]["content"]


def test_usable_needs_the_exchange_just_before_and_a_close_message() -> None:
    vector = [1.0, 0.0, 0.0]
    state = wc.State(
        tenant_id=1,
        conversation_id=1,
        model=MODEL,
        budget=1000,
        verbatim_from=0,
        mask_before=0,
        upto=10,
        recall_after=9,
        recall_vector=vector,
        recall_ids=(5,),
    )
    assert anticipation.usable(state, first_seq=10, vector=[0.9, 0.1, 0.0])
    assert not anticipation.usable(state, first_seq=11, vector=vector)  # stale
    assert not anticipation.usable(state, first_seq=10, vector=[0.0, 1.0, 0.0])  # elsewhere
    assert not anticipation.usable(replace(state, recall_ids=()), first_seq=10, vector=vector)
    assert not anticipation.usable(state, first_seq=10, vector=None)
