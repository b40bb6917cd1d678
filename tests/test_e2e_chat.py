"""End to end: the real `openai` SDK → the gateway process → the fake upstream process.

Every test drives the official SDK (sync and async, streaming and not) or raw httpx at a real
`memstrata serve` process whose upstream is `devkit/upstream_server.py`, and checks the three
places that matter: what the client received, what the upstream received (its recorded
requests), and what Postgres holds (the admin endpoint from sync tests, the `engine` fixture
from async ones). The gateway runs without background workers so that stored rows stay as the
request path wrote them. Conversations are told apart by unique message text, so tests share
the default tenant without matching each other's histories.
"""

import asyncio
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from http.client import HTTPConnection
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.service import free_port
from devkit.upstream import UpstreamServer
from devkit.upstream_script import embedding_vector
from devkit.upstream_server import MODELS
from memory.schema import DEFAULT_TENANT, conversations, nodes, tenants

CHAT = "/v1/chat/completions"
HEADER = "X-Memstrata-Conversation"
CLIENT_KEY = "sk-client-e2e-0123456789"
UPSTREAM_TIMEOUT = 2.0
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

Message = dict[str, Any]


pytestmark = pytest.mark.usefixtures("fresh_upstream")


def unique(text: str) -> str:
    return f"{text} [{uuid.uuid4().hex[:12]}]"


def new_conversation_id() -> str:
    return f"e2e-{uuid.uuid4().hex}"


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamServer]:
    with UpstreamServer(chunk_delay=0.01) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=0,
        upstream_timeout=UPSTREAM_TIMEOUT,
    ) as process:
        yield process


@pytest.fixture
def client(gateway: GatewayProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url, api_key=CLIENT_KEY, max_retries=0, timeout=15) as sdk:
        yield sdk


@pytest.fixture
async def aclient(gateway: GatewayProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=gateway.url, api_key=CLIENT_KEY, max_retries=0, timeout=15
    ) as sdk:
        yield sdk


@pytest.fixture
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.root_url, timeout=15) as raw:
        yield raw


# -- what Postgres holds -------------------------------------------------------------------


def admin_messages(http: httpx.Client, conversation: str) -> list[Message]:
    response = http.get(f"/admin/conversations/{conversation}/messages")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["conversation"] == conversation
    messages: list[Message] = body["messages"]
    return messages


def wait_admin_messages(http: httpx.Client, conversation: str, count: int) -> list[Message]:
    """The stored messages once there are `count` (a streamed reply is stored as it ends)."""
    deadline = time.monotonic() + 5
    while True:
        messages = admin_messages(http, conversation)
        if len(messages) >= count or time.monotonic() > deadline:
            return messages
        time.sleep(0.02)


async def db_messages(engine: AsyncEngine, conversation: str) -> list[Message]:
    query = (
        select(
            nodes.c.id,
            nodes.c.seq,
            nodes.c.role,
            nodes.c.content,
            nodes.c.tool_calls,
            nodes.c.tool_call_id,
            nodes.c.status,
        )
        .join(conversations, conversations.c.id == nodes.c.conversation_id)
        .join(tenants, tenants.c.id == conversations.c.tenant_id)
        .where(
            tenants.c.name == DEFAULT_TENANT,
            conversations.c.external_id == conversation,
            nodes.c.level == 0,
        )
        .order_by(nodes.c.seq)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    return [{**row, "node_id": row["id"]} for row in rows]


async def wait_db_messages(engine: AsyncEngine, conversation: str, count: int) -> list[Message]:
    deadline = time.monotonic() + 5
    while True:
        messages = await db_messages(engine, conversation)
        if len(messages) >= count or time.monotonic() > deadline:
            return messages
        await asyncio.sleep(0.02)


def summary(messages: list[Message]) -> list[tuple[int, str, Any, str]]:
    return [(m["seq"], m["role"], m["content"], m["status"]) for m in messages]


def expected(
    history: Sequence[Mapping[str, Any]], status: str = "complete"
) -> list[tuple[int, str, Any, str]]:
    return [(seq, m["role"], m.get("content"), status) for seq, m in enumerate(history)]


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code


# -- the four SDK modes --------------------------------------------------------------------


def test_sync_non_stream(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    text = unique("hello from the sync client")
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": text},
    ]
    raw = client.chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=messages)
    completion = raw.parse()
    conversation = raw.headers[HEADER]

    assert completion.choices[0].message.content == f"echo: {text}"
    assert completion.model == "gpt-4o-mini"
    [sent] = upstream.requests(CHAT)
    assert sent["body"] == {"model": "gpt-4o-mini", "messages": messages}
    # Upstream headers relayed; its request id beside the gateway's own.
    assert raw.headers["x-upstream-request-id"] == sent["request_id"]
    assert raw.headers["x-request-id"] != sent["request_id"]
    assert summary(admin_messages(http, conversation)) == expected(
        [*messages, {"role": "assistant", "content": f"echo: {text}"}]
    )


def test_sync_stream(client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer) -> None:
    text = unique("stream me some words please")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    # One cache-control, not the upstream's beside the gateway's.
    assert raw.headers.get_list("cache-control") == ["no-cache"]
    conversation = raw.headers[HEADER]
    parts: list[str] = []
    usage = None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage

    assert "".join(parts) == f"echo: {text}"
    assert len(parts) > 3
    assert usage is not None and usage.completion_tokens == len(parts)
    [sent] = upstream.requests(CHAT)
    assert sent["body"] == {
        "model": "gpt-4o-mini",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stored = wait_admin_messages(http, conversation, 2)
    assert summary(stored) == expected(
        [*messages, {"role": "assistant", "content": "".join(parts)}]
    )


async def test_async_non_stream(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    text = unique("hello from the async client")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    raw = await aclient.chat.completions.with_raw_response.create(model="m", messages=messages)
    completion = raw.parse()
    conversation = raw.headers[HEADER]

    assert completion.choices[0].message.content == f"echo: {text}"
    [sent] = upstream.requests(CHAT)
    assert sent["body"] == {"model": "m", "messages": messages}
    assert summary(await db_messages(engine, conversation)) == expected(
        [*messages, {"role": "assistant", "content": f"echo: {text}"}]
    )


async def test_async_stream(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    text = unique("async streaming works too")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    raw = await aclient.chat.completions.with_raw_response.create(
        model="m", messages=messages, stream=True
    )
    conversation = raw.headers[HEADER]
    parts = [
        chunk.choices[0].delta.content
        async for chunk in raw.parse()
        if chunk.choices and chunk.choices[0].delta.content
    ]

    assert "".join(parts) == f"echo: {text}"
    assert upstream.requests(CHAT)[0]["body"]["stream"] is True
    stored = await wait_db_messages(engine, conversation, 2)
    assert summary(stored) == expected(
        [*messages, {"role": "assistant", "content": "".join(parts)}]
    )


def test_stream_first_chunk_arrives_before_upstream_finished(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    words = "one two three four five six seven eight nine ten"
    delay = 0.15
    upstream.script({"reply": words, "chunk_delay": delay})
    started = time.monotonic()
    first_at: float | None = None
    first_wall: float | None = None
    parts: list[str] = []
    for chunk in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": unique("count")}], stream=True
    ):
        if first_at is None:
            first_at, first_wall = time.monotonic(), time.time()
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    total = time.monotonic() - started

    assert "".join(parts) == words
    assert first_at is not None and first_wall is not None
    upstream_needs = len(words.split()) * delay  # the upstream's own time to produce them all
    assert total >= upstream_needs
    assert first_at - started < total / 3, (first_at - started, total)
    [sent] = upstream.requests(CHAT)
    assert first_wall < sent["received_at"] + upstream_needs / 2


# -- identity ------------------------------------------------------------------------------


def test_resent_whole_history_stores_each_message_once(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    history: list[Any] = [{"role": "system", "content": unique("You remember everything.")}]
    seen: set[str] = set()
    for turn in range(4):
        history.append({"role": "user", "content": unique(f"turn {turn}")})
        if turn == 2:  # one turn streamed: the stream's reply must chain the same way
            raw_stream = client.chat.completions.with_raw_response.create(
                model="m", messages=history, stream=True
            )
            seen.add(raw_stream.headers[HEADER])
            content = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in raw_stream.parse()
                if chunk.choices
            )
            history.append({"role": "assistant", "content": content})
            continue
        raw = client.chat.completions.with_raw_response.create(model="m", messages=history)
        seen.add(raw.headers[HEADER])
        message = raw.parse().choices[0].message
        # Turn 1 resends the SDK's own message object, as many apps do.
        history.append(
            message.model_dump(exclude_none=True)
            if turn == 1
            else {"role": "assistant", "content": message.content}
        )

    assert len(seen) == 1, "every turn must land in the same conversation"
    [conversation] = seen
    sent = upstream.requests(CHAT)
    assert len(sent) == 4
    assert sent[-1]["body"]["messages"] == history[:-1]  # the whole history, as sent
    stored = wait_admin_messages(http, conversation, len(history))
    assert [m["seq"] for m in stored] == list(range(len(history)))
    assert [(m["role"], m["content"]) for m in stored] == [
        (m["role"], m["content"]) for m in history
    ]


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
def test_a_system_prompt_that_changes_each_turn_keeps_one_conversation(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer, named: bool
) -> None:
    """A client that puts the time in its system prompt and resends its whole history: one
    conversation, each message stored once, and the upstream gets each turn's own system
    prompt. Before, every turn matched nothing (chain hashes chain the system prompt in): a new
    conversation each turn holding the whole history again, or, with a conversation id, the
    whole history appended again. A new chat under another system prompt that opens with the
    same words is still a conversation of its own."""
    opener = unique("What is on my calendar?")
    headers = {HEADER: new_conversation_id()} if named else {}
    turns: list[Any] = []
    seen: set[str] = set()
    for turn in range(3):
        system: Any = {"role": "system", "content": f"You are helpful. It is 10:0{turn}."}
        turns.append({"role": "user", "content": opener if turn == 0 else unique(f"then {turn}")})
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[system, *turns], extra_headers=headers
        )
        seen.add(raw.headers[HEADER])
        turns.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        assert upstream.requests(CHAT)[-1]["body"]["messages"][0] == system
    assert len(seen) == 1, "every turn must land in the same conversation"
    [conversation] = seen
    stored = wait_admin_messages(http, conversation, 1 + len(turns))
    assert [(m["role"], m["content"]) for m in stored] == [
        ("system", "You are helpful. It is 10:00."),
        *((m["role"], m["content"]) for m in turns),
    ]
    if not named:
        other: Any = {"role": "system", "content": "You are a pirate."}
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=[other, {"role": "user", "content": opener}]
        )
        assert raw.headers[HEADER] != conversation


def test_a_client_sending_new_turns_under_a_changing_system_prompt(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    """A client that sends only its new messages, each time under its current system prompt
    (the time in it): the upstream gets that prompt once, first, and none of the earlier ones,
    which the conversation still keeps. A later request without a system prompt is answered
    under the latest one. Before, each new system prompt was stored as a turn of the history,
    and every later prompt carried all of them."""
    headers = {HEADER: new_conversation_id()}
    history: list[Any] = []
    systems: list[Any] = [
        {"role": "system", "content": f"You are helpful. It is 10:0{n}."} for n in range(3)
    ]
    for turn, system in enumerate(systems):
        user: Any = {"role": "user", "content": unique(f"new turn {turn}")}
        reply = client.chat.completions.create(
            model="m", messages=[system, user], extra_headers=headers
        )
        assert upstream.requests(CHAT)[-1]["body"]["messages"] == [system, *history, user]
        history += [user, {"role": "assistant", "content": reply.choices[0].message.content}]
    user = {"role": "user", "content": unique("and without a system prompt")}
    client.chat.completions.create(model="m", messages=[user], extra_headers=headers)
    assert upstream.requests(CHAT)[-1]["body"]["messages"] == [systems[-1], *history, user]
    stored = wait_admin_messages(http, headers[HEADER], 9)
    assert (
        [(m["content"], m["system_prompt"]) for m in stored if m["role"] == "system"]
        == [
            (systems[0]["content"], False),  # the conversation's first: it opens the history
            *((s["content"], True) for s in systems[1:]),
        ]
    )


def test_a_changing_system_prompt_past_the_budget_is_sent_once(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    """The same client past its budget, where the prompt comes from the working context: only
    the current system prompt, once, first, before the verbatim turns."""
    headers = {HEADER: new_conversation_id(), "X-Memstrata-Budget": "800"}
    filler = " ".join(f"word{n}" for n in range(40))
    users: list[Any] = []
    past_with_turns = 0  # prompts past the budget that carry earlier turns verbatim
    for turn in range(12):
        system: Any = {"role": "system", "content": f"You are helpful. It is 11:{turn:02}."}
        users.append({"role": "user", "content": unique(f"turn {turn} {filler}")})
        client.chat.completions.create(
            model="m", messages=[system, users[-1]], extra_headers=headers
        )
        sent = upstream.requests(CHAT)[-1]["body"]["messages"]
        assert sent[0] == system and sent[-1] == users[-1]
        carried = [m for m in sent if "You are helpful" in json.dumps(m)]
        assert carried == [system]
        past_with_turns += users[0] not in sent and users[-2] in sent
    assert past_with_turns >= 2


async def test_header_mode_with_only_new_messages(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    conversation = new_conversation_id()
    headers = {HEADER: conversation}
    system = {"role": "system", "content": "Be brief."}
    stored_history: list[Message] = [system]
    for turn in range(3):
        user = {"role": "user", "content": unique(f"header turn {turn}")}
        # Clients that send only new turns usually repeat their system prompt.
        messages: list[Any] = [system, user] if turn < 2 else [user]
        if turn == 2:
            raw_stream = await aclient.chat.completions.with_raw_response.create(
                model="m", messages=messages, stream=True, extra_headers=headers
            )
            assert raw_stream.headers[HEADER] == conversation
            chunks = raw_stream.parse()
            content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            raw = await aclient.chat.completions.with_raw_response.create(
                model="m", messages=messages, extra_headers=headers
            )
            assert raw.headers[HEADER] == conversation
            content = raw.parse().choices[0].message.content or ""
        assert content == f"echo: {user['content']}"
        assert upstream.requests(CHAT)[-1]["body"]["messages"][-1] == user
        stored_history += [user, {"role": "assistant", "content": content}]

    stored = await wait_db_messages(engine, conversation, len(stored_history))
    assert summary(stored) == expected(stored_history)


# -- pass-through --------------------------------------------------------------------------


def test_unknown_fields_reach_the_upstream_untouched(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": unique("fields")}]
    vendor = {"nested": [1, 2.5, None, True, {"deep": "é ✓"}], "big": 12345678901234567890}
    client.chat.completions.create(
        model="gpt-4o",
        messages=messages,
        temperature=0.3,
        top_p=0.9,
        seed=7,
        n=1,
        max_completion_tokens=64,
        response_format={"type": "json_object"},
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=False,
        metadata={"purpose": "e2e"},
        logit_bias={"50256": -100},
        extra_body={"x_vendor_option": vendor, "top_k": 40},
    )
    [sent] = upstream.requests(CHAT)
    assert sent["body"] == {
        "model": "gpt-4o",
        "messages": messages,
        "temperature": 0.3,
        "top_p": 0.9,
        "seed": 7,
        "n": 1,
        "max_completion_tokens": 64,
        "response_format": {"type": "json_object"},
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "metadata": {"purpose": "e2e"},
        "logit_bias": {"50256": -100},
        "x_vendor_option": vendor,
        "top_k": 40,
    }


def test_raw_body_reaches_the_upstream_as_sent(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    body: dict[str, Any] = {
        "zeta_first": {"keeps": ["order", "and", "types", 1, 1.5, False, None]},
        "model": "m",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": unique("parts")}], "x": 1},
        ],
        "some_future_field": {"a": [[]], "b": {}},
        "user": None,
    }
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    [sent] = upstream.requests(CHAT)
    assert sent["body"] == body
    assert list(sent["body"]) == list(body)  # key order too


def test_client_authorization_and_openai_headers_forwarded(
    gateway: GatewayProcess, upstream: UpstreamServer
) -> None:
    with openai.OpenAI(
        base_url=gateway.url,
        api_key="sk-only-the-client-has-this",
        organization="org-e2e",
        project="proj-e2e",
        max_retries=0,
    ) as sdk:
        sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": unique("auth")}]
        )
        sdk.models.list()
        sdk.embeddings.create(model="text-embedding-3-small", input="auth")
    recorded = upstream.requests()
    assert [r["path"] for r in recorded] == [CHAT, "/v1/models", "/v1/embeddings"]
    for request in recorded:
        assert request["headers"]["authorization"] == "Bearer sk-only-the-client-has-this"
        assert request["headers"]["openai-organization"] == "org-e2e"
        assert request["headers"]["openai-project"] == "proj-e2e"


def test_models_and_embeddings_pass_through(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == list(MODELS)

    inputs = ["alpha beta", "gamma"]
    result = client.embeddings.create(model="text-embedding-3-small", input=inputs)
    assert [item.index for item in result.data] == [0, 1]
    for item, text in zip(result.data, inputs, strict=True):
        reference = embedding_vector(text, 384)
        # The SDK asks for base64 (float32); the float32 round trip is the only change.
        as_float32 = struct.unpack("<384f", struct.pack("<384f", *reference))
        assert item.embedding == pytest.approx(list(as_float32))
    assert result.usage.prompt_tokens == 3

    [listed] = upstream.requests("/v1/models")
    assert listed["method"] == "GET"
    [embedded] = upstream.requests("/v1/embeddings")
    assert embedded["body"] == {
        "model": "text-embedding-3-small",
        "input": inputs,
        "encoding_format": "base64",
    }


async def test_async_models_and_embeddings_pass_through(
    aclient: openai.AsyncOpenAI, upstream: UpstreamServer
) -> None:
    page = await aclient.models.list()
    assert [model.id for model in page.data] == list(MODELS)
    result = await aclient.embeddings.create(
        model="text-embedding-3-small", input="delta", dimensions=8, encoding_format="float"
    )
    assert result.data[0].embedding == pytest.approx(embedding_vector("delta", 8))
    assert upstream.requests("/v1/embeddings")[0]["body"]["dimensions"] == 8


def test_models_and_embeddings_errors_are_relayed(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    upstream.script(
        {"path": "/v1/models", "status": 503, "headers": {"Retry-After": "3"}},
        {"path": "/v1/embeddings", "status": 400},
    )
    with pytest.raises(openai.InternalServerError) as unavailable:
        client.models.list()
    assert unavailable.value.status_code == 503
    assert unavailable.value.response.headers["retry-after"] == "3"
    with pytest.raises(openai.BadRequestError) as bad:
        client.embeddings.create(model="e", input="x")
    assert bad.value.body == {
        "message": "Scripted error 400",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


# -- tool calls ----------------------------------------------------------------------------


def test_tool_call_reply_stored_non_stream(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    upstream.script(
        {
            "tool_calls": [
                {"id": "call_e2e_1", "name": "get_weather", "arguments": {"city": "Paris"}}
            ]
        }
    )
    history: list[Any] = [{"role": "user", "content": unique("weather in Paris?")}]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=history, tools=TOOLS)
    conversation = raw.headers[HEADER]
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    [call] = choice.message.tool_calls
    assert call.id == "call_e2e_1"
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert call.function.arguments == '{"city": "Paris"}'  # type: ignore[union-attr]

    stored_call = {
        "id": "call_e2e_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    [_user, assistant] = admin_messages(http, conversation)
    assert (assistant["role"], assistant["content"], assistant["tool_calls"]) == (
        "assistant",
        None,
        [stored_call],
    )

    # The client runs the tool and resends everything: the same conversation goes on.
    history.append(choice.message.model_dump(exclude_none=True))
    history.append({"role": "tool", "tool_call_id": "call_e2e_1", "content": "18 C, sunny"})
    history.append({"role": "user", "content": unique("thanks")})
    raw = client.chat.completions.with_raw_response.create(model="m", messages=history, tools=TOOLS)
    assert raw.headers[HEADER] == conversation
    stored = admin_messages(http, conversation)
    assert [(m["seq"], m["role"]) for m in stored] == list(
        enumerate(["user", "assistant", "tool", "user", "assistant"])
    )
    assert stored[1]["tool_calls"] == [stored_call]
    assert (stored[2]["tool_call_id"], stored[2]["content"]) == ("call_e2e_1", "18 C, sunny")
    assert upstream.requests(CHAT)[-1]["body"]["messages"][1]["tool_calls"] == [stored_call]


async def test_tool_call_reply_stored_stream(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    arguments = {"city": "Reykjavik", "units": "metric", "days": [1, 2, 3]}
    upstream.script(
        {
            "tool_calls": [
                {"id": "call_s1", "name": "get_weather", "arguments": arguments},
                {"id": "call_s2", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            ]
        }
    )
    raw = await aclient.chat.completions.with_raw_response.create(
        model="m",
        messages=[{"role": "user", "content": unique("two cities")}],
        tools=TOOLS,
        stream=True,
    )
    conversation = raw.headers[HEADER]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    async for chunk in raw.parse():
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for fragment in choice.delta.tool_calls or []:
            call = calls.setdefault(fragment.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += fragment.id or ""
            if fragment.function is not None:
                call["name"] += fragment.function.name or ""
                call["arguments"] += fragment.function.arguments or ""
    assert finish == "tool_calls"
    assert [calls[0]["id"], calls[1]["id"]] == ["call_s1", "call_s2"]

    stored = await wait_db_messages(engine, conversation, 2)
    assistant = stored[1]
    assert (assistant["role"], assistant["status"]) == ("assistant", "complete")
    assert assistant["tool_calls"] == [
        {
            "id": calls[index]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": calls[index]["arguments"]},
        }
        for index in (0, 1)
    ]
    assert calls[1]["arguments"] == '{"city": "Oslo"}'


# -- faults --------------------------------------------------------------------------------


async def test_user_messages_stored_before_forwarding(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    conversation = new_conversation_id()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": unique("keep me even if the upstream fails")},
    ]
    upstream.script({"delay": 0.8, "status": 500})
    request = asyncio.create_task(
        aclient.chat.completions.create(
            model="m", messages=messages, extra_headers={HEADER: conversation}
        )
    )
    stored = await wait_db_messages(engine, conversation, 2)
    assert not request.done(), "the messages must be stored while the upstream is still working"
    assert summary(stored) == expected(messages)

    with pytest.raises(openai.InternalServerError) as failed:
        await request
    assert failed.value.status_code == 500
    assert failed.value.response.headers[HEADER] == conversation
    assert failed.value.body == {
        "message": "Scripted error 500",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert len(upstream.requests(CHAT)) == 1
    # No assistant reply was stored for the failed call.
    assert summary(await db_messages(engine, conversation)) == expected(messages)


RATE_LIMIT_BODY = {
    "error": {
        "message": "Rate limit reached for gpt-4o-mini on requests per min (RPM): Limit 3.",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
}
RATE_LIMIT = {
    "status": 429,
    "body": RATE_LIMIT_BODY,
    "headers": {"Retry-After": "7", "x-ratelimit-remaining-requests": "0"},
}


def test_rate_limit_relayed_to_the_sdk(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    upstream.script(RATE_LIMIT)
    conversation = new_conversation_id()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": unique("429")}]
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(
            model="m", messages=messages, extra_headers={HEADER: conversation}
        )
    error = limited.value
    assert error.status_code == 429
    assert error.body == RATE_LIMIT_BODY["error"]
    assert error.response.json() == RATE_LIMIT_BODY
    assert error.response.headers["retry-after"] == "7"
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert error.response.headers[HEADER] == conversation
    upstream_id = upstream.requests(CHAT)[0]["request_id"]
    assert error.response.headers["x-upstream-request-id"] == upstream_id
    assert error.request_id == error.response.headers["x-request-id"] != upstream_id
    assert summary(admin_messages(http, conversation)) == expected(messages)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_rate_limit_relayed_raw(http: httpx.Client, upstream: UpstreamServer, stream: bool) -> None:
    upstream.script(RATE_LIMIT)
    body = {"model": "m", "messages": [{"role": "user", "content": unique("429")}]}
    response = http.post(CHAT, json={**body, "stream": stream})
    assert response.status_code == 429
    assert response.json() == RATE_LIMIT_BODY
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["retry-after"] == "7"
    assert response.headers[HEADER]


UPSTREAM_ERRORS = {
    "400": (400, {"error": {"message": "bad", "type": "invalid_request_error", "param": "n"}}),
    "401": (401, None),
    "404 model": (404, {"error": {"message": "no such model", "code": "model_not_found"}}),
    "500": (500, None),
    "502 html": (502, "<html>bad gateway</html>"),
    "503 text": (503, "upstream overloaded, try later"),
}


@pytest.mark.parametrize(("status", "body"), UPSTREAM_ERRORS.values(), ids=UPSTREAM_ERRORS.keys())
def test_upstream_errors_keep_status_and_body(
    http: httpx.Client, upstream: UpstreamServer, status: int, body: Any
) -> None:
    behaviour: dict[str, Any] = {"status": status, "headers": {"x-upstream-marker": "kept"}}
    if body is not None:
        behaviour["body"] = body
    upstream.script(behaviour)
    conversation = new_conversation_id()
    response = http.post(
        CHAT,
        json={"model": "m", "messages": [{"role": "user", "content": unique("err")}]},
        headers={HEADER: conversation},
    )
    assert response.status_code == status
    assert response.headers["x-upstream-marker"] == "kept"
    assert response.headers[HEADER] == conversation
    if isinstance(body, str):
        assert response.headers["content-type"].startswith("text/plain")
        assert response.text == body
    elif body is not None:
        assert response.json() == body
    else:
        assert response.json()["error"]["message"] == f"Scripted error {status}"
    assert [m["role"] for m in admin_messages(http, conversation)] == ["user"]


async def test_upstream_500_relayed_to_the_async_sdk_stream(
    aclient: openai.AsyncOpenAI, upstream: UpstreamServer
) -> None:
    upstream.script({"status": 500})
    with pytest.raises(openai.InternalServerError) as failed:
        await aclient.chat.completions.create(
            model="m", messages=[{"role": "user", "content": unique("500")}], stream=True
        )
    assert failed.value.status_code == 500
    assert failed.value.response.headers[HEADER]


def test_upstream_down_is_502(database_url: str, upstream: UpstreamServer) -> None:
    closed = f"http://127.0.0.1:{free_port()}/v1"
    with (
        GatewayProcess(database_url=database_url, upstream_url=closed, workers=0) as down,
        httpx.Client(base_url=down.root_url, timeout=15) as http,
        openai.OpenAI(base_url=down.url, api_key=CLIENT_KEY, max_retries=0) as sdk,
    ):
        conversation = new_conversation_id()
        messages = [{"role": "user", "content": unique("anyone there?")}]
        response = http.post(
            CHAT, json={"model": "m", "messages": messages}, headers={HEADER: conversation}
        )
        assert_openai_error(response, 502, "upstream_unavailable")
        assert response.json()["error"]["type"] == "upstream_error"
        assert response.headers[HEADER] == conversation
        assert summary(admin_messages(http, conversation)) == expected(messages)

        with pytest.raises(openai.InternalServerError) as failed:
            sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": unique("x")}], stream=True
            )
        assert failed.value.status_code == 502
        assert failed.value.body is not None
        with pytest.raises(openai.InternalServerError):
            sdk.models.list()
        assert_openai_error(http.post("/v1/embeddings", json={"model": "e", "input": "x"}), 502)
        assert http.get("/readyz").status_code == 200  # the database is fine
    assert upstream.requests() == []


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_upstream_timeout_is_504(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer, stream: bool
) -> None:
    upstream.script({"delay": UPSTREAM_TIMEOUT + 1.5})
    conversation = new_conversation_id()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": unique("slow")}]
    started = time.monotonic()
    if stream:
        with pytest.raises(openai.InternalServerError) as failed:
            client.chat.completions.create(
                model="m", messages=messages, stream=True, extra_headers={HEADER: conversation}
            )
        assert failed.value.status_code == 504
        assert failed.value.body is not None
        assert failed.value.body["code"] == "upstream_timeout"  # type: ignore[index]
        assert failed.value.response.headers[HEADER] == conversation
    else:
        response = http.post(
            CHAT, json={"model": "m", "messages": messages}, headers={HEADER: conversation}
        )
        assert_openai_error(response, 504, "upstream_timeout")
        assert response.headers[HEADER] == conversation
    assert UPSTREAM_TIMEOUT - 0.2 < time.monotonic() - started < UPSTREAM_TIMEOUT + 1.4
    assert summary(admin_messages(http, conversation)) == expected(messages)


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_stream_cut_keeps_partial_reply_marked_incomplete(
    client: openai.OpenAI,
    aclient: openai.AsyncOpenAI,
    engine: AsyncEngine,
    upstream: UpstreamServer,
    mode: str,
) -> None:
    upstream.script({"reply": "one two three four five six seven eight", "cut_after": 3})
    conversation = new_conversation_id()
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": unique("cut")}]
    parts: list[str] = []
    with pytest.raises(openai.APIError) as cut:
        if mode == "sync":
            for chunk in client.chat.completions.create(
                model="m", messages=messages, stream=True, extra_headers={HEADER: conversation}
            ):
                parts.append(chunk.choices[0].delta.content or "")
        else:
            async for chunk in await aclient.chat.completions.create(
                model="m", messages=messages, stream=True, extra_headers={HEADER: conversation}
            ):
                parts.append(chunk.choices[0].delta.content or "")
    # The gateway ends its own stream cleanly with an OpenAI error event: the SDK raises it.
    assert not isinstance(cut.value, openai.APIConnectionError | openai.APIStatusError)
    assert cut.value.body is not None
    assert cut.value.body["code"] == "upstream_stream_interrupted"  # type: ignore[index]
    assert "".join(parts) == "one two three"

    stored = await wait_db_messages(engine, conversation, 2)
    assert summary(stored) == [
        (0, "user", messages[0]["content"], "complete"),
        (1, "assistant", "one two three", "incomplete"),
    ]


async def test_stream_read_timeout_keeps_partial_reply(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    upstream.script({"reply": "alpha beta gamma", "chunk_delay": UPSTREAM_TIMEOUT + 1.0})
    conversation = new_conversation_id()
    parts: list[str] = []
    with pytest.raises(openai.APIError) as stalled:
        async for chunk in await aclient.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": unique("stall")}],
            stream=True,
            extra_headers={HEADER: conversation},
        ):
            parts.append(chunk.choices[0].delta.content or "")
    assert stalled.value.body is not None
    assert stalled.value.body["code"] == "upstream_stream_interrupted"  # type: ignore[index]
    assert "".join(parts) == "alpha"
    stored = await wait_db_messages(engine, conversation, 2)
    assert (stored[1]["content"], stored[1]["status"]) == ("alpha", "incomplete")


def test_non_stream_connection_cut_is_502(http: httpx.Client, upstream: UpstreamServer) -> None:
    upstream.script({"cut_after": 0})
    conversation = new_conversation_id()
    messages = [{"role": "user", "content": unique("cut before answering")}]
    response = http.post(
        CHAT, json={"model": "m", "messages": messages}, headers={HEADER: conversation}
    )
    assert_openai_error(response, 502, "upstream_unavailable")
    assert response.headers[HEADER] == conversation
    assert summary(admin_messages(http, conversation)) == expected(messages)


# -- concurrency ---------------------------------------------------------------------------


async def test_concurrent_requests_on_one_conversation(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    count = 10
    conversation = new_conversation_id()
    upstream.set_default({"delay": 0.2})  # all of them in flight at once
    texts = [unique(f"concurrent {index}") for index in range(count)]

    async def one(index: int) -> str:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": texts[index]}]
        headers = {HEADER: conversation}
        if index % 2:
            stream = await aclient.chat.completions.create(
                model="m", messages=messages, stream=True, extra_headers=headers
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        completion = await aclient.chat.completions.create(
            model="m", messages=messages, extra_headers=headers
        )
        return completion.choices[0].message.content or ""

    replies = await asyncio.gather(*(one(index) for index in range(count)))
    assert replies == [f"echo: {text}" for text in texts]
    assert len(upstream.requests(CHAT)) == count

    stored = await wait_db_messages(engine, conversation, 2 * count)
    assert [m["seq"] for m in stored] == list(range(2 * count))
    users = [m["content"] for m in stored if m["role"] == "user"]
    assistants = [m["content"] for m in stored if m["role"] == "assistant"]
    assert sorted(users) == sorted(texts)
    assert sorted(assistants) == sorted(replies)


# -- admin and probes ----------------------------------------------------------------------


async def test_admin_lists_messages_in_order(
    aclient: openai.AsyncOpenAI, engine: AsyncEngine, gateway: GatewayProcess
) -> None:
    conversation = new_conversation_id()
    for turn in range(2):
        await aclient.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": unique(f"admin {turn}")}],
            extra_headers={HEADER: conversation},
        )
    async with httpx.AsyncClient(base_url=gateway.root_url) as http:
        response = await http.get(f"/admin/conversations/{conversation}/messages")
    assert response.status_code == 200
    body = response.json()
    assert body["conversation"] == conversation
    listed = body["messages"]
    for message in listed:
        assert {"seq", "role", "content", "node_id", "status", "tool_calls"} <= set(message)
    in_db = await db_messages(engine, conversation)
    assert [(m["seq"], m["node_id"], m["role"], m["content"]) for m in listed] == [
        (m["seq"], m["node_id"], m["role"], m["content"]) for m in in_db
    ]
    assert [m["seq"] for m in listed] == [0, 1, 2, 3]


def test_healthz_and_readyz(http: httpx.Client) -> None:
    healthz = http.get("/healthz")
    assert (healthz.status_code, healthz.json()) == (200, {"status": "ok"})
    readyz = http.get("/readyz")
    assert (readyz.status_code, readyz.json()) == (200, {"status": "ok", "database": "ok"})


def test_an_idle_client_connection_outlives_the_sdks_own_keep_alive(
    gateway: GatewayProcess,
) -> None:
    """`serve` keeps an idle connection past the 5 s the openai SDKs keep theirs (and uvicorn's
    default, which closed it at 5 s: a request sent then would be lost)."""
    connection = HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        ports = []
        for number in range(2):
            if number:
                time.sleep(6)
            connection.request("GET", "/healthz")
            response = connection.getresponse()
            assert response.status == 200
            response.read()
            assert connection.sock is not None
            ports.append(connection.sock.getsockname()[1])
        assert ports[0] == ports[1]  # the same connection, not a new one
    finally:
        connection.close()


def test_a_tool_result_too_large_for_one_text_index_entry_is_stored_and_found(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer
) -> None:
    """A tool result of ~1.1 MB of distinct words (a log, a JSON dump) is stored whole, and its
    beginning is found by full text: Postgres holds at most 1 MB of search vector per row, and
    the row was refused (500)."""
    words = [uuid.uuid5(uuid.NAMESPACE_OID, str(i)).hex for i in range(34_000)]
    log = " ".join(words)
    history: list[Any] = [
        {"role": "user", "content": unique("What does the log say?")},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_log",
                    "type": "function",
                    "function": {"name": "read_log", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_log", "content": log},
    ]
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4.1", messages=history, extra_headers={"X-Memstrata-Budget": "1000000"}
    )
    conversation = raw.headers[HEADER]
    assert raw.parse().choices[0].message.content
    assert upstream.requests(CHAT)[-1]["body"]["messages"][-1]["content"] == log
    stored = wait_admin_messages(http, conversation, 4)
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["content"] == log
    found = http.get("/admin/search", params={"q": words[1], "conversation": conversation})
    assert found.status_code == 200, found.text
    assert found.json()["data"][0]["seq"] == 2


@pytest.mark.parametrize("keeps_partial", [True, False], ids=["partial-resent", "partial-dropped"])
def test_a_client_that_stops_a_stream_keeps_one_line_of_conversation(
    client: openai.OpenAI, http: httpx.Client, upstream: UpstreamServer, keeps_partial: bool
) -> None:
    """The user presses stop: the client closes the stream. The reply is stored as far as it
    was read, marked incomplete, and the gateway stops reading it; the next request, resending
    the partial reply as the client showed it or leaving it out, continues one line of
    conversation with each message once."""
    long_reply = " ".join(f"word{i}" for i in range(300))
    upstream.script({"reply": long_reply, "chunk_delay": 0.02})
    history: list[Any] = [{"role": "user", "content": unique("Tell me a long story.")}]
    raw = client.chat.completions.with_raw_response.create(model="m", messages=history, stream=True)
    conversation = raw.headers[HEADER]
    shown = ""
    with raw.parse() as stream:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                shown += chunk.choices[0].delta.content
            if len(shown) > 40:
                break
    [_, partial] = wait_admin_messages(http, conversation, 2)
    assert partial["status"] == "incomplete"
    assert partial["content"].startswith(shown)
    assert len(partial["content"]) < len(long_reply) / 2  # not read to the end
    if keeps_partial:
        history.append({"role": "assistant", "content": shown})
    history.append({"role": "user", "content": unique("Shorter, please.")})
    again = client.chat.completions.with_raw_response.create(model="m", messages=history)
    assert again.headers[HEADER] == conversation
    history.append({"role": "assistant", "content": again.parse().choices[0].message.content})
    branch = [m for m in admin_messages(http, conversation) if m["superseded_at"] is None]
    assert [(m["role"], m["content"]) for m in branch] == [
        (m["role"], m["content"]) for m in history
    ]
