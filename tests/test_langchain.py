"""langchain-openai as an end-to-end client: `ChatOpenAI` → the gateway process → the fake
upstream process, with a client tool, over chat completions and over the Responses API.

langchain keeps a tool call's arguments parsed and serializes them again when it sends the
history back (`{"x":1}` from the upstream returns as `{"x": 1}`): the conversation must still
be recognised without a conversation id, each message stored once, and every prompt must reach
the upstream with each message once, in a valid order. Over the Responses API with the memory
tools offered, langchain is shown its own calls only.
"""

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from memory.schema import DEFAULT_TENANT, conversations, nodes, tenants

CHAT = "/v1/chat/completions"

pytestmark = pytest.mark.usefixtures("fresh_upstream")


@tool
def add_one(x: int) -> int:
    """Add one to x."""
    return x + 1


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as process:
        yield process


async def conversations_opening_with(engine: AsyncEngine, system: str) -> dict[str, list[Any]]:
    first = (
        select(conversations.c.id)
        .join(nodes, nodes.c.conversation_id == conversations.c.id)
        .join(tenants, tenants.c.id == conversations.c.tenant_id)
        .where(
            tenants.c.name == DEFAULT_TENANT,
            nodes.c.level == 0,
            nodes.c.seq == 0,
            nodes.c.content == func.to_jsonb(system),
        )
    )
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(conversations.c.external_id, nodes.c.role, nodes.c.superseded_at)
            .join(conversations, conversations.c.id == nodes.c.conversation_id)
            .where(nodes.c.conversation_id.in_(first), nodes.c.level == 0)
            .order_by(nodes.c.conversation_id, nodes.c.seq)
        )
        found: dict[str, list[Any]] = {}
        for external_id, role, superseded_at in rows:
            found.setdefault(external_id, []).append((role, superseded_at))
    return found


async def test_a_tool_round_trip_is_stored_once_and_sent_once(
    gateway: GatewayProcess, upstream: UpstreamServer, engine: AsyncEngine
) -> None:
    system = f"You add numbers. [{uuid.uuid4().hex}]"
    llm = ChatOpenAI(model="m", base_url=gateway.url, api_key="sk-langchain", max_retries=0)
    with_tools = llm.bind_tools([add_one])
    upstream.script({"tool_calls": [{"name": "add_one", "arguments": '{"x":1}'}]})
    history: list[BaseMessage] = [SystemMessage(system), HumanMessage("What is 1 + 1?")]
    called = await with_tools.ainvoke(history)
    assert [call["args"] for call in called.tool_calls] == [{"x": 1}]
    history.append(called)
    for call in called.tool_calls:
        history.append(ToolMessage(str(add_one.invoke(call["args"])), tool_call_id=call["id"]))
    answer = await with_tools.ainvoke(history)
    history.append(answer)
    history.append(HumanMessage("And once more, streamed?"))
    streamed = "".join([str(chunk.content) async for chunk in with_tools.astream(history)])
    assert streamed.startswith("echo: ")

    prompts = [request["body"]["messages"] for request in upstream.requests(CHAT)]
    assert [len(prompt) for prompt in prompts] == [2, 4, 6]
    # langchain re-serialized the arguments, and the upstream got its own history back once.
    assert prompts[1][2]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    roles = ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert [m["role"] for m in prompts[2]] == roles[:-1]
    found = await conversations_opening_with(engine, system)
    assert len(found) == 1, found
    [messages] = found.values()
    assert [role for role, _ in messages] == roles
    assert all(superseded_at is None for _, superseded_at in messages)


@pytest.mark.parametrize(
    ("output_version", "streaming", "previous_response_id"),
    [("v0", False, False), ("v1", True, False), ("v0", True, True), ("v1", False, True)],
)
async def test_the_responses_api_keeps_one_conversation_with_each_message_once(
    gateway: GatewayProcess,
    engine: AsyncEngine,
    upstream: UpstreamServer,
    output_version: str,
    streaming: bool,
    previous_response_id: bool,
) -> None:
    """`ChatOpenAI(use_responses_api=True)`, the way langchain-openai talks to reasoning
    models: it resends the history as input items (the call with its item id, its arguments
    re-serialized under `v0`), or with `use_previous_response_id` only what follows the last
    response. Either way the tool round and the next question are one conversation, each
    message stored once."""
    system = f"You add numbers. [{uuid.uuid4().hex}]"
    llm = ChatOpenAI(
        model="gpt-4o-mini",
        base_url=gateway.url,
        api_key="sk-langchain",
        max_retries=0,
        use_responses_api=True,
        output_version=output_version,
        streaming=streaming,
        use_previous_response_id=previous_response_id,
    )
    with_tools = llm.bind_tools([add_one])
    upstream.script({"tool_calls": [{"name": "add_one", "arguments": '{"x":1}'}]})
    history: list[BaseMessage] = [SystemMessage(system), HumanMessage("What is 1 + 1?")]
    called = await with_tools.ainvoke(history)
    history.append(called)
    for call in called.tool_calls:
        history.append(ToolMessage(str(add_one.invoke(call["args"])), tool_call_id=call["id"]))
    history.append(await with_tools.ainvoke(history))
    history.append(HumanMessage("And 2 + 2?"))
    last = await with_tools.ainvoke(history)
    assert last.text == "echo: And 2 + 2?"
    found = await conversations_opening_with(engine, system)
    assert len(found) == 1, found
    [messages] = found.values()
    roles = ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert [role for role, _ in messages] == roles
    assert all(superseded_at is None for _, superseded_at in messages)


@pytest.fixture(scope="module")
def reading_gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    """A gateway that always offers the memory tools, forwarding responses as Responses."""
    with GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=0,
        memory_tools="always",
        upstream_responses="on",
    ) as process:
        yield process


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
async def test_the_responses_api_over_memory_rounds_shows_langchain_its_own_call_only(
    reading_gateway: GatewayProcess,
    engine: AsyncEngine,
    upstream: UpstreamServer,
    streaming: bool,
) -> None:
    """The model reads memory, then calls langchain's tool, then answers: langchain is shown
    its own call alone, and the conversation holds each message once, no memory call."""
    system = f"You add numbers. [{uuid.uuid4().hex}]"
    llm = ChatOpenAI(
        model="gpt-4o-mini",
        base_url=reading_gateway.url,
        api_key="sk-langchain",
        max_retries=0,
        use_responses_api=True,
        streaming=streaming,
    )
    with_tools = llm.bind_tools([add_one])
    upstream.script(
        {"tool_calls": [{"name": "memory_search", "arguments": {"query": "numbers"}}]},
        {"tool_calls": [{"name": "add_one", "arguments": '{"x":1}'}]},
    )
    history: list[BaseMessage] = [SystemMessage(system), HumanMessage("What is 1 + 1?")]
    called = await with_tools.ainvoke(history)
    assert [call["name"] for call in called.tool_calls] == ["add_one"]
    history.append(called)
    for call in called.tool_calls:
        history.append(ToolMessage(str(add_one.invoke(call["args"])), tool_call_id=call["id"]))
    answer = await with_tools.ainvoke(history)
    assert answer.text == "echo: What is 1 + 1?"
    found = await conversations_opening_with(engine, system)
    assert len(found) == 1, found
    [messages] = found.values()
    assert [role for role, _ in messages] == ["system", "user", "assistant", "tool", "assistant"]
