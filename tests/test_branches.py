"""Histories as real clients shape them: re-serialized messages, retries, edits and
regenerations, end to end (raw HTTP and the `openai` SDK → the gateway process → the fake
upstream process).

Each test checks three places: how many conversations and stored messages the scenario left
(read from Postgres), which messages are on the current branch, and what the upstream received
(every prompt holds each message once, in a valid order). Conversations are told apart by a
unique system prompt per test. The gateway runs without background workers.
"""

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from memory.schema import DEFAULT_TENANT, conversations, nodes, tenants
from memory.write import chains

CHAT = "/v1/chat/completions"
HEADER = "X-Memstrata-Conversation"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add one to x",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]

Message = dict[str, Any]

pytestmark = pytest.mark.usefixtures("fresh_upstream")


def unique(text: str) -> str:
    return f"{text} [{uuid.uuid4().hex[:12]}]"


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as process:
        yield process


@pytest.fixture
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=15) as raw:
        yield raw


@pytest.fixture
def admin(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.root_url, timeout=15) as raw:
        yield raw


def send(http: httpx.Client, messages: list[Message], **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})
    return http.post(
        "/chat/completions", json={"model": "m", "messages": messages, **extra}, headers=headers
    )


# A question answered by a tool round, then a question answered in words.
TOOL_ROUND_THEN_A_TURN = ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]


def chat(http: httpx.Client, messages: list[Message], **extra: Any) -> httpx.Response:
    response = send(http, messages, **extra)
    assert response.status_code == 200, response.text
    return response


def answered(http: httpx.Client, system: str) -> list[Message]:
    """A new conversation: `system`, a question and its answer."""
    history = [{"role": "system", "content": system}, {"role": "user", "content": unique("q")}]
    history.append(reply_of(chat(http, history)))
    return history


def reply_of(response: httpx.Response) -> Message:
    message: Message = response.json()["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None or k == "content"}


async def stored(engine: AsyncEngine, system: str) -> dict[str, list[Message]]:
    """The messages of every conversation that opens with `system`, by conversation id."""
    query = (
        select(
            conversations.c.external_id,
            nodes.c.seq,
            nodes.c.role,
            nodes.c.content,
            nodes.c.tool_calls,
            nodes.c.superseded_at,
            nodes.c.follows_seq,
            nodes.c.model,
        )
        .join(conversations, conversations.c.id == nodes.c.conversation_id)
        .join(tenants, tenants.c.id == conversations.c.tenant_id)
        .where(tenants.c.name == DEFAULT_TENANT, nodes.c.level == 0)
        .order_by(conversations.c.id, nodes.c.seq)
    )
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).mappings().all()
    found: dict[str, list[Message]] = {}
    for row in rows:
        found.setdefault(row["external_id"], []).append(dict(row))
    return {
        conversation: messages
        for conversation, messages in found.items()
        if messages[0]["content"] == system
    }


def current(messages: list[Message]) -> list[tuple[str, Any]]:
    return [(m["role"], m["content"]) for m in messages if m["superseded_at"] is None]


def superseded(messages: list[Message]) -> list[tuple[str, Any]]:
    return [(m["role"], m["content"]) for m in messages if m["superseded_at"] is not None]


def valid_order(messages: list[Message]) -> bool:
    """An assistant message with tool calls is followed by exactly its tool results."""
    for index, message in enumerate(messages):
        calls = message.get("tool_calls") or []
        if message.get("role") == "assistant" and calls:
            results = messages[index + 1 : index + 1 + len(calls)]
            if sorted(r.get("tool_call_id") or "" for r in results) != sorted(
                c["id"] for c in calls
            ):
                return False
    return True


def sent_prompts(upstream: UpstreamServer) -> list[list[Message]]:
    return [request["body"]["messages"] for request in upstream.requests(CHAT)]


# -- canonical matching ----------------------------------------------------------------------


def test_the_same_message_however_it_is_serialized() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"x":1}'}}
    compact = {"role": "assistant", "content": None, "tool_calls": [call]}
    spaced = {
        "tool_calls": [
            {"function": {"arguments": '{"x": 1}', "name": "add"}, "id": "c1", "type": "function"}
        ],
        "content": "",
        "role": "assistant",
        "refusal": None,
    }
    assert chains.chain([compact]) == chains.chain([spaced])
    text = {"role": "user", "content": "hi\nthere"}
    parts = {"role": "user", "content": [{"type": "text", "text": "hi"}, "there"]}
    assert chains.chain([text]) == chains.chain([parts])
    other = {**compact, "tool_calls": [{**call, "function": {"name": "add", "arguments": "{}"}}]}
    assert chains.chain([compact]) != chains.chain([other])
    # Arguments that are not JSON are compared as written.
    broken = {**compact, "tool_calls": [{**call, "function": {"name": "add", "arguments": "{x"}}]}
    assert chains.chain([broken]) != chains.chain([compact])
    image = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "u"}}]
    assert chains.content_hash(image) != chains.content_hash("look")


def test_tool_arguments_alike_however_a_client_writes_their_numbers() -> None:
    """A JavaScript client (LangChain.js, the Vercel AI SDK) keeps a tool call's arguments
    parsed and writes them back with `JSON.stringify`: numbers as it reads them, doubles, with
    no fraction when they have none. The same call, however its numbers are written."""

    def calling(arguments: Any) -> Message:
        call = {"id": "c1", "type": "function", "function": {"name": "pay", "arguments": arguments}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    for upstream, client in [
        ('{"amount": 10.0}', '{"amount":10}'),
        ('{"n": 1e2, "m": 2.50E1}', '{"n":100,"m":25}'),
        ('{"x": [-0.0, 0.5]}', '{"x":[0,0.5]}'),
        ('{"id": 12345678901234567890}', '{"id":12345678901234567000}'),
        ('{"amount": 10.0}', {"amount": 10}),  # arguments sent as an object
    ]:
        assert chains.chain([calling(upstream)]) == chains.chain([calling(client)]), upstream
    for one, other in [
        ('{"amount": 10.5}', '{"amount": 10}'),
        ('{"flag": true}', '{"flag": 1}'),
        ('{"n": "1"}', '{"n": 1}'),
    ]:
        assert chains.chain([calling(one)]) != chains.chain([calling(other)]), one


def test_a_text_messages_hash_is_its_own_when_hashed_before() -> None:
    """Text messages keep their chain hash between turns (`chains._text_hash`); a message
    that differs from one hashed before in its role, name, content or tool call id alone still
    hashes differently, an empty name is no name, and tool calls are never left out."""
    said = {"role": "user", "content": "the lakes in june", "name": "ann"}
    first = chains.chain([said])
    assert chains.chain([dict(said)]) == first
    for change in (
        {"role": "assistant"},
        {"name": "bob"},
        {"name": None},
        {"content": "the lakes in july"},
        {"tool_call_id": "c1"},
        {"tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
    ):
        assert chains.chain([{**said, **change}]) != first, change
    assert chains.chain([{**said, "name": ""}]) == chains.chain([{**said, "name": None}])
    assert chains.chain([said], "parent") != first


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
async def test_tool_rounds_with_reserialized_arguments_stored_once(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer, named: bool
) -> None:
    """Three tool rounds whose arguments come back as `{"x": 1}` after the upstream wrote
    `{"x":1}`, and whose content comes back as "" after null: one conversation, each message
    stored once, every prompt the history as the client holds it."""
    system = unique("You call tools.")
    headers = {HEADER: f"tools-{uuid.uuid4().hex}"} if named else {}
    history: list[Message] = [
        {"role": "system", "content": system},
        {"role": "user", "content": unique("add three times")},
    ]
    for round_ in range(3):
        upstream.script({"tool_calls": [{"name": "add", "arguments": f'{{"x":{round_}}}'}]})
        message = reply_of(chat(http, history, tools=TOOLS, headers=headers))
        [call] = message["tool_calls"]
        assert call["function"]["arguments"] == f'{{"x":{round_}}}'
        call["function"]["arguments"] = json.dumps(json.loads(call["function"]["arguments"]))
        history.append({**message, "content": ""})
        history.append({"role": "tool", "tool_call_id": call["id"], "content": str(round_ + 1)})
    history.append(reply_of(chat(http, history, tools=TOOLS, headers=headers)))

    found = await stored(engine, system)
    assert len(found) == 1
    [messages] = found.values()
    assert len(messages) == len(history) == 9
    assert not superseded(messages)
    prompts = sent_prompts(upstream)
    assert [len(prompt) for prompt in prompts] == [2, 4, 6, 8]
    assert prompts[-1] == history[:-1]
    assert all(valid_order(prompt) for prompt in prompts)


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
async def test_tool_arguments_a_javascript_client_writes_again_are_stored_once(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer, named: bool
) -> None:
    """The upstream writes `{"x": 2.0}`; a JavaScript client resends the call as
    `JSON.stringify` writes it back, `{"x":2}`: still the stored reply, so nothing branches
    and nothing is stored twice."""
    system = unique("You call tools from JavaScript.")
    headers = {HEADER: f"js-tools-{uuid.uuid4().hex}"} if named else {}
    history: list[Message] = [
        {"role": "system", "content": system},
        {"role": "user", "content": unique("add one to two")},
    ]
    upstream.script({"tool_calls": [{"name": "add", "arguments": '{"x": 2.0}'}]})
    message = reply_of(chat(http, history, tools=TOOLS, headers=headers))
    [call] = message["tool_calls"]
    call["function"]["arguments"] = '{"x":2}'
    history.append(message)
    history.append({"role": "tool", "tool_call_id": call["id"], "content": "3"})
    history.append(reply_of(chat(http, history, tools=TOOLS, headers=headers)))
    history.append({"role": "user", "content": unique("thanks")})
    chat(http, history, tools=TOOLS, headers=headers)

    found = await stored(engine, system)
    assert len(found) == 1
    [messages] = found.values()
    assert not superseded(messages)
    assert [m["role"] for m in messages] == TOOL_ROUND_THEN_A_TURN


# -- retries ---------------------------------------------------------------------------------


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
async def test_a_retry_with_the_same_idempotency_key_is_stored_once(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer, named: bool
) -> None:
    system = unique("Retry me.")
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    if named:
        headers[HEADER] = f"retry-{uuid.uuid4().hex}"
    history = [{"role": "system", "content": system}, {"role": "user", "content": unique("q")}]
    upstream.script({"reply": "first answer"}, {"reply": "second answer"})
    assert reply_of(chat(http, history, headers=headers))["content"] == "first answer"
    # The client did not get the first answer (say it timed out) and retries.
    assert reply_of(chat(http, history, headers=headers))["content"] == "second answer"

    # The question is stored once; the answer the client got is the one on the branch, the
    # first kept off it.
    [messages] = (await stored(engine, system)).values()
    assert current(messages) == [
        *((m["role"], m["content"]) for m in history),
        ("assistant", "second answer"),
    ]
    assert superseded(messages) == [("assistant", "first answer")]
    assert [len(prompt) for prompt in sent_prompts(upstream)] == [2, 2]

    # The same answer again is not stored again.
    upstream.script({"reply": "second answer"})
    chat(http, history, headers=headers)
    assert [len(messages) for messages in (await stored(engine, system)).values()] == [4]


def streamed(http: httpx.Client, messages: list[Message], headers: dict[str, str]) -> bytes:
    body = {"model": "m", "messages": messages, "stream": True}
    with http.stream("POST", "/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200
        return b"".join(response.iter_bytes())


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
async def test_a_retry_after_a_cut_stream_keeps_the_whole_answer(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer, named: bool
) -> None:
    """The stream of the first answer is cut (its part is kept, marked incomplete); the client
    retries the request and gets the whole answer: that answer is the one memory keeps on
    the current branch, the cut one superseded (the retry's answer was dropped, the first one
    taken as given, and the next turn's prompt went on from the cut answer)."""
    system = unique("Cut, then retried.")
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    if named:
        headers[HEADER] = f"cut-retry-{uuid.uuid4().hex}"
    history = [{"role": "system", "content": system}, {"role": "user", "content": unique("q")}]
    whole = "one two three four five six"
    upstream.script({"reply": whole, "cut_after": 2}, {"reply": whole})
    assert b"upstream_stream_interrupted" in streamed(http, history, headers)
    assert b"[DONE]" in streamed(http, history, headers)  # the retry

    [messages] = (await stored(engine, system)).values()
    assert current(messages) == [
        *((m["role"], m["content"]) for m in history),
        ("assistant", whole),
    ]
    assert superseded(messages) == [("assistant", "one two")]
    follow = {"role": "user", "content": unique("and then?")}
    sent = [follow] if named else [*history, {"role": "assistant", "content": whole}, follow]
    chat(http, sent, headers={HEADER: headers[HEADER]} if named else {})
    assert [(m["role"], m["content"]) for m in sent_prompts(upstream)[-1]] == [
        *((m["role"], m["content"]) for m in history),
        ("assistant", whole),
        ("user", follow["content"]),
    ]


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
async def test_concurrent_duplicates_are_stored_once(
    gateway: GatewayProcess, engine: AsyncEngine, upstream: UpstreamServer, named: bool
) -> None:
    """The same request sent twice at once (the second while the first is upstream)."""
    system = unique("Concurrent twins.")
    headers = {"Idempotency-Key": uuid.uuid4().hex}
    if named:
        headers[HEADER] = f"twins-{uuid.uuid4().hex}"
    history = [{"role": "system", "content": system}, {"role": "user", "content": unique("q")}]
    upstream.set_default({"delay": 0.3})
    async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as client:
        body = {"model": "m", "messages": history}
        answers = await asyncio.gather(
            client.post(CHAT.removeprefix("/v1"), json=body, headers=headers),
            client.post(CHAT.removeprefix("/v1"), json=body, headers=headers),
        )
    assert [answer.status_code for answer in answers] == [200, 200]
    found = await stored(engine, system)
    assert len(found) == 1
    [messages] = found.values()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert len(upstream.requests(CHAT)) == 2


async def test_clients_sharing_a_system_prompt_all_get_their_answers(
    gateway: GatewayProcess, engine: AsyncEngine
) -> None:
    """Many clients with one system prompt, each resending its whole history turn after turn
    at once (no conversation id): every request is answered, each client has one conversation.
    A request that looked at another client's conversation (it holds the same system message)
    and found it did not belong there used to keep it locked while waiting for the lock that
    starts conversations, and deadlocked with the request holding that lock."""
    system = unique("Shared system prompt.")
    clients, turns = 48, 4

    async def client_turns(client: httpx.AsyncClient) -> list[int]:
        history: list[Message] = [{"role": "system", "content": system}]
        codes = []
        for turn in range(turns):
            history.append({"role": "user", "content": unique(f"turn {turn}")})
            response = await client.post(
                CHAT.removeprefix("/v1"), json={"model": "m", "messages": history}
            )
            codes.append(response.status_code)
            if response.status_code != 200:
                break
            history.append(reply_of(response))
        return codes

    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as client:
        codes = await asyncio.gather(*(client_turns(client) for _ in range(clients)))
    assert codes == [[200] * turns] * clients
    found = await stored(engine, system)
    assert len(found) == clients
    assert all(len(messages) == 1 + 2 * turns for messages in found.values())


async def test_a_new_chat_does_not_wait_for_a_turn_that_shares_only_its_system_prompt(
    gateway: GatewayProcess, engine: AsyncEngine
) -> None:
    """A new chat holds the system prompt of every other chat that opens with it, but can
    belong to none of them: it is answered while another such conversation is locked by a
    turn in flight (it used to lock the latest of them and wait for that turn)."""
    system = unique("Shared by busy conversations.")
    busy: list[Message] = [{"role": "system", "content": system}]
    busy.append({"role": "user", "content": unique("a long turn")})
    async with httpx.AsyncClient(base_url=gateway.url, timeout=15) as client:
        response = await client.post(
            CHAT.removeprefix("/v1"), json={"model": "m", "messages": busy}
        )
        assert response.status_code == 200
        async with engine.begin() as held:  # the busy conversation's turn, still in flight
            await held.execute(
                select(conversations.c.id)
                .where(conversations.c.external_id == response.headers[HEADER])
                .with_for_update()
            )
            fresh = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
            response = await client.post(
                CHAT.removeprefix("/v1"), json={"model": "m", "messages": fresh}, timeout=5
            )
            assert response.status_code == 200
    assert len(await stored(engine, system)) == 2


async def test_an_answered_request_resent_without_a_key_is_stored_once(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    """Its question is stored once, and the answer the client got last is the one on the
    branch."""
    system = unique("Resend me.")
    history = [{"role": "system", "content": system}, {"role": "user", "content": unique("q")}]
    upstream.script({"reply": "first"}, {"reply": "second"})
    chat(http, history)
    chat(http, history)  # byte for byte the same request: a retry
    [messages] = (await stored(engine, system)).values()
    assert [(m["role"], m["content"]) for m in messages][1:] == [
        ("user", history[1]["content"]),
        ("assistant", "first"),
        ("assistant", "second"),
    ]
    assert current(messages)[1:] == [("user", history[1]["content"]), ("assistant", "second")]


async def test_the_openai_sdk_retries_are_stored_once(
    gateway: GatewayProcess, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    """The SDK retries a 500 after the gateway stored the user's message: one copy, one reply."""
    system = unique("SDK retries.")
    upstream.script({"status": 500}, {"reply": "after the retry"})
    with openai.OpenAI(base_url=gateway.url, api_key="sk-test", max_retries=2) as sdk:
        completion = sdk.chat.completions.create(
            model="m",
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": unique("q")},
            ],
            extra_headers={HEADER: f"sdk-{uuid.uuid4().hex}"},
        )
    assert completion.choices[0].message.content == "after the retry"
    [messages] = (await stored(engine, system)).values()
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert len(upstream.requests(CHAT)) == 2


async def test_only_new_messages_sent_twice_are_a_retry_only_when_the_client_says_so(
    http: httpx.Client, engine: AsyncEngine
) -> None:
    """A client that sends only its new messages may say "continue" twice on purpose; the SDK's
    retry of an answered request says it is one (`X-Stainless-Retry-Count`)."""
    system = unique("Only new messages.")
    headers = {HEADER: f"new-only-{uuid.uuid4().hex}"}
    opening = [{"role": "system", "content": system}, {"role": "user", "content": "start"}]
    chat(http, opening, headers=headers)
    turn = [{"role": "system", "content": system}, {"role": "user", "content": "continue"}]
    chat(http, turn, headers=headers)
    chat(http, turn, headers={**headers, "X-Stainless-Retry-Count": "1"})  # a retry
    chat(http, turn, headers={**headers, "X-Stainless-Retry-Count": "0"})  # meant twice
    [messages] = (await stored(engine, system)).values()
    assert [(m["role"], m["content"]) for m in messages][1:] == [
        ("user", "start"),
        ("assistant", "echo: start"),
        ("user", "continue"),
        ("assistant", "echo: continue"),
        ("user", "continue"),
        ("assistant", "echo: continue"),
    ]


async def test_tool_results_sent_twice_are_a_retry(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    """A client that sends only its new messages and sends the same tool results again (its
    retry after a lost answer, without a header saying so) is retrying: a call is answered
    once. Stored again, the results followed the answer, with no call before them, and every
    later prompt carried an order chat completions refuse."""
    system = unique("Results once.")
    headers = {HEADER: f"results-twice-{uuid.uuid4().hex}"}
    upstream.script({"tool_calls": [{"name": "add", "arguments": '{"x":1}'}]})
    opening = [{"role": "system", "content": system}, {"role": "user", "content": "add"}]
    [call] = reply_of(chat(http, opening, tools=TOOLS, headers=headers))["tool_calls"]
    results = [{"role": "tool", "tool_call_id": call["id"], "content": "2"}]
    first = reply_of(chat(http, results, tools=TOOLS, headers=headers))
    again = reply_of(chat(http, results, tools=TOOLS, headers=headers))
    assert again["content"] == first["content"]
    chat(http, [{"role": "user", "content": "thanks"}], tools=TOOLS, headers=headers)
    [messages] = (await stored(engine, system)).values()
    assert [m["role"] for m in messages if not m.get("superseded_at")] == TOOL_ROUND_THEN_A_TURN
    assert valid_order(sent_prompts(upstream)[-1])


@pytest.mark.parametrize(
    ("named", "with_system"),
    [(True, False), (True, True), (False, True)],
    ids=["header-new-only", "header-resent", "no-header"],
)
async def test_a_question_resent_before_the_results_of_its_calls_is_stored_once(
    http: httpx.Client,
    engine: AsyncEngine,
    upstream: UpstreamServer,
    named: bool,
    with_system: bool,
) -> None:
    """A client that names its conversation and sends the messages the conversation lacks
    (the Vercel AI SDK's `conversation` option in a tool loop) sends the step's question again
    with the results of the calls it drew. The results must follow their call, so a question
    between them is not new: it is the one the call answers. Stored again, it sat between the
    call and its results in every later prompt, an order chat completions refuse. A history
    resent without the call branched the call away, and sent its results without it."""
    system = unique("You call tools.")
    headers = {HEADER: f"resent-question-{uuid.uuid4().hex}"} if named else {}
    question = {"role": "user", "content": unique("add it up")}
    upstream.script(
        {"tool_calls": [{"name": "add", "arguments": '{"x":1}'}]},
        {"tool_calls": [{"name": "add", "arguments": '{"x":2}'}]},
    )
    [call] = reply_of(
        chat(http, [{"role": "system", "content": system}, question], tools=TOOLS, headers=headers)
    )["tool_calls"]
    result = {"role": "tool", "tool_call_id": call["id"], "content": "2"}
    opening = [{"role": "system", "content": system}] if with_system else []
    [second] = reply_of(chat(http, [*opening, question, result], tools=TOOLS, headers=headers))[
        "tool_calls"
    ]
    # A second step: the results of both calls, without either call.
    again = {"role": "tool", "tool_call_id": second["id"], "content": "3"}
    chat(http, [*opening, question, result, again], tools=TOOLS, headers=headers)
    [messages] = (await stored(engine, system)).values()
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", system),
        ("user", question["content"]),
        ("assistant", None),
        ("tool", "2"),
        ("assistant", None),
        ("tool", "3"),
        ("assistant", "echo: " + question["content"]),
    ]
    assert not superseded(messages)
    prompt = sent_prompts(upstream)[-1]
    assert [m["role"] for m in prompt][-5:] == ["user", "assistant", "tool", "assistant", "tool"]
    assert valid_order(prompt)
    if named and not with_system:
        # The same new messages again (the answer lost, no retry header) are a retry.
        chat(http, [question, result, again], tools=TOOLS, headers=headers)
        [messages] = (await stored(engine, system)).values()
        assert [m["role"] for m in messages if not m["superseded_at"]] == [
            "system",
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
        ]
    if named:
        # A question asked again after the answer is a new turn, as it always was.
        chat(http, [question], tools=TOOLS, headers=headers)
        [messages] = (await stored(engine, system)).values()
        current = [m["role"] for m in messages if not m["superseded_at"]]
        assert current[-2:] == ["user", "assistant"] and len(current) == 9


# -- branches --------------------------------------------------------------------------------


async def test_regenerating_the_last_answer_branches(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    system = unique("Regenerate.")
    opening = [{"role": "system", "content": system}, {"role": "user", "content": unique("q")}]
    upstream.script({"reply": "A1"}, {"reply": "A1 again"}, {"reply": "A2"})
    chat(http, opening, temperature=0.2)
    # Regenerate: the same history, asked again (a new request: another temperature).
    again = reply_of(chat(http, opening, temperature=0.9))
    assert again["content"] == "A1 again"
    follow = unique("and then?")
    history = [*opening, again, {"role": "user", "content": follow}]
    chat(http, history, temperature=0.9)

    found = await stored(engine, system)
    assert len(found) == 1
    [messages] = found.values()
    assert current(messages) == [
        *((m["role"], m["content"]) for m in opening),
        ("assistant", "A1 again"),
        ("user", follow),
        ("assistant", "A2"),
    ]
    assert superseded(messages) == [("assistant", "A1")]
    assert len(messages) == 6
    assert sent_prompts(upstream)[-1] == history


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
async def test_editing_an_earlier_user_message_branches(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer, named: bool
) -> None:
    system = unique("Edit.")
    headers = {HEADER: f"edit-{uuid.uuid4().hex}"} if named else {}
    history: list[Message] = [{"role": "system", "content": system}]
    for turn in range(3):
        history.append({"role": "user", "content": unique(f"question {turn}")})
        history.append(reply_of(chat(http, history, headers=headers)))
    # The user edits question 1: everything after it is another branch.
    edited = [*history[:3], {"role": "user", "content": unique("question 1, edited")}]
    edited.append(reply_of(chat(http, edited, headers=headers)))
    edited.append({"role": "user", "content": unique("question 2 on the new branch")})
    chat(http, edited, headers=headers)

    found = await stored(engine, system)
    assert len(found) == 1
    [messages] = found.values()
    assert len(messages) == len(history) + 4
    assert current(messages)[: len(edited)] == [(m["role"], m["content"]) for m in edited]
    assert superseded(messages) == [(m["role"], m["content"]) for m in history[3:]]
    assert sent_prompts(upstream)[-1] == edited
    # The edit follows the first answer, not the message stored before it.
    first_edit = next(m for m in messages if m["content"] == edited[3]["content"])
    assert first_edit["follows_seq"] == 2


async def test_dropping_a_failed_turn_and_rephrasing_branches(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    system = unique("Rephrase.")
    history = answered(http, system)
    failed = [*history, {"role": "user", "content": unique("this one fails")}]
    upstream.script({"status": 500})
    assert send(http, failed).status_code == 500
    rephrased = [*history, {"role": "user", "content": unique("said otherwise")}]
    chat(http, rephrased)

    [messages] = (await stored(engine, system)).values()
    assert superseded(messages) == [("user", failed[-1]["content"])]
    assert current(messages)[:4] == [(m["role"], m["content"]) for m in rephrased]
    assert sent_prompts(upstream)[-1] == rephrased


async def test_going_back_to_an_abandoned_branch_restores_it(
    http: httpx.Client, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    system = unique("Back and forth.")
    history = answered(http, system)
    branch_a = [*history, {"role": "user", "content": unique("branch a")}]
    branch_a.append(reply_of(chat(http, branch_a)))
    branch_b = [*history, {"role": "user", "content": unique("branch b")}]
    chat(http, branch_b)
    # Back on branch a, which goes on.
    branch_a.append({"role": "user", "content": unique("a goes on")})
    chat(http, branch_a)

    [messages] = (await stored(engine, system)).values()
    assert len(messages) == 3 + 2 + 2 + 2  # nothing of branch a stored twice
    assert current(messages)[: len(branch_a)] == [(m["role"], m["content"]) for m in branch_a]
    assert superseded(messages)[0] == ("user", branch_b[-1]["content"])


@pytest.mark.parametrize("named", [False, True], ids=["no-header", "header"])
@pytest.mark.parametrize("context", ["system", "user", "in-the-question"])
async def test_context_sent_with_each_question_only_keeps_one_conversation(
    http: httpx.Client,
    engine: AsyncEngine,
    upstream: UpstreamServer,
    context: str,
    named: bool,
) -> None:
    """A client that sends retrieved context with its newest question only: as a message of
    its own right before it, or written into it, and resends its history without it. Each
    history leaves the stored path at its first rewritten message, but ends with the gateway's
    last reply: one conversation, whose current branch is each time what the client sent (it
    was a new conversation holding the whole history each turn; with a conversation id, the
    whole history appended after the head)."""
    system = unique("Answer from the context.")
    headers = {HEADER: f"context-{uuid.uuid4().hex}"} if named else {}
    history: list[Message] = [{"role": "system", "content": system}]
    for turn in range(4):
        question = unique(f"question {turn}")
        found = {"role": "system" if context == "system" else "user", "content": f"doc {turn}"}
        if context == "in-the-question":
            sent = [*history, {"role": "user", "content": f"doc {turn}\n\n{question}"}]
        else:
            sent = [*history, found, {"role": "user", "content": question}]
        answer = reply_of(chat(http, sent, headers=headers))
        assert sent_prompts(upstream)[-1] == sent
        history += [{"role": "user", "content": question}, answer]

    conversations_ = await stored(engine, system)
    assert len(conversations_) == 1
    [messages] = conversations_.values()
    assert current(messages) == [(m["role"], m["content"]) for m in [*sent, answer]]
    # Each turn stores the previous question and answer again, as the client now sends them.
    assert len(messages) <= len(sent) + 1 + 3 * 3


async def test_a_chat_that_shares_only_a_reply_with_another_is_not_taken_for_it(
    http: httpx.Client, engine: AsyncEngine
) -> None:
    """A history whose last assistant message is another conversation's latest reply, but
    that opens otherwise, is a new conversation: the other one's branch stays."""
    system = unique("One chat.")
    first = answered(http, system)
    other = unique("Another chat.")
    chat(
        http,
        [
            {"role": "system", "content": other},
            {"role": "user", "content": unique("q")},
            first[-1],
            {"role": "user", "content": unique("and?")},
        ],
    )
    [messages] = (await stored(engine, system)).values()
    assert current(messages) == [(m["role"], m["content"]) for m in first]
    assert len(await stored(engine, other)) == 1


async def test_a_new_chat_that_opens_like_an_old_one_is_a_new_conversation(
    http: httpx.Client, engine: AsyncEngine
) -> None:
    system = unique("Shared opening.")
    old: list[Message] = [{"role": "system", "content": system}]
    for turn in range(2):
        old.append({"role": "user", "content": unique(f"old {turn}")})
        old.append(reply_of(chat(http, old)))
    chat(http, [{"role": "system", "content": system}, {"role": "user", "content": "hi"}])
    found = await stored(engine, system)
    assert len(found) == 2
    assert all(not superseded(messages) for messages in found.values())


def test_the_admin_api_shows_branches(
    http: httpx.Client, admin: httpx.Client, upstream: UpstreamServer
) -> None:
    conversation = f"admin-{uuid.uuid4().hex}"
    headers = {HEADER: conversation}
    opening = [{"role": "user", "content": unique("q")}]
    upstream.script({"reply": "quartzite answer"}, {"reply": "basalt answer"})
    chat(http, opening, headers=headers)
    chat(http, opening, headers=headers, temperature=1.0)  # regenerated

    listed = admin.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    assert [(m["seq"], m["follows_seq"], m["superseded_at"] is not None) for m in listed] == [
        (0, -1, False),
        (1, 0, True),
        (2, 0, False),
    ]
    assert [m["model"] for m in listed] == [None, "m", "m"]
    tree = admin.get(f"/admin/conversations/{conversation}/hierarchy").json()
    assert tree["branches"] == [
        {"first_seq": 0, "last_seq": 0, "follows_seq": -1, "superseded": False},
        {"first_seq": 1, "last_seq": 1, "follows_seq": 0, "superseded": True},
        {"first_seq": 2, "last_seq": 2, "follows_seq": 0, "superseded": False},
    ]
    exported = admin.get(f"/admin/conversations/{conversation}/export").text.splitlines()
    assert [json.loads(line)["content"] for line in exported] == [
        opening[0]["content"],
        "basalt answer",
    ]
    params = {"q": "quartzite", "conversation": conversation}
    found = admin.get("/admin/search", params=params).json()
    assert any(hit["seq"] == 1 for hit in found["data"])


def test_a_rebuilt_prompt_holds_the_current_branch_only(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    """With a budget too small for the history, the prompt is rebuilt from memory: neither its
    recent turns nor what it recalls come from the abandoned branch."""
    conversation = f"rebuilt-{uuid.uuid4().hex}"
    headers = {HEADER: conversation}
    marker = "zanzibarite"
    history: list[Message] = [{"role": "user", "content": unique(f"tell me about {marker}")}]
    upstream.script({"reply": f"{marker} is a mineral, abandoned answer"})
    history.append(reply_of(chat(http, history, headers=headers)))
    history = history[:1]
    history.append(reply_of(chat(http, history, headers=headers, temperature=1.0)))
    for turn in range(6):
        history.append({"role": "user", "content": unique(f"{marker} filler {turn} " * 20)})
        history.append(reply_of(chat(http, history, headers=headers)))
    history.append({"role": "user", "content": unique(f"what was {marker}?")})
    chat(http, history, headers={**headers, "X-Memstrata-Budget": "400"})
    prompt = json.dumps(sent_prompts(upstream)[-1])
    assert "abandoned answer" not in prompt
    assert upstream.requests(CHAT)[-1]["body"]["messages"] != history  # rebuilt
