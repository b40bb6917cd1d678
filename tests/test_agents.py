"""End to end: openai-agents, on its default settings (the Responses API), runs a real Agent
with a function tool against a gateway process, which talks to the fake upstream process;
both ways upstream (forwarded as Responses, translated to chat completions).

The agent's run makes two requests: the question, answered by a call of the tool; then the
whole input again with the call and its result, answered in words. Each message must be stored
once, in one conversation, and the upstream must see each message once. Tracing is off: the SDK
sends nothing anywhere but the gateway.
"""

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from agents import Agent, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from memory.schema import nodes


@function_tool
def get_weather(city: str) -> str:
    """The weather of a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module", params=["forward", "translate"])
def way(
    request: pytest.FixtureRequest, database_url: str
) -> Iterator[tuple[str, UpstreamServer, GatewayProcess]]:
    serves = request.param == "forward"
    with (
        UpstreamServer(chunk_delay=0.002, responses=serves) as upstream,
        GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as gw,
    ):
        yield request.param, upstream, gw


async def stored(engine: AsyncEngine, first: str, count: int) -> list[dict[str, Any]]:
    """The messages of every conversation whose first message is `first` (waiting for
    `count` of them in all: a streamed reply is stored as its stream ends)."""
    starts = select(nodes.c.conversation_id).where(
        nodes.c.level == 0, nodes.c.seq == 0, nodes.c.content == func.to_jsonb(first)
    )
    query = (
        select(nodes.c.conversation_id, nodes.c.role, nodes.c.content, nodes.c.tool_calls)
        .where(nodes.c.level == 0, nodes.c.conversation_id.in_(starts.scalar_subquery()))
        .order_by(nodes.c.conversation_id, nodes.c.seq)
    )
    deadline = time.monotonic() + 5
    while True:
        async with engine.connect() as conn:
            rows = [dict(row) for row in (await conn.execute(query)).mappings()]
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agent_with_a_tool_runs_through_the_gateway(
    way: tuple[str, UpstreamServer, GatewayProcess], engine: AsyncEngine, streamed: bool
) -> None:
    name, upstream, gateway = way
    path = "/v1/responses" if name == "forward" else "/v1/chat/completions"
    upstream.reset()
    upstream.script(  # a fresh gateway's first request may ask /v1/responses whether it exists
        {"path": path, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"path": path, "reply": "It is sunny in Paris."},
    )
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="sk-agents", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    instructions = f"You answer about the weather. {uuid.uuid4().hex}"
    agent = Agent(name="weather", instructions=instructions, tools=[get_weather], model="gpt-4o")
    question = f"What is the weather in Paris? {uuid.uuid4().hex}"
    if streamed:
        run = Runner.run_streamed(agent, question, run_config=config)
        async for _ in run.stream_events():
            pass
        output = run.final_output
    else:
        output = (await Runner.run(agent, question, run_config=config)).final_output
    await client.close()

    assert output == "It is sunny in Paris."
    requests = upstream.requests(path)
    assert len(requests) == 2
    if name == "forward":
        assert [r["body"]["instructions"] for r in requests] == [instructions] * 2
        second = requests[1]["body"]["input"]
        assert [item.get("type", "message") for item in second] == [
            "message",
            "function_call",
            "function_call_output",
        ]
    else:
        second = requests[1]["body"]["messages"]
        assert [m["role"] for m in second] == ["system", "user", "assistant", "tool"]
        assert second[3]["content"] == "sunny in Paris"

    # One conversation, each message once.
    messages = await stored(engine, instructions, 5)
    assert len({m["conversation_id"] for m in messages}) == 1
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", instructions),
        ("user", question),
        ("assistant", None),
        ("tool", "sunny in Paris"),
        ("assistant", "It is sunny in Paris."),
    ]
    [call] = messages[2]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
