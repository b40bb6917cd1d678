"""End to end: openai-agents, on its default settings (the Responses API), runs a real Agent
with a function tool against a gateway process, which talks to the fake upstream process;
both ways upstream (forwarded as Responses, translated to chat completions).

The agent's run makes two requests: the question, answered by a call of the tool; then the
whole input again with the call and its result, answered in words. Each message must be stored
once, in one conversation, and the upstream must see each message once. Runs that name their
conversation (`conversation_id`) share its memory, as do runs with a session or chained by
`previous_response_id`. When the gateway offers its memory tools, the model may read memory
inside a run: the agent sees only its own calls. Tracing is off: the SDK sends nothing
anywhere but the gateway.
"""

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from agents import Agent, RunConfig, Runner, SQLiteSession, function_tool
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


Way = tuple[str, UpstreamServer, GatewayProcess]


@contextlib.contextmanager
def serving(name: str, database_url: str, **settings: Any) -> Iterator[Way]:
    """A way upstream (`forward`: an upstream that serves the Responses API; `translate`: one
    that does not) and a gateway with `settings` in front of it."""
    serves = name == "forward"
    with (
        UpstreamServer(chunk_delay=0.002, responses=serves) as upstream,
        GatewayProcess(
            database_url=database_url, upstream_url=upstream.url, workers=0, **settings
        ) as gw,
    ):
        yield name, upstream, gw


@pytest.fixture(scope="module", params=["forward", "translate"])
def way(request: pytest.FixtureRequest, database_url: str) -> Iterator[Way]:
    with serving(request.param, database_url) as chosen:
        yield chosen


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


async def stored_once(engine: AsyncEngine, instructions: str, question: str) -> None:
    """The weather run is one conversation, each of its messages stored once: no memory call
    nor its result among them."""
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


async def weather_run(gateway: GatewayProcess, *, streamed: bool) -> tuple[Any, str, str]:
    """A run of a weather agent with its tool through the gateway: its result (a streamed
    run's once it is over), its instructions and its question, both made unique."""
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="sk-agents", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    instructions = f"You answer about the weather. {uuid.uuid4().hex}"
    agent = Agent(name="weather", instructions=instructions, tools=[get_weather], model="gpt-4o")
    question = f"What is the weather in Paris? {uuid.uuid4().hex}"
    result: Any
    if streamed:
        result = Runner.run_streamed(agent, question, run_config=config)
        async for _ in result.stream_events():
            pass
    else:
        result = await Runner.run(agent, question, run_config=config)
    await client.close()
    return result, instructions, question


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_agent_with_a_tool_runs_through_the_gateway(
    way: Way, engine: AsyncEngine, streamed: bool
) -> None:
    name, upstream, gateway = way
    path = "/v1/responses" if name == "forward" else "/v1/chat/completions"
    upstream.reset()
    upstream.script(  # a fresh gateway's first request may ask /v1/responses whether it exists
        {"path": path, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"path": path, "reply": "It is sunny in Paris."},
    )
    result, instructions, question = await weather_run(gateway, streamed=streamed)

    assert result.final_output == "It is sunny in Paris."
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

    await stored_once(engine, instructions, question)


async def test_runs_in_a_named_conversation_share_its_memory(way: Way, engine: AsyncEngine) -> None:
    """`Runner.run(..., conversation_id=...)` sends each run's new input only, naming the
    conversation (`conversation`): the runs land in one conversation, and the second run's
    prompt holds the first's exchange, from the gateway's memory."""
    name, upstream, gateway = way
    path = "/v1/responses" if name == "forward" else "/v1/chat/completions"
    upstream.reset()
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="sk-agents", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    agent = Agent(name="notes", instructions="You keep notes.", model="gpt-4o")
    conversation = f"conv_{uuid.uuid4().hex}"
    first = f"Remember the code {uuid.uuid4().hex}."
    second = f"What was the code? {uuid.uuid4().hex}"
    for question in (first, second):
        await Runner.run(agent, question, run_config=config, conversation_id=conversation)
    await client.close()

    requests = upstream.requests(path)
    assert all("conversation" not in r["body"] for r in requests)
    last = requests[-1]["body"]["input" if name == "forward" else "messages"]
    said = [m["content"] for m in last if isinstance(m, dict) and m.get("role") == "user"]
    assert said == [first, second]
    messages = await stored(engine, "You keep notes.", 5)
    mine = [m for m in messages if m["content"] in (first, second)]
    assert len({m["conversation_id"] for m in mine}) == 1 and len(mine) == 2


@pytest.mark.parametrize("memory", ["session", "previous_response_id"])
async def test_a_session_or_chained_responses_keep_one_conversation(
    way: Way, engine: AsyncEngine, memory: str
) -> None:
    """The agent's own memory across runs: a `SQLiteSession` resends every earlier item (the
    call and the output messages with their ids) before the new input; `previous_response_id`
    sends only the new input. Three runs, the first with a tool round, are one conversation
    with each message once."""
    name, upstream, gateway = way
    path = "/v1/responses" if name == "forward" else "/v1/chat/completions"
    upstream.reset()
    upstream.script(
        {"path": path, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    )
    client = openai.AsyncOpenAI(base_url=gateway.url, api_key="sk-agents", max_retries=0)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    instructions = f"You know the weather. {uuid.uuid4().hex}"
    agent = Agent(name="weather", instructions=instructions, tools=[get_weather], model="gpt-4o")
    session = SQLiteSession(uuid.uuid4().hex)
    questions = ["The weather in Oslo?", "And tomorrow?", "Thanks."]
    previous = None
    for question in questions:
        if memory == "session":
            run = await Runner.run(agent, question, run_config=config, session=session)
        else:
            run = await Runner.run(
                agent, question, run_config=config, previous_response_id=previous
            )
        previous = run.last_response_id
    await client.close()

    messages = await stored(engine, instructions, 9)
    assert len({m["conversation_id"] for m in messages}) == 1
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", instructions),
        ("user", questions[0]),
        ("assistant", None),
        ("tool", "sunny in Oslo"),
        ("assistant", f"echo: {questions[0]}"),
        ("user", questions[1]),
        ("assistant", f"echo: {questions[1]}"),
        ("user", questions[2]),
        ("assistant", f"echo: {questions[2]}"),
    ]


@pytest.fixture(scope="module", params=["forward", "translate"])
def reading(request: pytest.FixtureRequest, database_url: str) -> Iterator[Way]:
    """A way upstream whose gateway always offers the memory tools."""
    known = "on" if request.param == "forward" else "off"  # no first request spent learning
    with serving(
        request.param, database_url, memory_tools="always", upstream_responses=known
    ) as chosen:
        yield chosen


@pytest.mark.parametrize("streamed", [False, True])
async def test_the_model_reads_memory_inside_an_agents_run(
    reading: Way, engine: AsyncEngine, streamed: bool
) -> None:
    """The model calls a memory tool, then the agent's tool, then answers: the agent sees its
    own call and the answer, never the memory call, and each message is stored once."""
    name, upstream, gateway = reading
    path = "/v1/responses" if name == "forward" else "/v1/chat/completions"
    upstream.reset()
    upstream.script(
        {"tool_calls": [{"name": "memory_search", "arguments": {"query": "Paris"}}]},
        {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
        {"reply": "It is sunny in Paris."},
    )
    result, instructions, question = await weather_run(gateway, streamed=streamed)

    assert result.final_output == "It is sunny in Paris."
    called = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert [getattr(call, "name", None) for call in called] == ["get_weather"]
    assert len(upstream.requests(path)) == 3  # the memory round, the agent's call, the answer
    await stored_once(engine, instructions, question)
