"""End to end: the Responses API through the real `openai` SDK → a gateway process → the fake
upstream process, on both ways upstream: forwarded as Responses (an upstream that serves them)
and translated to chat completions (an upstream without them, learnt by `auto` from its 404).

Each test checks what the client received, what the upstream received, and what Postgres holds
(the admin API). Conversations are told apart by unique text.
"""

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import FunctionToolParam, Response

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer

CLIENT_KEY = "sk-client-responses-0123456789"
HEADER = "X-Memstrata-Conversation"
TOOLS: list[FunctionToolParam] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]


def unique(text: str) -> str:
    return f"{text} {uuid.uuid4().hex[:10]}"


class Way:
    """One way upstream: the fake upstream, a gateway in front of it, and where prompts land."""

    def __init__(self, name: str, upstream: UpstreamServer, gateway: GatewayProcess) -> None:
        self.name = name
        self.upstream = upstream
        self.gateway = gateway
        self.path = "/v1/responses" if name == "forward" else "/v1/chat/completions"

    def prompts(self) -> list[list[dict[str, Any]]]:
        """What each request upstream held as its prompt, chat messages or input items."""
        key = "input" if self.name == "forward" else "messages"
        prompts = [request["body"][key] for request in self.upstream.requests(self.path)]
        # An input sent as it came may be a string: one user message.
        return [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]


@pytest.fixture(scope="module")
def ways(database_url: str) -> Iterator[dict[str, Way]]:
    with (
        UpstreamServer(chunk_delay=0.002) as serving,
        UpstreamServer(chunk_delay=0.002, responses=False) as chat_only,
        GatewayProcess(
            database_url=database_url,
            upstream_url=serving.url,
            workers=0,
            upstream_responses="on",
        ) as forward,
        GatewayProcess(database_url=database_url, upstream_url=chat_only.url, workers=0) as auto,
    ):
        yield {
            "forward": Way("forward", serving, forward),
            "translate": Way("translate", chat_only, auto),
        }


@pytest.fixture(params=["forward", "translate"])
def way(request: pytest.FixtureRequest, ways: dict[str, Way]) -> Way:
    chosen = ways[request.param]
    chosen.upstream.reset()
    return chosen


@pytest.fixture
def client(way: Way) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=way.gateway.url, api_key=CLIENT_KEY, max_retries=0, timeout=15
    ) as sdk:
        yield sdk


@pytest.fixture
def http(way: Way) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=way.gateway.root_url, timeout=15) as raw:
        yield raw


def stored(http: httpx.Client, conversation: str, count: int | None = None) -> list[Any]:
    """The stored messages as (role, content) pairs (waiting for `count` of them)."""
    deadline = time.monotonic() + 5
    while True:
        response = http.get(f"/admin/conversations/{conversation}/messages")
        assert response.status_code == 200, response.text
        messages = response.json()["messages"]
        if count is None or len(messages) >= count or time.monotonic() > deadline:
            return [(m["role"], m["content"]) for m in messages]
        time.sleep(0.02)


def streamed_text(stream: Any) -> tuple[str, Any]:
    """The text of a Responses stream and its final response."""
    pieces: list[str] = []
    final = None
    for event in stream:
        if event.type == "response.output_text.delta":
            pieces.append(event.delta)
        elif event.type == "response.completed":
            final = event.response
    return "".join(pieces), final


@pytest.mark.parametrize("stream", [False, True])
def test_five_turns_through_previous_response_id(
    way: Way, client: openai.OpenAI, http: httpx.Client, stream: bool
) -> None:
    texts = [unique(f"turn {n} of five") for n in range(5)]
    previous: str | None = None
    ids: list[str] = []
    conversation = None
    for text in texts:
        extra: dict[str, Any] = {"previous_response_id": previous} if previous else {}
        raw = client.responses.with_raw_response.create(
            model="gpt-4o-mini", input=text, instructions="Be brief.", stream=stream, **extra
        )
        conversation = conversation or raw.headers[HEADER]
        assert raw.headers[HEADER] == conversation
        if stream:
            answer, final = streamed_text(raw.parse())
            assert final is not None and final.output_text == answer
            response_id = final.id
        else:
            parsed = raw.parse()
            assert isinstance(parsed, Response)
            answer, response_id = parsed.output_text, parsed.id
        assert answer == f"echo: {text}"
        ids.append(response_id)
        previous = response_id
        stored(http, conversation, 1 + 2 * len(ids))  # the reply of a stream is stored as it ends

    assert conversation is not None
    replies = [("assistant", f"echo: {text}") for text in texts]
    history = [m for pair in zip([("user", t) for t in texts], replies, strict=True) for m in pair]
    assert stored(http, conversation) == [("system", "Be brief."), *history]

    # The upstream got the whole history each time (it stores nothing itself), once each.
    prompts = way.prompts()
    assert len(prompts) == 5
    for turn, prompt in enumerate(prompts):
        as_pairs = [(m["role"], m["content"]) for m in prompt]
        if way.name == "forward":
            assert as_pairs == history[: 2 * turn + 1]  # instructions go as `instructions`
        else:
            assert as_pairs == [("system", "Be brief."), *history[: 2 * turn + 1]]
    if way.name == "forward":
        requests = way.upstream.requests(way.path)
        assert all("previous_response_id" not in r["body"] for r in requests)
        assert all(r["body"]["instructions"] == "Be brief." for r in requests)

    # Read back from what is stored.
    for response_id, text in zip(ids, texts, strict=True):
        again = client.responses.retrieve(response_id)
        assert again.id == response_id
        assert again.output_text == f"echo: {text}"
    items = list(client.responses.input_items.list(ids[-1]))
    assert len(items) == 1
    assert items[0].type == "message" and items[0].role == "user"
    assert items[0].content[0].text == texts[-1]  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_the_upstreams_usage_is_stored_cached_tokens_included(
    way: Way, client: openai.OpenAI, http: httpx.Client, stream: bool
) -> None:
    """Each turn's usage, as the client was shown it, adds up in the conversation's statistics:
    input, output and cached tokens (each prompt repeats the last, which the fake caches)."""
    previous: str | None = None
    shown: list[Any] = []
    conversation = ""
    for n in range(3):
        extra: dict[str, Any] = {"previous_response_id": previous} if previous else {}
        raw = client.responses.with_raw_response.create(
            model="gpt-4o-mini",
            input=unique(f"usage turn {n}"),
            instructions="Be brief.",
            stream=stream,
            **extra,
        )
        conversation = raw.headers[HEADER]
        final = streamed_text(raw.parse())[1] if stream else raw.parse()
        assert isinstance(final, Response) and final.usage is not None
        shown.append(final.usage)
        previous = final.id
        stored(http, conversation, 3 + 2 * n)
    assert sum(u.input_tokens_details.cached_tokens for u in shown) > 0
    stats = http.get(f"/admin/conversations/{conversation}").json()
    assert {key: stats[key] for key in ("requests", "tokens_cached")} == {
        "requests": 3,
        "tokens_cached": sum(u.input_tokens_details.cached_tokens for u in shown),
    }
    assert stats["upstream_prompt_tokens"] == sum(u.input_tokens for u in shown)
    assert stats["upstream_completion_tokens"] == sum(u.output_tokens for u in shown)


def test_a_working_context_names_no_memory_tool_where_none_is_offered(
    way: Way, client: openai.OpenAI
) -> None:
    """A client that lets the model call no tool (`tool_choice: none`) is not offered the
    memory tools: a conversation past its budget is sent its working context without the hints
    stable memory holds for them ("memory_browse … reads them", "memory_expand opens a
    [#id]"), which would point the model at tools it cannot call."""
    previous: str | None = None
    for n in range(12):
        extra: dict[str, Any] = {"previous_response_id": previous} if previous else {}
        previous = client.responses.create(
            model="gpt-4o-mini",
            input=unique(f"turn {n}: " + "a long and winding story of the harbour " * 12),
            tool_choice="none",
            extra_headers={"X-Memstrata-Budget": "1000"},
            **extra,
        ).id
    prompts = [json.dumps(prompt) for prompt in way.prompts()]
    assert any("[Memory" in prompt for prompt in prompts)  # past the budget: stable memory
    assert not any("memory_" in prompt for prompt in prompts)


def test_whole_input_resent_is_stored_once(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    first = unique("what is the weather")
    history: list[Any] = [{"role": "user", "content": first}]
    raw = client.responses.with_raw_response.create(model="gpt-4o-mini", input=history)
    conversation = raw.headers[HEADER]
    reply = raw.parse()
    # As openai-agents does: the output items go back as input, with the next message.
    history += [item.model_dump(exclude_none=True) for item in reply.output]
    second = unique("and tomorrow")
    history.append({"role": "user", "content": second})
    again = client.responses.with_raw_response.create(model="gpt-4o-mini", input=history)
    assert again.headers[HEADER] == conversation
    assert stored(http, conversation) == [
        ("user", first),
        ("assistant", f"echo: {first}"),
        ("user", second),
        ("assistant", f"echo: {second}"),
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_resent_as_an_item_reference_is_the_stored_reply(
    way: Way, client: openai.OpenAI, http: httpx.Client, stream: bool
) -> None:
    """The Vercel AI SDK's Responses provider (`store` on, its default) sends an earlier reply
    back as `{"type": "item_reference", "id": ...}`, the id of the output item this gateway
    answered, with the text and tool calls around it inline. Refused with 400 before, so every
    such chat failed on its second request: the item is now read from the stored response."""
    first = unique("what is the weather")
    way.upstream.script(
        {
            "reply": "Let me look.",
            "tool_calls": [{"name": "weather", "arguments": {"city": "Oslo"}}],
            "path": way.path,  # not a fresh gateway's probe of the Responses API
        }
    )
    weather: FunctionToolParam = {
        "type": "function",
        "name": "weather",
        "parameters": {"type": "object", "properties": {}},
        "strict": False,
    }
    raw = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input=first, tools=[weather]
    )
    conversation, made = raw.headers[HEADER], raw.parse()
    said, call = made.output[0], made.output[1]
    assert said.type == "message" and call.type == "function_call"
    second = unique("and tomorrow")
    history: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": first}]},
        {"type": "item_reference", "id": said.id},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": "weather",
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        {"role": "user", "content": second},
    ]
    answer = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input=history, tools=[weather], stream=stream
    )
    assert answer.headers[HEADER] == conversation
    if stream:
        assert streamed_text(answer.parse())[0] == f"echo: {second}"
    assert stored(http, conversation, 5) == [
        ("user", first),
        ("assistant", "Let me look."),
        ("tool", "sunny"),
        ("user", second),
        ("assistant", f"echo: {second}"),
    ]
    # Translated, the upstream gets the reply's text; an upstream serving the Responses API
    # gets the stored item in place of its reference (before, the reference, which only an
    # upstream keeping that response could read).
    sent = way.prompts()[-1]
    if way.name == "forward":
        assert sent == [history[0], said.model_dump(exclude_none=True), *history[2:]]
    else:
        assert {"role": "assistant", "content": "Let me look."} in [
            {key: m.get(key) for key in ("role", "content")} for m in sent
        ]
    # An id no stored response of the tenant holds cannot be read: 400, nothing stored.
    before = way.upstream.requests()
    gone = unique("never stored")
    refused = http.post(
        "/v1/responses",
        json={
            "model": "gpt-4o-mini",
            "input": [
                *history[:1],
                {"type": "item_reference", "id": "msg_nope"},
                {"role": "user", "content": gone},
            ],
        },
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "input[1].id" and "msg_nope" in refused.text
    assert way.upstream.requests() == before
    assert http.get("/admin/search", params={"q": gone}).json()["data"] == []


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_round_trip(
    way: Way, client: openai.OpenAI, http: httpx.Client, stream: bool
) -> None:
    way.upstream.script(
        {
            "path": way.path,  # not the probe of a gateway that has not learnt its upstream yet
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_7"}],
        }
    )
    question = unique("weather in Paris")
    raw = client.responses.with_raw_response.create(
        model="gpt-4o-mini",
        input=question,
        tools=TOOLS,
        stream=stream,
    )
    conversation = raw.headers[HEADER]
    if stream:
        _, first = streamed_text(raw.parse())
    else:
        first = raw.parse()
    [call] = first.output
    assert call.type == "function_call"
    assert (call.name, call.call_id, call.arguments) == (
        "get_weather",
        "call_7",
        '{"city": "Paris"}',
    )
    stored(http, conversation, 2)
    followup = client.responses.create(
        model="gpt-4o-mini",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": "call_7", "output": "sunny"}],
        tools=TOOLS,
    )
    assert followup.output_text == "echo: " + question
    messages = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"] == [
        {
            "id": "call_7",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert (messages[2]["tool_call_id"], messages[2]["content"]) == ("call_7", "sunny")
    last = way.prompts()[-1]
    if way.name == "forward":
        assert [item.get("type", "message") for item in last] == [
            "message",
            "function_call",
            "function_call_output",
        ]
    else:
        assert [m["role"] for m in last] == ["user", "assistant", "tool"]
        tools = way.upstream.requests(way.path)[-1]["body"]["tools"]
        assert tools[0]["function"]["name"] == "get_weather"


def test_store_false_keeps_nothing(way: Way, client: openai.OpenAI, http: httpx.Client) -> None:
    text = unique("remember me")
    kept = client.responses.with_raw_response.create(model="gpt-4o-mini", input=text)
    conversation = kept.headers[HEADER]
    first = kept.parse()
    secret = unique("do not keep this")
    unstored = client.responses.create(
        model="gpt-4o-mini", input=secret, previous_response_id=first.id, store=False
    )
    assert unstored.output_text == f"echo: {secret}"
    # It read the history it continued, and stored nothing of its own.
    first_sent = way.prompts()[-1][0]
    assert (first_sent["role"], first_sent["content"]) == ("user", text)
    assert stored(http, conversation) == [("user", text), ("assistant", f"echo: {text}")]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-4o-mini", input="x", previous_response_id=unstored.id)


def test_unknown_previous_response_is_404_and_stores_nothing(
    way: Way, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="gpt-4o-mini", input="hi", previous_response_id="resp_nope")
    assert "resp_nope" in missing.value.message
    assert way.upstream.requests() == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": "x", "stream": "yes"}, "stream"),
        ({"model": "", "input": "x"}, "model"),
    ],
)
def test_bad_requests_are_400_and_store_nothing(
    way: Way, http: httpx.Client, body: dict[str, Any], param: str
) -> None:
    response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert way.upstream.requests() == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"tools": 5}, "tools"),  # was a 500
    ],
)
def test_what_chat_completions_cannot_carry_is_400_before_anything_is_stored(
    ways: dict[str, Way], extra: dict[str, Any], param: str
) -> None:
    """With an upstream known not to serve the Responses API, a built-in tool cannot be
    translated: refused with 400, as it was, but only after the input had been stored (and
    `tools` that are not a list were a 500)."""
    way = ways["translate"]
    with httpx.Client(base_url=way.gateway.root_url, timeout=15) as http:
        # Once the gateway has learnt that the upstream has no Responses API.
        assert http.post("/v1/responses", json={"model": "m", "input": "probe"}).is_success
        way.upstream.reset()
        conversation = f"builtin-{uuid.uuid4().hex[:10]}"
        response = http.post(
            "/v1/responses",
            json={"model": "m", "input": unique("search the web"), **extra},
            headers={HEADER: conversation},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        missing = http.get(f"/admin/conversations/{conversation}/messages")
        assert missing.status_code == 404, missing.text
    assert way.upstream.requests() == []


def test_upstream_errors_are_relayed(way: Way, client: openai.OpenAI) -> None:
    way.upstream.script({"path": way.path, "status": 429, "headers": {"Retry-After": "7"}})
    with pytest.raises(openai.RateLimitError) as limited:
        client.responses.create(model="gpt-4o-mini", input=unique("too fast"))
    assert limited.value.response.headers["retry-after"] == "7"
    assert limited.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]


def test_a_cut_stream_keeps_the_partial_reply(way: Way, http: httpx.Client) -> None:
    way.upstream.script({"path": way.path, "cut_after": 2})
    text = unique("one two three four five")
    with http.stream(
        "POST", "/v1/responses", json={"model": "m", "input": text, "stream": True}
    ) as response:
        conversation = response.headers[HEADER]
        body = b"".join(response.iter_bytes())
    assert b"upstream_stream_interrupted" in body
    messages = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    assert [(m["role"], m["status"]) for m in messages] == [
        ("user", "complete"),
        ("assistant", "incomplete"),
    ]
    assert f"echo: {text}".startswith(messages[1]["content"])


_OVERLOADED = {
    "error": {"message": "overloaded", "type": "server_error", "param": None, "code": None}
}


@pytest.mark.parametrize(
    "ending", [[_OVERLOADED], []], ids=["an error event", "nothing: it stops short"]
)
def test_a_translated_stream_that_fails_is_not_completed(
    ways: dict[str, Way], ending: list[dict[str, Any]]
) -> None:
    """A chat stream that sends an error event and stops, or ends with neither a
    finish_reason nor `[DONE]`, is not a completed response (both were announced as
    `response.completed` and recorded complete): the client gets the error, and the partial
    reply and the response are kept as incomplete."""
    way = ways["translate"]
    way.upstream.reset()
    chunk = {
        "id": "chatcmpl-cut",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": "partial"},
                "finish_reason": None,
            }
        ],
    }
    sse = [json.dumps(event) for event in (chunk, *ending)]
    way.upstream.script({"path": way.path, "sse": sse})
    with httpx.Client(base_url=way.gateway.root_url, timeout=15) as http:
        with http.stream(
            "POST", "/v1/responses", json={"model": "m", "input": unique("hi"), "stream": True}
        ) as response:
            conversation = response.headers[HEADER]
            body = b"".join(response.iter_bytes()).decode()
        events = [line[7:] for line in body.splitlines() if line.startswith("event: ")]
        assert "response.completed" not in events, body
        if ending:  # the upstream's error, last
            assert events[-1] == "error", body
        else:  # the error a cut stream gets
            assert "upstream_stream_interrupted" in body, body
        created = json.loads(body.split("data: ", 1)[1].split("\n", 1)[0])
        kept = http.get(f"/v1/responses/{created['response']['id']}").json()
        assert kept["status"] == "incomplete", kept
        messages = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    assert [(m["role"], m["content"], m["status"]) for m in messages[1:]] == [
        ("assistant", "partial", "incomplete")
    ]


def test_auto_learns_once_that_the_upstream_has_no_responses(ways: dict[str, Way]) -> None:
    way = ways["translate"]
    with openai.OpenAI(base_url=way.gateway.url, api_key=CLIENT_KEY, max_retries=0) as sdk:
        sdk.responses.create(model="gpt-4o-mini", input=unique("probe"))  # learnt by now
        way.upstream.reset()
        for _ in range(2):
            sdk.responses.create(model="gpt-4o-mini", input=unique("probe"))
    assert way.upstream.requests("/v1/responses") == []
    assert len(way.upstream.requests("/v1/chat/completions")) == 2


def test_auto_probe_on_a_fresh_gateway(database_url: str) -> None:
    with (
        UpstreamServer(responses=False) as chat_only,
        GatewayProcess(database_url=database_url, upstream_url=chat_only.url, workers=0) as gw,
        openai.OpenAI(base_url=gw.url, api_key=CLIENT_KEY, max_retries=0) as sdk,
    ):
        answers = [sdk.responses.create(model="gpt-4o-mini", input=unique("probe")) for _ in "ab"]
        assert [a.output_text.startswith("echo: probe") for a in answers] == [True, True]
        assert [r["path"] for r in chat_only.requests()] == [
            "/v1/responses",
            "/v1/chat/completions",
            "/v1/chat/completions",
        ]


@pytest.mark.parametrize("responses", [False, True])
def test_a_fresh_gateways_first_request_with_a_built_in_tool(
    database_url: str, responses: bool
) -> None:
    """Auto mode, nothing learnt yet, a `web_search` tool: an upstream without the Responses API
    means a 400 with nothing stored (it was stored, then refused); one with it gets the request.
    Either is learnt from a request it must refuse, before the input is stored."""
    conversation = f"first-builtin-{uuid.uuid4().hex[:10]}"
    body = {"model": "m", "input": unique("search the web"), "tools": [{"type": "web_search"}]}
    with (
        UpstreamServer(responses=responses) as upstream,
        GatewayProcess(database_url=database_url, upstream_url=upstream.url, workers=0) as gw,
        httpx.Client(base_url=gw.root_url, timeout=15) as http,
    ):
        answer = http.post("/v1/responses", json=body, headers={HEADER: conversation})
        stored = http.get(f"/admin/conversations/{conversation}/messages")
        sent = [(r["path"], r["body"]) for r in upstream.requests()]
    if responses:
        assert answer.status_code == 200, answer.text
        assert [path for path, _ in sent] == ["/v1/responses"] * 2
        assert stored.status_code == 200
    else:
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "tools"
        assert stored.status_code == 404, stored.text
        assert len(sent) == 1
    assert sent[0] == ("/v1/responses", {})


def test_the_openai_sdk_retries_are_stored_once(way: Way, http: httpx.Client) -> None:
    """A client that names its conversation and sends only its new input: the SDK retries a 500
    after the gateway stored the user's message; the message is stored once (the chat path's
    retries are told apart the same way: `X-Stainless-Retry-Count`, `Idempotency-Key`)."""
    conversation = f"responses-retry-{uuid.uuid4().hex}"
    headers = {HEADER: conversation}
    first, second = unique("first question"), unique("second question")
    with openai.OpenAI(
        base_url=way.gateway.url, api_key=CLIENT_KEY, max_retries=2, timeout=15
    ) as sdk:
        sdk.responses.create(model="gpt-4o-mini", input=first, extra_headers=headers)
        way.upstream.script({"path": way.path, "status": 500})
        answer = sdk.responses.create(model="gpt-4o-mini", input=second, extra_headers=headers)
    assert answer.output_text == f"echo: {second}"
    assert stored(http, conversation) == [
        ("user", first),
        ("assistant", f"echo: {first}"),
        ("user", second),
        ("assistant", f"echo: {second}"),
    ]


def test_continuing_the_latest_response_with_its_opening_words_is_a_new_turn(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    """`previous_response_id` naming the latest response says the input is new: asked the
    same thing again, the conversation goes on (it was taken for a regeneration of the first
    answer: that answer left the current branch and the upstream never saw it)."""
    ask = unique("tell me a joke")
    raw = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input=ask, instructions="Be funny."
    )
    conversation = raw.headers[HEADER]
    again = client.responses.create(
        model="gpt-4o-mini",
        input=ask,
        instructions="Be funny.",
        previous_response_id=raw.parse().id,
    )
    assert again.output_text == f"echo: {ask}"
    messages = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    assert [(m["role"], m["content"], m["superseded_at"]) for m in messages] == [
        ("system", "Be funny.", None),
        ("user", ask, None),
        ("assistant", f"echo: {ask}", None),
        ("user", ask, None),
        ("assistant", f"echo: {ask}", None),
    ]
    last = [(m.get("role"), m.get("content")) for m in way.prompts()[-1]]
    assert last[-3:] == [("user", ask), ("assistant", f"echo: {ask}"), ("user", ask)]


def forked(client: openai.OpenAI) -> tuple[list[str], str, str]:
    """A conversation that forked: questions 0 and 1 answered, then question 2 asked after 0
    (its answer the conversation's latest). The four questions (the last unasked), the
    conversation and the response that answered question 1, which the conversation has left."""
    texts = [unique(f"question {n}") for n in range(4)]
    first = client.responses.with_raw_response.create(model="gpt-4o-mini", input=texts[0])
    r1 = first.parse().id
    r2 = client.responses.create(model="gpt-4o-mini", input=texts[1], previous_response_id=r1)
    client.responses.create(model="gpt-4o-mini", input=texts[2], previous_response_id=r1)
    return texts, first.headers[HEADER], r2.id


def test_store_false_on_an_abandoned_branch_reads_that_branch(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    """`store: false` continuing a response the conversation has left (a fork from an earlier
    one since): the upstream gets that response's own history (it got the current branch's,
    whose turns had never led to it), and nothing is stored."""
    texts, conversation, r2 = forked(client)
    before = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    client.responses.create(
        model="gpt-4o-mini", input=texts[3], previous_response_id=r2, store=False
    )
    sent = [(m.get("role"), m.get("content")) for m in way.prompts()[-1]]
    assert sent == [
        ("user", texts[0]),
        ("assistant", f"echo: {texts[0]}"),
        ("user", texts[1]),
        ("assistant", f"echo: {texts[1]}"),
        ("user", texts[3]),
    ]
    after = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    assert after == before


def test_continuing_a_response_of_an_abandoned_branch_continues_its_own_history(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    """A client forks from an earlier response, then goes back to the response it forked away
    from: that response's own history is continued (it was read from the current branch, which
    no longer held it, so the turn went on after the fork point without it)."""
    texts, conversation, r2 = forked(client)
    back = client.responses.create(model="gpt-4o-mini", input=texts[3], previous_response_id=r2)
    assert back.output_text == f"echo: {texts[3]}"

    def pairs(numbers: list[int]) -> list[tuple[str, str]]:
        return [
            m for n in numbers for m in (("user", texts[n]), ("assistant", f"echo: {texts[n]}"))
        ]

    messages = http.get(f"/admin/conversations/{conversation}/messages").json()["messages"]
    assert [(m["role"], m["content"]) for m in messages if m["superseded_at"] is None] == pairs(
        [0, 1, 3]
    )
    assert [(m["role"], m["content"]) for m in messages if m["superseded_at"]] == pairs([2])
    assert len(messages) == 8  # nothing stored twice
    last = [(m.get("role"), m.get("content")) for m in way.prompts()[-1]]
    assert last == [*pairs([0, 1]), ("user", texts[3])]


def test_a_deleted_response_is_gone_here_and_upstream_and_its_messages_stay(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    text = unique("forget this response")
    raw = client.responses.with_raw_response.create(model="gpt-4o-mini", input=text)
    conversation = raw.headers[HEADER]
    made = raw.parse()
    upstream_copy = f"{way.upstream.url}/responses/{made.id}"
    # Forwarded, the id is the upstream's, and it keeps the response; translated, it has none.
    assert httpx.get(upstream_copy).status_code == (200 if way.name == "forward" else 404)
    client.responses.delete(made.id)
    for gone in (
        lambda: client.responses.retrieve(made.id),
        lambda: client.responses.input_items.list(made.id),
        lambda: client.responses.delete(made.id),
        lambda: client.responses.create(
            model="gpt-4o-mini", input="and then?", previous_response_id=made.id
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            gone()
    assert httpx.get(upstream_copy).status_code == 404
    deletes = [r["path"] for r in way.upstream.requests() if r["method"] == "DELETE"]
    assert deletes == ([f"/v1/responses/{made.id}"] if way.name == "forward" else [])
    # Its messages are memory, as every message is: they stay in the conversation.
    assert stored(http, conversation) == [("user", text), ("assistant", f"echo: {text}")]


def test_a_delete_the_upstream_fails_deletes_nothing(ways: dict[str, Way]) -> None:
    way = ways["forward"]
    way.upstream.reset()
    with openai.OpenAI(base_url=way.gateway.url, api_key=CLIENT_KEY, max_retries=0) as client:
        made = client.responses.create(model="gpt-4o-mini", input=unique("keep me for now"))
        way.upstream.script({"status": 503})
        with pytest.raises(openai.InternalServerError) as refused:
            client.responses.delete(made.id)
        assert refused.value.status_code == 503
        assert client.responses.retrieve(made.id).id == made.id
        assert httpx.get(f"{way.upstream.url}/responses/{made.id}").status_code == 200
        client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made.id)


def test_instructions_that_change_each_turn_are_sent_once(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    """Each request continuing the previous response under its own `instructions` (the time in
    them): the upstream gets only the current ones, and the history is its turns alone."""
    previous: str | None = None
    texts = [unique(f"turn {n} under new instructions") for n in range(3)]
    for turn, text in enumerate(texts):
        extra: dict[str, Any] = {"previous_response_id": previous} if previous else {}
        raw = client.responses.with_raw_response.create(
            model="gpt-4o-mini", input=text, instructions=f"It is 10:0{turn}.", **extra
        )
        previous = raw.parse().id
        prompt = way.prompts()[-1]
        systems = [m["content"] for m in prompt if m.get("role") in ("system", "developer")]
        if way.name == "forward":
            assert systems == []
            assert (
                way.upstream.requests(way.path)[-1]["body"]["instructions"] == f"It is 10:0{turn}."
            )
        else:
            assert systems == [f"It is 10:0{turn}."]
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        assert users == texts[: turn + 1]


def test_a_named_conversation_is_the_gateways_and_never_sent_upstream(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    """`conversation` (the Conversations API, as openai-agents sends it) names the gateway's
    conversation, as the header does: each turn sends only its new input and lands in it. The
    upstream gets the history from the gateway and no `conversation`, which would have it
    prepend its own copy. Before, each turn started a conversation of its own."""
    named = f"conv_{uuid.uuid4().hex}"
    texts = [unique(f"turn {n} of a named conversation") for n in range(3)]
    for turn, text in enumerate(texts):
        conversation: Any = named if turn != 1 else {"id": named}
        raw = client.responses.with_raw_response.create(
            model="gpt-4o-mini", input=text, conversation=conversation
        )
        assert raw.headers[HEADER] == named
        assert raw.parse().output_text == f"echo: {text}"
        users = [m["content"] for m in way.prompts()[-1] if m.get("role") == "user"]
        assert users == texts[: turn + 1]
    assert all("conversation" not in r["body"] for r in way.upstream.requests(way.path))
    history = [m for text in texts for m in (("user", text), ("assistant", f"echo: {text}"))]
    assert stored(http, named) == history


def test_a_named_conversation_is_on_the_response_as_openai_puts_it(
    way: Way, client: openai.OpenAI
) -> None:
    """A response to a request naming its `conversation` carries it as OpenAI's does,
    `"conversation": {"id": ...}`: whole, on a stream's `response.created` and final event, and
    read back. It was missing (null), the gateway not sending it upstream."""
    named = f"conv_{uuid.uuid4().hex}"
    whole = client.responses.create(
        model="gpt-4o-mini", input=unique("whole"), conversation={"id": named}
    )
    assert whole.conversation is not None and whole.conversation.id == named
    assert client.responses.retrieve(whole.id).conversation == whole.conversation
    with client.responses.create(
        model="gpt-4o-mini", input=unique("streamed"), conversation=named, stream=True
    ) as stream:
        shown = {
            event.type: event.response
            for event in stream
            if event.type in ("response.created", "response.completed")
        }
    assert {kind: r.conversation.id if r.conversation else None for kind, r in shown.items()} == {
        "response.created": named,
        "response.completed": named,
    }
    streamed_id = shown["response.completed"].id
    retrieved = client.responses.retrieve(streamed_id).conversation
    assert retrieved is not None and retrieved.id == named
    # A request that names none is shown none, as on OpenAI.
    assert client.responses.create(model="gpt-4o-mini", input=unique("none")).conversation is None


@pytest.mark.parametrize(
    ("extra", "headers"),
    [
        ({"conversation": "conv_x", "previous_response_id": "resp_x"}, {}),
        ({"conversation": "conv x"}, {}),
        ({"conversation": 7}, {}),
        ({"conversation": "conv_x"}, {HEADER: "conv_y"}),
    ],
)
def test_a_conversation_the_gateway_cannot_take_is_400_and_stores_nothing(
    way: Way, http: httpx.Client, extra: dict[str, Any], headers: dict[str, str]
) -> None:
    text = unique("never stored")
    body = {"model": "gpt-4o-mini", "input": text, **extra}
    response = http.post("/v1/responses", json=body, headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "conversation"
    assert way.upstream.requests() == []
    found = http.get("/admin/search", params={"q": text})
    assert found.status_code == 200 and found.json()["data"] == []


def test_a_background_response_runs_in_the_foreground(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    """`background: true`: the gateway records the reply as it comes, so the request runs in
    the foreground and answers the finished response, which the client's polling reads back.
    Forwarded as it was, the upstream answered `queued` at once, and the stored response stayed
    queued for every poll after, its reply never recorded."""
    text = unique("take your time")
    raw = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input=text, background=True
    )
    made = raw.parse()
    assert made.status == "completed" and made.output_text == f"echo: {text}"
    polled = client.responses.retrieve(made.id)
    assert polled.status == "completed" and polled.output_text == f"echo: {text}"
    assert polled.background is True
    assert all("background" not in r["body"] for r in way.upstream.requests(way.path))
    assert stored(http, raw.headers[HEADER]) == [("user", text), ("assistant", f"echo: {text}")]
    # Cancelling it (a client that gave up waiting) finds it already finished: it answers the
    # response as it is, as a cancel of a finished background response does, and changes
    # nothing. Relayed, the upstream had no such response (404), or had it done already.
    cancelled = client.responses.cancel(made.id)
    assert cancelled.id == made.id and cancelled.status == "completed"
    assert client.responses.retrieve(made.id).output_text == f"echo: {text}"
    assert not any(r["path"].endswith("/cancel") for r in way.upstream.requests())
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_" + uuid.uuid4().hex)
    # A response not asked for in the background cannot be cancelled, as on OpenAI: 400.
    foreground = client.responses.create(model="gpt-4o-mini", input=unique("right away"))
    with pytest.raises(openai.BadRequestError, match="background=true"):
        client.responses.cancel(foreground.id)


def test_a_stream_the_client_stops_is_an_incomplete_response_to_continue(
    way: Way, client: openai.OpenAI, http: httpx.Client
) -> None:
    """The user presses stop: the client closes the stream. The response is kept, incomplete,
    with the reply as far as it was read, and the next turn continues it by
    `previous_response_id` (with that reply in its prompt, once)."""
    long_reply = " ".join(f"word{i}" for i in range(300))
    way.upstream.script({"path": way.path, "reply": long_reply, "chunk_delay": 0.02})
    question = unique("Tell me a long story.")
    shown, response_id = "", ""
    with client.responses.create(model="gpt-4o-mini", input=question, stream=True) as stream:
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            elif event.type == "response.output_text.delta":
                shown += event.delta
            if len(shown) > 40:
                break
    deadline = time.monotonic() + 5
    while (kept := http.get(f"/v1/responses/{response_id}")).status_code == 404:
        assert time.monotonic() < deadline, kept.text
        time.sleep(0.02)
    assert kept.json()["status"] == "incomplete"
    [partial] = [item["content"][0]["text"] for item in kept.json()["output"]]
    assert partial.startswith(shown) and len(partial) < len(long_reply) / 2
    follow_up = unique("Shorter.")
    client.responses.create(model="gpt-4o-mini", input=follow_up, previous_response_id=response_id)
    assert [(m["role"], m["content"]) for m in way.prompts()[-1]] == [
        ("user", question),
        ("assistant", partial),
        ("user", follow_up),
    ]
