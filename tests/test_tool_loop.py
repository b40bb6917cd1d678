"""End to end: the memory-tool loop, through the real `openai` SDK (and raw HTTP where the shape
of the stream itself is checked) → a `memstrata serve` process → the fake upstream process.

The gateway runs with `MEMSTRATA_MEMORY_TOOLS=always` (the tools are offered even when the
conversation fits the budget) and two tool rounds at most. The fake upstream is scripted to
call memory tools (it only answers tool calls when the request offers tools), and its recorded
requests show what the gateway sent each round: the tools offered, the memory calls and their
results appended. What the client received and what Postgres stored are checked beside them:
the client sees only the final answer, and the stored conversation is exactly what it saw.
"""

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionToolParam
from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.openai.streams import EventReader, MergedStream, add_usage
from memory import tokens
from memory.recall import tools
from memory.schema import tenants
from memory.write import identity, store

CHAT = "/v1/chat/completions"
HEADER = "X-Memstrata-Conversation"
MEMORY_TOOLS = ["memory_expand", "memory_search", "memory_browse", "memory_find"]
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
WEATHER_CALL = {
    "id": "call_weather_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

Message = dict[str, Any]


pytestmark = pytest.mark.usefixtures("fresh_upstream")


def unique(text: str) -> str:
    return f"{text} [{uuid.uuid4().hex[:12]}]"


def new_conversation() -> str:
    return f"loop-{uuid.uuid4().hex}"


def memory_call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "name": name, "arguments": arguments}


def tool_names(body: dict[str, Any]) -> list[str]:
    return [tool["function"]["name"] for tool in body.get("tools", [])]


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=0,
        upstream_timeout=5,
        memory_tools="always",
        max_tool_rounds=2,
        regex_timeout=0.3,
    ) as process:
        yield process


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url, api_key="sk-loop", max_retries=0, timeout=20) as sdk:
        yield sdk


@pytest.fixture
async def aclient(gateway: GatewayProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=gateway.url, api_key="sk-loop", max_retries=0, timeout=20
    ) as sdk:
        yield sdk


@pytest.fixture
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.root_url, timeout=20) as raw:
        yield raw


def stored(http: httpx.Client, conversation: str, count: int) -> list[Message]:
    """The stored messages once there are `count` (a stream's reply is stored as it ends)."""
    deadline = time.monotonic() + 5
    while True:
        response = http.get(f"/admin/conversations/{conversation}/messages")
        assert response.status_code == 200, response.text
        messages: list[Message] = response.json()["messages"]
        if len(messages) >= count or time.monotonic() > deadline:
            return messages
        time.sleep(0.02)


def history(code: str) -> list[Any]:
    return [
        {"role": "user", "content": f"Remember: my locker code is {code}."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": unique("What is my locker code?")},
    ]


def fake_usage(body: dict[str, Any], completion_tokens: int) -> dict[str, int]:
    """The usage the fake upstream reports for `body` (word counts, see its docstring)."""
    prompt = sum(len(str(m.get("content") or "").split()) + 3 for m in body["messages"])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def sse_chunks(response: httpx.Response) -> tuple[list[dict[str, Any]], list[str]]:
    """The JSON chunks of a raw stream, and every data payload in order."""
    payloads = [
        line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")
    ]
    return [json.loads(p) for p in payloads if p != "[DONE]"], payloads


# -- memory rounds -------------------------------------------------------------------------


def test_memory_round_non_stream(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    code = uuid.uuid4().hex[:8]
    messages = history(code)
    conversation = new_conversation()
    arguments = {"pattern": "locker code is"}
    upstream.script(
        {"tool_calls": [memory_call("memory_find", arguments, "call_m1")]},
        {"reply": f"Your locker code is {code}."},
    )
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", messages=messages, extra_headers={HEADER: conversation}
    )
    completion = raw.parse()
    choice = completion.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (
        f"Your locker code is {code}.",
        None,
    )
    assert choice.finish_reason == "stop"
    assert raw.headers[HEADER] == conversation

    first, second = upstream.requests(CHAT)
    assert tool_names(first["body"]) == MEMORY_TOOLS
    assert first["body"]["messages"] == messages
    kept = stored(http, conversation, 4)
    sent = second["body"]["messages"]
    assert sent[:3] == messages
    assert sent[3] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_m1",
                "type": "function",
                "function": {"name": "memory_find", "arguments": json.dumps(arguments)},
            }
        ],
    }
    assert sent[4]["role"] == "tool" and sent[4]["tool_call_id"] == "call_m1"
    assert sent[4]["content"].startswith("1 messages match 'locker code is':")
    assert f"[#{kept[0]['node_id']}] message 0" in sent[4]["content"]
    assert f"locker code is {code}" in sent[4]["content"]
    assert len(sent) == 5
    assert tool_names(second["body"]) == MEMORY_TOOLS  # the second round may still call them
    # Usage: both rounds'.
    rounds = [
        fake_usage(first["body"], len(json.dumps(arguments).split()) + 1),
        fake_usage(second["body"], 5),
    ]
    assert completion.usage is not None
    usage = completion.usage.model_dump(exclude_none=True)
    details = usage.pop("prompt_tokens_details")
    assert usage == {key: rounds[0][key] + rounds[1][key] for key in rounds[0]}
    # The second round repeats the first one's prompt, which the fake upstream caches.
    assert details["cached_tokens"] >= rounds[0]["prompt_tokens"]
    # The conversation's statistics hold the same sums, cached tokens included.
    assert stored_usage(http, conversation) == {
        "upstream_prompt_tokens": usage["prompt_tokens"],
        "upstream_completion_tokens": usage["completion_tokens"],
        "tokens_cached": details["cached_tokens"],
    }
    # Stored: what the client saw, no memory call or result.
    assert [(m["role"], m["content"], m["tool_calls"]) for m in kept] == [
        *[(m["role"], m["content"], None) for m in messages],
        ("assistant", f"Your locker code is {code}.", None),
    ]


def test_memory_round_stream_is_one_coherent_stream(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    code = uuid.uuid4().hex[:8]
    messages = history(code)
    conversation = new_conversation()
    upstream.script(
        {
            "reply": "Let me look.",
            "tool_calls": [memory_call("memory_search", {"query": "locker code"}, "call_s1")],
        },
        {"reply": f"It is {code}."},
    )
    response = http.post(
        CHAT,
        json={
            "model": "gpt-4o-mini",
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        headers={HEADER: conversation},
    )
    assert response.status_code == 200
    assert response.headers[HEADER] == conversation
    chunks, payloads = sse_chunks(response)
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    assert len({chunk["id"] for chunk in chunks}) == 1
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d.get("role") for d in deltas if "role" in d] == ["assistant"]
    assert not any("tool_calls" in d for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == f"Let me look.It is {code}."
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["stop"]
    [usage_chunk] = [c for c in chunks if c.get("usage")]
    assert usage_chunk is chunks[-1] and usage_chunk["choices"] == []
    first, second = upstream.requests(CHAT)
    assert second["body"]["messages"][3]["content"] == "Let me look."
    assert second["body"]["messages"][4]["tool_call_id"] == "call_s1"
    assert "locker code" in second["body"]["messages"][4]["content"]
    args = len(json.dumps({"query": "locker code"}).split()) + 1
    assert usage_chunk["usage"]["total_tokens"] == (
        fake_usage(first["body"], 3 + args)["total_tokens"]
        + fake_usage(second["body"], 3)["total_tokens"]
    )

    kept = stored(http, conversation, 4)
    assert (kept[3]["role"], kept[3]["content"], kept[3]["status"]) == (
        "assistant",
        content,
        "complete",
    )
    usage = usage_chunk["usage"]
    assert stored_usage(http, conversation) == {
        "upstream_prompt_tokens": usage["prompt_tokens"],
        "upstream_completion_tokens": usage["completion_tokens"],
        "tokens_cached": usage["prompt_tokens_details"]["cached_tokens"],
    }


def test_a_stream_that_did_not_ask_for_usage_is_not_shown_it_but_it_is_stored(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    messages = history(uuid.uuid4().hex[:8])
    conversation = new_conversation()
    upstream.script(
        {"tool_calls": [memory_call("memory_search", {"query": "locker code"}, "call_u1")]},
        {"reply": "Found it."},
    )
    response = http.post(
        CHAT,
        json={"model": "gpt-4o-mini", "messages": messages, "stream": True},
        headers={HEADER: conversation},
    )
    assert response.status_code == 200
    chunks, payloads = sse_chunks(response)
    assert payloads[-1] == "[DONE]"
    assert all(chunk["choices"] for chunk in chunks)  # no usage-only chunk
    first, second = upstream.requests(CHAT)
    assert first["body"]["stream_options"] == {"include_usage": True}  # asked on its behalf
    usage = [fake_usage(first["body"], 0), fake_usage(second["body"], 0)]
    kept = stored_usage(http, conversation, wait_for=True)
    assert kept["upstream_prompt_tokens"] == usage[0]["prompt_tokens"] + usage[1]["prompt_tokens"]
    assert kept["tokens_cached"] >= usage[0]["prompt_tokens"]  # the second round repeats it


def stored_usage(
    http: httpx.Client, conversation: str, *, wait_for: bool = False
) -> dict[str, int]:
    """What the conversation's statistics hold of the upstream's usage (a stream's once its
    reply is recorded)."""
    deadline = time.monotonic() + 5
    while True:
        stats = http.get(f"/admin/conversations/{conversation}").json()
        if stats["requests"] or not wait_for or time.monotonic() > deadline:
            return {
                key: stats[key]
                for key in ("upstream_prompt_tokens", "upstream_completion_tokens", "tokens_cached")
            }
        time.sleep(0.02)


def test_stream_through_the_sdk(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    messages = history(uuid.uuid4().hex[:8])
    upstream.script(
        {"tool_calls": [memory_call("memory_browse", {"level": 0}, "call_b1")]},
        {"reply": "All good."},
    )
    stream = client.chat.completions.create(model="m", messages=messages, stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == "All good."
    second = upstream.requests(CHAT)[1]["body"]
    assert second["messages"][4]["content"].startswith("messages 0-2:")


# -- memory and client tools ---------------------------------------------------------------


def test_mixed_calls_reach_the_client_without_the_memory_calls(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    conversation = new_conversation()
    messages: list[Any] = [{"role": "user", "content": unique("Weather in Paris?")}]
    upstream.script(
        {
            "tool_calls": [
                memory_call("memory_search", {"query": "Paris"}, "call_m1"),
                {"id": "call_weather_1", "name": "get_weather", "arguments": {"city": "Paris"}},
            ]
        }
    )
    completion = client.chat.completions.create(
        model="m",
        messages=messages,
        tools=TOOLS,
        extra_headers={HEADER: conversation},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    assert [c.model_dump() for c in choice.message.tool_calls] == [WEATHER_CALL]
    [sent] = upstream.requests(CHAT)  # the memory call was not run: no second round
    assert tool_names(sent["body"]) == ["get_weather", *MEMORY_TOOLS]
    assert stored(http, conversation, 2)[1]["tool_calls"] == [WEATHER_CALL]

    # The client answers its call: its history is valid, and goes on as usual.
    follow_up: list[Any] = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "call_weather_1", "content": "21 C, sunny"},
    ]
    upstream.script({"reply": "Sunny, 21 C."})
    answer = client.chat.completions.create(
        model="m",
        messages=follow_up,
        tools=TOOLS,
        extra_headers={HEADER: conversation},
    )
    assert answer.choices[0].message.content == "Sunny, 21 C."
    assert upstream.requests(CHAT)[1]["body"]["messages"][1]["tool_calls"] == [WEATHER_CALL]
    assert [m["role"] for m in stored(http, conversation, 4)] == [
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


def test_mixed_calls_stream(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    conversation = new_conversation()
    upstream.script(
        {
            "tool_calls": [
                memory_call("memory_expand", {"node_id": 1}, "call_m1"),
                {"id": "call_weather_1", "name": "get_weather", "arguments": {"city": "Paris"}},
                memory_call("memory_find", {"pattern": "x"}, "call_m2"),
            ]
        }
    )
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": unique("Weather?")}],
        tools=TOOLS,
        stream=True,
        extra_headers={HEADER: conversation},
    )
    calls: dict[int, dict[str, str]] = {}
    finish = []
    for chunk in stream:
        choice = chunk.choices[0]
        finish.append(choice.finish_reason)
        for fragment in choice.delta.tool_calls or []:
            call = calls.setdefault(fragment.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += fragment.id or ""
            assert fragment.function is not None
            call["name"] += fragment.function.name or ""
            call["arguments"] += fragment.function.arguments or ""
    assert calls == {
        0: {"id": "call_weather_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    }
    assert [f for f in finish if f] == ["tool_calls"]
    assert len(upstream.requests(CHAT)) == 1
    assert stored(http, conversation, 2)[1]["tool_calls"] == [WEATHER_CALL]


@pytest.mark.parametrize("stream", [False, True])
def test_memory_round_then_client_call(
    client: openai.OpenAI, upstream: UpstreamServer, stream: bool
) -> None:
    weather = {"id": "call_weather_1", "name": "get_weather", "arguments": {"city": "Paris"}}
    upstream.script(
        {"tool_calls": [memory_call("memory_browse", {"level": 0}, "call_m1")]},
        {"tool_calls": [weather]},
    )
    messages: list[Any] = [{"role": "user", "content": unique("Weather again?")}]
    if stream:
        chunks = list(
            client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
        )
        fragments = [f for c in chunks for f in c.choices[0].delta.tool_calls or []]
        assert [(f.index, f.id) for f in fragments if f.id] == [(0, "call_weather_1")]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        completion = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        calls = completion.choices[0].message.tool_calls
        assert calls is not None and [c.model_dump() for c in calls] == [WEATHER_CALL]
    _first, second = upstream.requests(CHAT)
    assert tool_names(second["body"]) == ["get_weather", *MEMORY_TOOLS]
    assert second["body"]["messages"][-1]["tool_call_id"] == "call_m1"


# -- the round limit -----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_round_limit_then_an_answer_without_memory_tools(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer, stream: bool
) -> None:
    # The model would call memory tools forever: it does whenever they are offered.
    upstream.set_default({"tool_calls": [memory_call("memory_browse", {"level": 0}, "call_x")]})
    conversation = new_conversation()
    question = unique("Tell me everything")
    messages: list[Any] = [{"role": "user", "content": question}]
    if stream:
        content = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model="m", messages=messages, stream=True, extra_headers={HEADER: conversation}
            )
            if c.choices
        )
    else:
        completion = client.chat.completions.create(
            model="m", messages=messages, extra_headers={HEADER: conversation}
        )
        content = completion.choices[0].message.content or ""
        assert completion.choices[0].finish_reason == "stop"
    assert content == f"echo: {question}"  # the fake's answer once no tools are offered
    requests = upstream.requests(CHAT)
    assert len(requests) == 3  # two rounds, then the last call
    assert [tool_names(r["body"]) for r in requests] == [MEMORY_TOOLS, MEMORY_TOOLS, []]
    assert "tools" not in requests[2]["body"]  # the client sent none
    assert [m["role"] for m in requests[2]["body"]["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
    ]
    assert [m["content"] for m in stored(http, conversation, 2)] == [question, content]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_tool_results_stay_within_the_models_window(
    database_url: str, upstream: UpstreamServer, stream: bool
) -> None:
    """A model with a small window (2,048 tokens, 256 kept for its answer) reads a long memory:
    the result is cut to the room the window has left, with a note, and the next request goes
    without the memory tools, so that it answers. Before, every round appended its results
    whole (16,000 characters a call): the second request was past the window, and the upstream
    refused it."""
    window, reserve = 2048, 256
    code = unique("locker")
    with (
        GatewayProcess(
            database_url=database_url,
            upstream_url=upstream.url,
            workers=0,
            memory_tools="always",
            max_tool_rounds=3,
            context_window=window,
            output_reserve=reserve,
            context_budget=1000,  # room for what memory the model reads
        ) as small,
        openai.OpenAI(base_url=small.url, api_key="sk-loop", max_retries=0, timeout=20) as sdk,
    ):
        messages: list[Any] = []
        for n in range(20):  # a history past the window, sent turn by turn
            messages.append({"role": "user", "content": f"{n}: {code} " + "word " * 60})
            answer = sdk.chat.completions.create(model="m", messages=messages)
            messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        upstream.reset()
        upstream.set_default({"tool_calls": [memory_call("memory_browse", {"level": 0}, "call_b")]})
        question = unique("What is my locker code?")
        messages.append({"role": "user", "content": question})
        if stream:
            chunks = sdk.chat.completions.create(model="m", messages=messages, stream=True)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            answer = sdk.chat.completions.create(model="m", messages=messages)
            content = answer.choices[0].message.content or ""
    assert content == f"echo: {question}"
    requests = upstream.requests(CHAT)
    assert [tool_names(r["body"]) for r in requests] == [MEMORY_TOOLS, []]
    for sent in requests:
        prompt = tokens.count_messages(sent["body"]["messages"], model="m")
        assert prompt + tools.tool_tokens("m") <= window - reserve
    result = requests[1]["body"]["messages"][-1]
    assert result["role"] == "tool"
    # Cut with a note: the tool's own (what it left out), or the gateway's, at a token.
    assert re.search(r"\[(\d+ more lines not shown|cut at \d+ of)", result["content"])


def test_round_limit_with_client_tools_strips_late_memory_calls(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    # With the client's tools still offered, the model calls a memory tool it was not offered.
    upstream.set_default({"tool_calls": [memory_call("memory_browse", {"level": 0}, "call_x")]})
    completion = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": unique("loop")}], tools=TOOLS
    )
    choice = completion.choices[0]
    assert (choice.message.tool_calls, choice.finish_reason) == (None, "stop")
    requests = upstream.requests(CHAT)
    assert [tool_names(r["body"]) for r in requests] == [
        ["get_weather", *MEMORY_TOOLS],
        ["get_weather", *MEMORY_TOOLS],
        ["get_weather"],
    ]


# -- limits and isolation through the loop ---------------------------------------------------


def test_catastrophic_pattern_is_an_error_for_the_model(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    upstream.script(
        {"tool_calls": [memory_call("memory_find", {"pattern": "(a|aa)+$"}, "call_re")]},
        {"reply": "That pattern was too slow."},
    )
    started = time.monotonic()
    completion = client.chat.completions.create(
        model="m",
        messages=[
            {"role": "user", "content": "a" * 20_000 + "!"},
            {"role": "user", "content": unique("find it")},
        ],
    )
    assert time.monotonic() - started < 5
    assert completion.choices[0].message.content == "That pattern was too slow."
    result = upstream.requests(CHAT)[1]["body"]["messages"][-1]
    assert result["tool_call_id"] == "call_re"
    assert result["content"].startswith("error: the pattern '(a|aa)+$' ran out of time")


async def test_another_tenants_memory_is_out_of_reach(
    engine: AsyncEngine, aclient: openai.AsyncOpenAI, upstream: UpstreamServer
) -> None:
    secret = f"zebra{uuid.uuid4().hex[:10]}"
    async with engine.begin() as conn:
        other = await conn.scalar(
            insert(tenants).values(name=f"test-{uuid.uuid4().hex}").returning(tenants.c.id)
        )
        assert other is not None
        history = [{"role": "user", "content": f"The vault word is {secret}."}]
        found = await identity.identify(
            conn, tenant_id=int(other), external_id=new_conversation(), user=None, messages=history
        )
        theirs = await store.store_new(
            conn, tenant_id=int(other), found=found, messages=history, model="m"
        )
    [their_node] = theirs.node_ids
    missing = 2**62
    upstream.script(
        {
            "tool_calls": [
                memory_call("memory_expand", {"node_id": their_node}, "call_1"),
                memory_call("memory_expand", {"node_id": missing}, "call_2"),
                memory_call("memory_search", {"query": secret}, "call_3"),
                memory_call("memory_find", {"pattern": secret}, "call_4"),
            ]
        },
        {"reply": "Nothing."},
    )
    await aclient.chat.completions.create(
        model="m", messages=[{"role": "user", "content": unique("What is the vault word?")}]
    )
    results = upstream.requests(CHAT)[1]["body"]["messages"][-4:]
    assert [r["content"] for r in results] == [
        f"error: node {their_node} does not exist",
        f"error: node {missing} does not exist",
        f"nothing found for {secret!r}",
        f"0 messages match {secret!r}.",
    ]


# -- what is not offered, and failures -------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "none", "tools": TOOLS},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "tools": TOOLS},
        {"n": 2},
        {"tools": [{"type": "function", "function": {"name": "memory_find", "parameters": {}}}]},
    ],
)
def test_tools_not_offered(
    http: httpx.Client, upstream: UpstreamServer, extra: dict[str, Any]
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": unique("hi")}], **extra}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    [sent] = upstream.requests(CHAT)
    assert sent["body"] == body


@pytest.mark.parametrize(("budget", "offered"), [("400", False), ("700", True)])
def test_a_budget_too_small_for_the_memory_tools_goes_without_them(
    http: httpx.Client, upstream: UpstreamServer, budget: str, offered: bool
) -> None:
    """The memory tools' definitions take 300 tokens: at a budget of 400 the room kept for them
    left a short question with a tool of the client's no room, and it was refused (400,
    `context_length_exceeded`). Such a budget goes to the messages, without the tools; one
    that leaves the messages room beside them still offers them."""
    weather = {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}},
    }
    question = {"role": "user", "content": unique("what is the weather like " * 10)}
    response = http.post(
        CHAT,
        json={"model": "m", "messages": [question], "tools": [weather]},
        headers={HEADER: new_conversation(), "X-Memstrata-Budget": budget},
    )
    assert response.status_code == 200, response.text
    [sent] = upstream.requests(CHAT)
    assert tool_names(sent["body"]) == (["weather", *MEMORY_TOOLS] if offered else ["weather"])
    assert sent["body"]["messages"][-1] == question


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_named_by_a_non_string_is_relayed_not_a_crash(
    http: httpx.Client, upstream: UpstreamServer, stream: bool
) -> None:
    # An upstream's mistake the plain relay passes on as it came: the loop must not fail on it.
    call = {"id": "call_bad", "type": "function", "function": {"name": ["x"], "arguments": "{}"}}
    if stream:
        chunk = {
            "id": "chatcmpl-bad",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "tool_calls": [{"index": 0, **call}]},
                    "finish_reason": "tool_calls",
                }
            ],
        }
        upstream.script({"sse": [json.dumps(chunk), "[DONE]"]})
    else:
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        upstream.script(
            {
                "body": {
                    "id": "chatcmpl-bad",
                    "object": "chat.completion",
                    "created": 1,
                    "model": "m",
                    "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                }
            }
        )
    response = http.post(
        CHAT,
        json={
            "model": "m",
            "messages": [{"role": "user", "content": unique("hi")}],
            "stream": stream,
        },
    )
    assert response.status_code == 200, response.text
    if stream:
        chunks, payloads = sse_chunks(response)
        assert payloads[-1] == "[DONE]"
        assert chunks[0]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, **call}]
    else:
        assert response.json()["choices"][0]["message"]["tool_calls"] == [call]
    assert len(upstream.requests(CHAT)) == 1


def test_upstream_error_in_a_later_round_non_stream(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    conversation = new_conversation()
    upstream.script(
        {"tool_calls": [memory_call("memory_browse", {"level": 0}, "call_m1")]},
        {"status": 429, "headers": {"Retry-After": "7"}},
    )
    question = unique("busy?")
    response = http.post(
        CHAT,
        json={"model": "m", "messages": [{"role": "user", "content": question}]},
        headers={HEADER: conversation},
    )
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert response.headers[HEADER] == conversation
    assert response.json()["error"]["message"] == "Scripted error 429"
    assert [m["content"] for m in stored(http, conversation, 1)] == [question]


def test_upstream_error_in_a_later_round_stream(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    conversation = new_conversation()
    upstream.script(
        {
            "reply": "Checking.",
            "tool_calls": [memory_call("memory_browse", {"level": 0}, "call_m1")],
        },
        {"status": 503},
    )
    parts: list[str] = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": unique("busy?")}],
            stream=True,
            extra_headers={HEADER: conversation},
        ):
            parts.append(chunk.choices[0].delta.content or "")
    assert failed.value.message == "Scripted error 503"
    assert "".join(parts) == "Checking."
    kept = stored(http, conversation, 2)
    assert (kept[1]["content"], kept[1]["status"]) == ("Checking.", "incomplete")


def test_a_stream_failing_in_a_later_round_records_the_usage_of_the_rounds_before(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    # The first round was billed: the partial reply is recorded with its usage, not with none.
    conversation = new_conversation()
    upstream.script(
        {
            "reply": "Checking.",
            "tool_calls": [memory_call("memory_browse", {"level": 0}, "call_m1")],
        },
        {"status": 503},
    )
    with pytest.raises(openai.APIError):
        for _chunk in client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": unique("busy?")}],
            stream=True,
            extra_headers={HEADER: conversation},
        ):
            pass
    assert stored(http, conversation, 2)[1]["status"] == "incomplete"
    first, _failed = upstream.requests(CHAT)
    billed = fake_usage(first["body"], 1 + len(json.dumps({"level": 0}).split()) + 1)
    assert stored_usage(http, conversation, wait_for=True) == {
        "upstream_prompt_tokens": billed["prompt_tokens"],
        "upstream_completion_tokens": billed["completion_tokens"],
        "tokens_cached": 0,
    }


def test_stream_cut_in_a_later_round_keeps_the_partial_reply(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    conversation = new_conversation()
    upstream.script(
        {"tool_calls": [memory_call("memory_browse", {"level": 0}, "call_m1")]},
        {"reply": "one two three four five", "cut_after": 3},
    )
    parts: list[str] = []
    with pytest.raises(openai.APIError) as cut:
        for chunk in client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": unique("count")}],
            stream=True,
            extra_headers={HEADER: conversation},
        ):
            parts.append(chunk.choices[0].delta.content or "")
    assert cut.value.body is not None
    assert cut.value.body["code"] == "upstream_stream_interrupted"  # type: ignore[index]
    assert "".join(parts) == "one two three"
    kept = stored(http, conversation, 2)
    assert (kept[1]["content"], kept[1]["status"]) == ("one two three", "incomplete")


@pytest.mark.parametrize("offered", [True, False])
def test_a_streamed_reply_is_stored_before_the_stream_ends(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer, offered: bool
) -> None:
    # A client may send its next turn the moment it has [DONE]: the reply must be there.
    conversation = new_conversation()
    extra: dict[str, Any] = {} if offered else {"tools": TOOLS, "tool_choice": "none"}
    for turn in range(3):
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": unique(f"turn {turn}")}],
            stream=True,
            extra_headers={HEADER: conversation},
            **extra,
        )
        content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        response = http.get(f"/admin/conversations/{conversation}/messages")
        last = response.json()["messages"][-1]
        assert (last["seq"], last["role"], last["content"]) == (2 * turn + 1, "assistant", content)
    assert [tool_names(r["body"]) == MEMORY_TOOLS for r in upstream.requests(CHAT)] == [offered] * 3


# -- the merged stream, event by event -------------------------------------------------------


def chunk_event(
    delta: dict[str, Any] | None,
    *,
    finish: str | None = None,
    completion: str = "chatcmpl-1",
    usage: dict[str, Any] | None = None,
    sep: str = "\n\n",
) -> bytes:
    """A chunk as the upstream streams it (`delta` None: a usage-only chunk)."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body: dict[str, Any] = {"id": completion, "object": "chat.completion.chunk"}
    body.update(choices=choices, usage=usage)
    return f"data: {json.dumps(body)}{sep}".encode()


def play(merged: MergedStream, data: bytes, *, final: bool) -> tuple[bytes, bool]:
    """Feed one round's bytes in small pieces; what the client got, and whether it continues."""
    current = merged.round(final=final)
    reader = EventReader()
    sent = b""
    for start in range(0, len(data), 7):
        for event in reader.feed(data[start : start + 7]):
            sent += current.event(event)
    for event in reader.close():
        sent += current.event(event)
    current.end()
    return sent, current.continues


def test_merged_stream_rewrites_rounds_into_one() -> None:
    merged = MergedStream()
    usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    memory_fragment = {
        "index": 0,
        "id": "call_m",
        "type": "function",
        "function": {"name": "memory_find", "arguments": '{"pat'},
    }
    client_fragment = {
        "index": 1,
        "id": "call_c",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    first = b"".join(
        [
            b": keep-alive\r\n\r\n",
            chunk_event({"role": "assistant", "content": "Hm. "}, sep="\r\n\r\n"),
            chunk_event({"tool_calls": [memory_fragment]}),
            # The last fragment in the same chunk as the finish, as some servers send it.
            chunk_event(
                {"tool_calls": [{"index": 0, "function": {"arguments": 'tern": "x"}'}}]},
                finish="tool_calls",
            ),
            chunk_event(None, usage=usage),
            b"data: [DONE]\n\n",
        ]
    )
    sent, continues = play(merged, first, final=False)
    assert continues
    assert sent.count(b"data:") == 1 and b"keep-alive" in sent and b"memory_find" not in sent
    assert merged.usage == usage

    second = b"".join(
        [
            chunk_event({"role": "assistant", "content": None}, completion="chatcmpl-2"),
            chunk_event({"content": "Sunny?"}, completion="chatcmpl-2"),
            chunk_event({"tool_calls": [{**memory_fragment, "index": 0}]}, completion="chatcmpl-2"),
            chunk_event({"tool_calls": [client_fragment]}, completion="chatcmpl-2"),
            chunk_event(
                {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
                completion="chatcmpl-2",
            ),
            chunk_event({}, finish="tool_calls", completion="chatcmpl-2", usage=usage),
            b"data: [DONE]\n\n",
        ]
    )
    sent2, continues2 = play(merged, second, final=False)
    assert not continues2  # the client's own call ends the loop
    sent2 += merged.done()
    chunks = [
        json.loads(line[6:])
        for line in (sent + sent2).decode().splitlines()
        if line.startswith("data: {")
    ]
    assert {c["id"] for c in chunks} == {"chatcmpl-1"}
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d.get("role") for d in deltas if "role" in d] == ["assistant"]
    calls = [f for d in deltas for f in d.get("tool_calls", [])]
    assert calls == [{**client_fragment, "index": 0}, {"index": 0, "function": {"arguments": "{}"}}]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    assert chunks[-1]["usage"] == add_usage(usage, usage)
    assert (sent + sent2).endswith(b"data: [DONE]\n\n")
    assert (sent + sent2).count(b"[DONE]") == 1
    reply = merged.reply.message()
    assert reply is not None and merged.reply.complete
    assert reply["content"] == "Hm. Sunny?"
    assert reply["tool_calls"] == [
        {"id": "call_c", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    ]


def test_merged_stream_keeps_the_first_rounds_created_and_model() -> None:
    # A later round is another completion upstream, made seconds later (or by a snapshot the
    # alias now points to): the client's one stream still shows one completion.
    merged = MergedStream()

    def event(delta: dict[str, Any], created: int, model: str, finish: str | None = None) -> bytes:
        chunk = {
            "id": f"chatcmpl-{created}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(chunk)}\n\n".encode()

    call = {"index": 0, "id": "m", "function": {"name": "memory_browse", "arguments": "{}"}}
    first = event({"role": "assistant", "content": "Hm."}, 100, "gpt-4o-2024-08-06")
    first += event({"tool_calls": [call]}, 100, "gpt-4o-2024-08-06", "tool_calls")
    sent, continues = play(merged, first, final=False)
    assert continues
    second = event({"role": "assistant", "content": "Yes."}, 103, "gpt-4o-2024-11-20")
    second += event({}, 103, "gpt-4o-2024-11-20", "stop")
    more, _ = play(merged, second, final=False)
    chunks = [
        json.loads(line[6:])
        for line in (sent + more).decode().splitlines()
        if line.startswith("data: {")
    ]
    assert len(chunks) == 3
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {
        ("chatcmpl-100", 100, "gpt-4o-2024-08-06")
    }


def test_merged_stream_round_without_a_finish_does_not_continue() -> None:
    merged = MergedStream()
    memory_fragment = {
        "index": 0,
        "id": "m",
        "function": {"name": "memory_browse", "arguments": "{"},
    }
    _, continues = play(merged, chunk_event({"tool_calls": [memory_fragment]}), final=False)
    assert not continues  # cut before its end: never run a half-received call
    assert merged.done() == b""
    assert not merged.reply.complete


def test_merged_stream_last_round_strips_memory_calls() -> None:
    merged = MergedStream()
    fragment = {"index": 0, "id": "m", "function": {"name": "memory_browse", "arguments": "{}"}}
    data = chunk_event({"role": "assistant", "tool_calls": [fragment]}) + chunk_event(
        {}, finish="tool_calls"
    )
    sent, continues = play(merged, data, final=True)
    assert not continues
    chunks = [
        json.loads(line[6:]) for line in sent.decode().splitlines() if line.startswith("data: ")
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    assert all("tool_calls" not in c["choices"][0]["delta"] for c in chunks)


# -- auto: offered when the prompt was rebuilt -----------------------------------------------


def test_auto_offers_the_tools_only_to_a_rebuilt_prompt(
    database_url: str, upstream: UpstreamServer
) -> None:
    conversation = {HEADER: new_conversation()}
    history: list[Any] = []
    for turn in range(12):
        history.append({"role": "user", "content": unique(f"turn {turn} " + "words " * 40)})
        history.append({"role": "assistant", "content": "noted " * 40})
    question = {"role": "user", "content": unique("and now?")}
    with (
        GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as auto,
        httpx.Client(base_url=auto.root_url, timeout=20) as http,
    ):
        # Fits the default budget: forwarded as sent, without tools.
        fits = http.post(CHAT, json={"model": "m", "messages": history}, headers=conversation)
        # Then only the new message, with a budget the stored history no longer fits.
        squeezed = http.post(
            CHAT,
            json={"model": "m", "messages": [question]},
            headers={**conversation, "X-Memstrata-Budget": "600"},
        )
    assert (fits.status_code, squeezed.status_code) == (200, 200), squeezed.text
    first, second = upstream.requests(CHAT)
    assert "tools" not in first["body"]
    assert tool_names(second["body"]) == MEMORY_TOOLS
    assert second["body"]["messages"][-1] == question
    assert len(second["body"]["messages"]) < len(history)
