"""The fake upstream behaves like the OpenAI API as seen by the official ``openai`` SDK.

Contract checked here (the server runs as a real subprocess via ``UpstreamServer``):
non-stream echo replies; streams that reassemble to the same text and arrive incrementally;
scripted errors surface as the SDK's typed errors with the scripted message; a scripted
``cut_after`` is a transport-level cut that the SDK reports mid-iteration as
``openai.APIConnectionError`` (caused by the HTTP client's ``RemoteProtocolError``); streamed
tool calls reassemble; embeddings decode (the SDK asks for base64); and recorded requests hold
the body that was sent.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from devkit.upstream import UpstreamServer

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello brave new world"}]
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def client(upstream: UpstreamServer) -> Iterator[openai.OpenAI]:
    upstream.reset()
    with openai.OpenAI(base_url=upstream.url, api_key="x", max_retries=0) as sdk:
        yield sdk


def test_non_stream_echo(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="gpt-4o-mini", messages=USER)
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == "gpt-4o-mini"
    assert completion.choices[0].message.content == "echo: hello brave new world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.completion_tokens > 0


def test_stream_reassembles_and_is_incremental(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    upstream.script({"chunk_delay": 0.15})
    start = time.monotonic()
    first_at: float | None = None
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model="m",
        messages=USER,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first_at is None:
            first_at = time.monotonic()
            assert chunk.choices[0].delta.role == "assistant"
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    end = time.monotonic()
    assert "".join(parts) == "echo: hello brave new world"
    assert len(parts) == 5  # one chunk per word
    assert usage is not None and usage.completion_tokens == 5
    assert first_at is not None
    # 5 word chunks + finish chunk => 5 gaps of 0.15 s after the first chunk.
    assert end - first_at >= 0.6
    assert first_at - start < end - first_at


def test_scripted_429_is_rate_limit_error(client: openai.OpenAI, upstream: UpstreamServer) -> None:
    body = {
        "error": {
            "message": "Slow down, scripted",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    upstream.script({"status": 429, "body": body, "headers": {"Retry-After": "7"}})
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="m", messages=USER)
    assert caught.value.status_code == 429
    assert "Slow down, scripted" in caught.value.message
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.response.headers["retry-after"] == "7"
    # The queue is consumed: the next request gets the default echo.
    ok = client.chat.completions.create(model="m", messages=USER)
    assert ok.choices[0].message.content == "echo: hello brave new world"


def test_cut_stream_raises_mid_iteration(client: openai.OpenAI, upstream: UpstreamServer) -> None:
    upstream.script({"cut_after": 2, "reply": "one two three four five"})
    received: list[str] = []
    stream = client.chat.completions.create(model="m", messages=USER, stream=True)
    with pytest.raises(openai.APIConnectionError) as caught:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert received == ["one", " two"]
    cause = caught.value.__cause__
    assert type(cause).__name__ == "RemoteProtocolError"
    assert "incomplete chunked read" in str(cause)


def test_cut_stream_seen_by_plain_httpx(upstream: UpstreamServer) -> None:
    upstream.script({"cut_after": 1})
    body = {"model": "m", "messages": USER, "stream": True}
    lines: list[str] = []
    with (
        httpx.Client(trust_env=False) as http,
        http.stream("POST", f"{upstream.url}/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            lines.extend(line for line in response.iter_lines() if line)
    assert len(lines) == 1 and lines[0].startswith("data: {")


def test_cut_non_stream_is_connection_error(
    client: openai.OpenAI, upstream: UpstreamServer
) -> None:
    upstream.script({"cut_after": 0})
    with pytest.raises(openai.APIConnectionError) as caught:
        client.chat.completions.create(model="m", messages=USER)
    assert "without sending a response" in str(caught.value.__cause__)


def test_tool_calls_stream_reassembles(client: openai.OpenAI, upstream: UpstreamServer) -> None:
    arguments = {"city": "Paris", "unit": "celsius"}
    upstream.script({"tool_calls": [{"name": "get_weather", "arguments": arguments}]})
    calls: dict[int, dict[str, str]] = {}
    finish = None
    stream = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, stream=True)
    deltas = 0
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            deltas += 1
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            if delta.id:
                call["id"] = delta.id
            if delta.function and delta.function.name:
                call["name"] = delta.function.name
            if delta.function and delta.function.arguments:
                call["arguments"] += delta.function.arguments
    assert finish == "tool_calls"
    assert deltas > 2  # the arguments really arrive in fragments
    assert list(calls) == [0]
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == arguments


def test_tool_calls_non_stream(client: openai.OpenAI, upstream: UpstreamServer) -> None:
    upstream.script({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]})
    completion = client.chat.completions.create(model="m", messages=USER, tools=TOOLS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}


def test_match_leaves_behaviour_queued(client: openai.OpenAI, upstream: UpstreamServer) -> None:
    upstream.script({"match": "special", "reply": "scripted"})
    other = client.chat.completions.create(model="m", messages=USER)
    assert other.choices[0].message.content == "echo: hello brave new world"
    assert len(upstream.pending()) == 1
    special = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "a special one"}],
    )
    assert special.choices[0].message.content == "scripted"
    assert upstream.pending() == []


def test_delay_triggers_client_timeout(client: openai.OpenAI, upstream: UpstreamServer) -> None:
    upstream.script({"delay": 2.0})
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="m", messages=USER, timeout=0.3)


def test_embeddings_and_models(client: openai.OpenAI) -> None:
    first = client.embeddings.create(model="e", input=["alpha", "beta"])
    again = client.embeddings.create(model="e", input="alpha", dimensions=16)
    assert [item.index for item in first.data] == [0, 1]
    assert len(first.data[0].embedding) == 384
    assert len(again.data[0].embedding) == 16
    assert first.data[0].embedding != first.data[1].embedding
    assert (
        first.data[0].embedding
        == client.embeddings.create(model="e", input="alpha").data[0].embedding
    )
    assert first.usage.total_tokens > 0
    assert len(client.models.list().data) >= 2


def test_requests_are_recorded(client: openai.OpenAI, upstream: UpstreamServer) -> None:
    client.chat.completions.create(
        model="gpt-4o-mini",
        messages=USER,
        temperature=0.5,
        extra_headers={"X-Conversation-Id": "conv-1"},
    )
    client.models.list()
    recorded = upstream.requests(path="/v1/chat/completions")
    assert len(recorded) == 1
    entry = recorded[0]
    assert entry["method"] == "POST"
    assert entry["body"] == {"model": "gpt-4o-mini", "messages": USER, "temperature": 0.5}
    assert entry["headers"]["x-conversation-id"] == "conv-1"
    assert entry["headers"]["authorization"] == "Bearer x"
    assert entry["received_at"] <= time.time()
    assert [r["path"] for r in upstream.requests()] == ["/v1/chat/completions", "/v1/models"]
    upstream.reset()
    assert upstream.requests() == []
