"""End to end: the memory-tool loop on the Responses API, through the real `openai` SDK (and raw
HTTP where the events themselves are checked) → a `memstrata serve` process → the fake
upstream process, on both ways upstream: forwarded as Responses (`gateway.openai.
response_tools`) and translated to chat completions (`gateway.openai.toolloop`).

The gateways run with `MEMSTRATA_MEMORY_TOOLS=always` and two tool rounds at most; the fake
upstream is scripted to call memory tools. Each test checks what the client received, what the
upstream received each round, and what Postgres holds: the client sees only the final answer
(one response, one stream), and the stored conversation is exactly what it saw.
"""

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import FunctionToolParam

import tests.test_e2e_responses
from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from memory.recall import tools

HEADER = "X-Memstrata-Conversation"
MEMORY_TOOLS = sorted(tools.TOOL_NAMES)
WEATHER: list[FunctionToolParam] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False,
    }
]


class Way(tests.test_e2e_responses.Way):
    """One way upstream, and what its requests upstream carried."""

    def offered(self, body: dict[str, Any]) -> list[str]:
        """The names of the tools a request upstream offered."""
        if self.name == "forward":
            return sorted(tool["name"] for tool in body.get("tools", []))
        return sorted(tool["function"]["name"] for tool in body.get("tools", []))

    def read_back(self, body: dict[str, Any]) -> str:
        """What the request upstream carried after its last user message, as text."""
        prompt = body["input"] if self.name == "forward" else body["messages"]
        last_user = max(i for i, m in enumerate(prompt) if m.get("role") == "user")
        return json.dumps(prompt[last_user + 1 :])


@pytest.fixture(scope="module")
def ways(database_url: str) -> Iterator[dict[str, Way]]:
    settings: dict[str, Any] = {"workers": 0, "memory_tools": "always", "max_tool_rounds": 2}
    with (
        UpstreamServer(chunk_delay=0.001) as serving,
        UpstreamServer(chunk_delay=0.001, responses=False) as chat_only,
        GatewayProcess(
            database_url=database_url,
            upstream_url=serving.url,
            upstream_responses="on",
            **settings,
        ) as forward,
        GatewayProcess(
            database_url=database_url,
            upstream_url=chat_only.url,
            upstream_responses="off",
            **settings,
        ) as translate,
    ):
        yield {
            "forward": Way("forward", serving, forward),
            "translate": Way("translate", chat_only, translate),
        }


@pytest.fixture(params=["forward", "translate"])
def way(request: pytest.FixtureRequest, ways: dict[str, Way]) -> Way:
    chosen = ways[request.param]
    chosen.upstream.reset()
    return chosen


@pytest.fixture
def client(way: Way) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=way.gateway.url, api_key="sk-r", max_retries=0, timeout=20) as sdk:
        yield sdk


@pytest.fixture
def http(way: Way) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=way.gateway.root_url, timeout=20) as raw:
        yield raw


def stored(http: httpx.Client, conversation: str, count: int) -> list[tuple[str, Any, Any]]:
    """The stored messages once there are `count` (a stream's reply is stored as it ends)."""
    deadline = time.monotonic() + 5
    while True:
        answer = http.get(f"/admin/conversations/{conversation}/messages")
        assert answer.status_code == 200, answer.text
        messages = answer.json()["messages"]
        if len(messages) >= count or time.monotonic() > deadline:
            return [(m["role"], m["content"], m["tool_calls"]) for m in messages]
        time.sleep(0.02)


def events(response: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line[len("data: ") :])
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]


def remembered(client: openai.OpenAI, code: str) -> tuple[str, str]:
    """A conversation holding a locker code: its id, and the id of its first response."""
    raw = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input=f"Remember: my locker code is {code}."
    )
    return raw.headers[HEADER], raw.parse().id


@pytest.mark.parametrize("stream", [False, True])
def test_the_model_reads_memory_before_it_answers(
    way: Way, client: openai.OpenAI, http: httpx.Client, stream: bool
) -> None:
    code = uuid.uuid4().hex[:8]
    conversation, first = remembered(client, code)
    way.upstream.reset()
    question = f"What is my locker code? {uuid.uuid4().hex[:6]}"
    answer = f"Your locker code is {code}."
    way.upstream.script(
        {"tool_calls": [{"name": "memory_find", "arguments": {"pattern": "locker code is"}}]},
        {"reply": answer},
    )
    body = {"model": "gpt-4o-mini", "input": question, "previous_response_id": first}
    if stream:
        raw = http.post("/v1/responses", json={**body, "stream": True})
        assert raw.status_code == 200, raw.text
        sent = events(raw)
        kinds = [event["type"] for event in sent]
        assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
        assert [event["sequence_number"] for event in sent] == list(range(len(sent)))
        assert not any("function_call" in kind for kind in kinds)
        added = [event for event in sent if event["type"] == "response.output_item.added"]
        assert [(event["output_index"], event["item"]["type"]) for event in added] == [
            (0, "message")
        ]
        text = "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta")
        final = sent[-1]["response"]
        assert final["id"] == sent[0]["response"]["id"]
    else:
        response = client.responses.create(
            model="gpt-4o-mini", input=question, previous_response_id=first
        )
        text = response.output_text
        final = response.model_dump()
    assert text == answer
    assert [item["type"] for item in final["output"]] == ["message"]
    assert not any(tool.get("name") in MEMORY_TOOLS for tool in final.get("tools") or [])
    assert final["output"][0]["content"][0]["text"] == answer

    # Two rounds upstream: the first offered the memory tools, the second read what they found.
    rounds = way.upstream.requests(way.path)
    assert len(rounds) == 2
    assert set(MEMORY_TOOLS) <= set(way.offered(rounds[0]["body"]))
    assert f"locker code is {code}" in way.read_back(rounds[1]["body"])
    assert "memory_find" in way.read_back(rounds[1]["body"])

    # The usage the client saw is both rounds' (the second repeats the first, which the fake
    # caches), and the statistics hold it beside the first turn's.
    usage = final["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] > 0
    stats = http.get(f"/admin/conversations/{conversation}").json()
    assert stats["tokens_cached"] == usage["input_tokens_details"]["cached_tokens"]
    assert 0 < stats["upstream_prompt_tokens"] - usage["input_tokens"] < usage["input_tokens"]

    # Stored: what the client saw, no memory call or result; read back as it was sent.
    assert stored(http, conversation, 4) == [
        ("user", f"Remember: my locker code is {code}.", None),
        ("assistant", f"echo: Remember: my locker code is {code}.", None),
        ("user", question, None),
        ("assistant", answer, None),
    ]
    assert client.responses.retrieve(final["id"]).output_text == answer
    # And it is continued as any response is: its conversation, its history upstream.
    after = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input="Thanks.", previous_response_id=final["id"]
    )
    assert after.headers[HEADER] == conversation
    assert [m[1] for m in stored(http, conversation, 6)[-2:]] == ["Thanks.", "echo: Thanks."]


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_own_call_reaches_it_and_the_memory_call_is_dropped(
    way: Way, client: openai.OpenAI, http: httpx.Client, stream: bool
) -> None:
    """A round calling the client's tool beside a memory tool goes to the client with its own
    call alone, unrun memory call dropped, in one round."""
    way.upstream.script(
        {
            "tool_calls": [
                {"name": "memory_search", "arguments": {"query": "weather"}},
                {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_w1"},
            ]
        }
    )
    body = {"model": "gpt-4o-mini", "input": f"Weather? {uuid.uuid4().hex[:6]}", "tools": WEATHER}
    if stream:
        raw = http.post("/v1/responses", json={**body, "stream": True})
        assert raw.status_code == 200, raw.text
        sent = events(raw)
        output = sent[-1]["response"]["output"]
        added = [event for event in sent if event["type"] == "response.output_item.added"]
        assert [event["item"]["name"] for event in added] == ["get_weather"]
        assert [event["output_index"] for event in added] == [0]
    else:
        output = client.responses.create(**body).model_dump()["output"]  # type: ignore[call-overload]
    calls = [item for item in output if item["type"] == "function_call"]
    assert [(call["name"], call["call_id"]) for call in calls] == [("get_weather", "call_w1")]
    assert len(way.upstream.requests(way.path)) == 1


def test_a_later_round_that_fails_ends_the_stream_with_an_error_and_keeps_the_question(
    way: Way, http: httpx.Client
) -> None:
    way.upstream.script(
        {"tool_calls": [{"name": "memory_search", "arguments": {"query": "anything"}}]},
        {"status": 503},
    )
    question = f"Anything? {uuid.uuid4().hex[:6]}"
    raw = http.post(
        "/v1/responses", json={"model": "gpt-4o-mini", "input": question, "stream": True}
    )
    assert raw.status_code == 200
    sent = events(raw)
    assert sent[0]["type"] == "response.created"
    assert not any(event.get("type") == "response.completed" for event in sent)
    last = sent[-1]
    assert last["type"] == "error"
    conversation = raw.headers[HEADER]
    assert stored(http, conversation, 1)[0][:2] == ("user", question)
