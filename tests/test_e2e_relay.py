"""End to end: what the gateway passes on unchanged, and what it records whole.

A gateway process in front of the fake upstream process: every other `/v1` path relayed
(`GET /v1/models/{id}`, an unknown path, a streamed audio answer, a multipart upload) with its
query string and the OpenAI headers; the query string (Azure's `api-version`) on chat
completions too; audio and file parts not refused as over budget; every field of a reply
message recorded, streamed or not, the deprecated `function_call` included.
"""

import base64
import dataclasses
import io
import json
import time
import uuid
import wave
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.upstream import Upstream
from tests.inprocess import App

HEADER = "X-Memstrata-Conversation"
OPENAI_HEADERS = {
    "OpenAI-Organization": "org-relay",
    "OpenAI-Project": "proj-relay",
    "OpenAI-Beta": "assistants=v2",
}

pytestmark = pytest.mark.usefixtures("fresh_upstream")


@pytest.fixture(scope="module")
def upstream() -> Iterator[UpstreamServer]:
    with UpstreamServer(chunk_delay=0.05) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url, upstream_url=upstream.url, workers=0, context_budget=2000
    ) as process:
        yield process


@pytest.fixture
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.root_url, timeout=15, headers=OPENAI_HEADERS) as raw:
        yield raw


def assert_openai_headers(recorded: dict[str, Any]) -> None:
    for name, value in OPENAI_HEADERS.items():
        assert recorded["headers"][name.lower()] == value


def stored(http: httpx.Client, conversation: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 5
    while True:
        messages: list[dict[str, Any]] = http.get(
            f"/admin/conversations/{conversation}/messages"
        ).json()["messages"]
        if len(messages) >= count or time.monotonic() > deadline:
            return messages
        time.sleep(0.02)


def exported(http: httpx.Client, conversation: str, count: int) -> list[dict[str, Any]]:
    """The stored messages whole, as the export gives them (every field of each)."""
    stored(http, conversation, count)
    lines = http.get(f"/admin/conversations/{conversation}/export").text.splitlines()
    return [json.loads(line) for line in lines]


# -- relayed unchanged ---------------------------------------------------------------------


def test_one_model_is_relayed(gateway: GatewayProcess, upstream: UpstreamServer) -> None:
    with openai.OpenAI(base_url=gateway.url, api_key="sk-relay", max_retries=0) as sdk:
        assert sdk.models.retrieve("gpt-4o").id == "gpt-4o"
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    assert [r["path"] for r in upstream.requests()] == [
        "/v1/models/gpt-4o",
        "/v1/models/no-such-model",
    ]


def test_an_unknown_path_is_relayed_with_its_query_and_headers(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    upstream.script({"path": "/v1/moderations", "body": {"id": "modr-1", "results": []}})
    answer = http.post("/v1/moderations?api-version=2024-10-21&x=1", json={"input": "hello"})
    assert answer.status_code == 200
    assert answer.json() == {"id": "modr-1", "results": []}
    assert answer.headers["x-upstream-request-id"].startswith("req_")
    missing = http.delete("/v1/vector_stores/vs_123?api-version=2024-10-21")
    assert missing.status_code == 404  # the upstream's own answer, relayed
    assert missing.json()["error"]["message"] == "Invalid URL (DELETE /v1/vector_stores/vs_123)"
    moderated, deleted = upstream.requests()
    assert (moderated["method"], moderated["query"]) == ("POST", "api-version=2024-10-21&x=1")
    assert moderated["body"] == {"input": "hello"}
    assert (deleted["method"], deleted["path"]) == ("DELETE", "/v1/vector_stores/vs_123")
    for recorded in (moderated, deleted):
        assert_openai_headers(recorded)


def test_a_multipart_upload_is_relayed_as_sent(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    audio = b"ID3" + bytes(range(256)) * 40
    answer = http.post(
        "/v1/audio/transcriptions",
        files={"file": ("speech.mp3", audio, "audio/mpeg")},
        data={"model": "whisper-1"},
    )
    assert answer.status_code == 404  # the fake upstream has no transcriptions: relayed as is
    [sent] = upstream.requests()
    assert sent["headers"]["content-type"].startswith("multipart/form-data; boundary=")
    assert int(sent["headers"]["content-length"]) > len(audio)
    assert "speech.mp3" in sent["raw_body"] and "whisper-1" in sent["raw_body"]


def test_a_streamed_answer_is_relayed_as_it_comes(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    words = "a streamed answer that is spoken piece by piece as it is made " * 4
    arrivals: list[float] = []
    received = b""
    with http.stream(
        "POST", "/v1/audio/speech", json={"model": "tts-1", "input": words, "voice": "alloy"}
    ) as response:
        assert response.headers["content-type"] == "audio/mpeg"
        for chunk in response.iter_raw():
            arrivals.append(time.monotonic())
            received += chunk
    assert received == words.encode()
    # Eight pieces 50 ms apart upstream: they must not all arrive at once.
    assert len(arrivals) >= 4 and arrivals[-1] - arrivals[0] > 0.2


def test_chat_completions_forward_the_query_and_the_openai_headers(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    text = f"azure {uuid.uuid4().hex}"
    for stream in (False, True):
        answer = http.post(
            "/openai/deployments/x/chat/completions?api-version=2024-10-21",
            json={"model": "m", "messages": [{"role": "user", "content": text}]},
        )
        assert answer.status_code == 404  # not a gateway path
        answer = http.post(
            "/v1/chat/completions?api-version=2024-10-21",
            json={
                "model": "m",
                "stream": stream,
                "messages": [{"role": "user", "content": f"{text} {stream}"}],
            },
        )
        assert answer.status_code == 200
    for recorded in upstream.requests("/v1/chat/completions"):
        assert recorded["query"] == "api-version=2024-10-21"
        assert_openai_headers(recorded)


# -- what memory counts and keeps ----------------------------------------------------------


def wav(seconds: float) -> str:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as clip:
        clip.setnchannels(1)
        clip.setsampwidth(2)
        clip.setframerate(24_000)
        clip.writeframes(b"\0\0" * int(24_000 * seconds))
    return base64.b64encode(buffer.getvalue()).decode()


def test_audio_and_file_parts_are_not_refused_as_over_budget(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    clip = wav(5.0)  # 320 kB of base64: some 10^5 tokens if it were counted as text
    document = base64.b64encode(b"%PDF-1.4\n1 0 obj << /Type /Page >> endobj\n" * 1).decode()
    content = [
        {"type": "text", "text": f"what is said here? {uuid.uuid4().hex}"},
        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
        {"type": "file", "file": {"filename": "a.pdf", "file_data": document}},
    ]
    answer = http.post(
        "/v1/chat/completions",
        json={"model": "gpt-4o-audio-preview", "messages": [{"role": "user", "content": content}]},
    )
    assert answer.status_code == 200, answer.text
    assert int(answer.headers["x-memstrata-context-tokens"]) < 2000
    [sent] = upstream.requests("/v1/chat/completions")
    assert sent["body"]["messages"][0]["content"] == content
    [user, _] = stored(http, answer.headers[HEADER], 2)
    assert user["content"] == content


def test_every_field_of_a_reply_is_recorded(http: httpx.Client, upstream: UpstreamServer) -> None:
    message = {
        "role": "assistant",
        "content": "Here it is.",
        "refusal": None,
        "annotations": [{"type": "url_citation", "url_citation": {"url": "https://a.example"}}],
        "audio": {"id": "audio_1", "data": "UklGRg==", "expires_at": 1, "transcript": "Here."},
        "reasoning_content": "I looked it up.",
    }
    completion = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }
    upstream.script({"body": completion})
    answer = http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": uuid.uuid4().hex}]},
    )
    assert answer.status_code == 200
    [_, reply] = exported(http, answer.headers[HEADER], 2)
    kept = {key: value for key, value in message.items() if value is not None}
    assert {key: reply[key] for key in kept} == kept
    assert "refusal" not in reply


def sse(*chunks: dict[str, Any]) -> str:
    events = [
        {"id": "chatcmpl-2", "object": "chat.completion.chunk", "model": "m", "choices": [c]}
        for c in chunks
    ]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_every_field_of_a_streamed_reply_is_recorded(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    upstream.script(
        {
            "body": sse(
                {"index": 0, "delta": {"role": "assistant", "reasoning_content": "Let me "}},
                {"index": 0, "delta": {"reasoning_content": "think."}},
                {"index": 0, "delta": {"audio": {"id": "audio_2", "transcript": "Hel"}}},
                {"index": 0, "delta": {"audio": {"transcript": "lo", "data": "AAA"}}},
                {"index": 0, "delta": {"content": "Hello"}, "finish_reason": "stop"},
            )
        }
    )
    answer = http.post(
        "/v1/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert answer.status_code == 200
    [_, reply] = exported(http, answer.headers[HEADER], 2)
    assert reply["content"] == "Hello"
    assert reply["reasoning_content"] == "Let me think."
    assert reply["audio"] == {"id": "audio_2", "transcript": "Hello", "data": "AAA"}
    assert stored(http, answer.headers[HEADER], 2)[1]["status"] == "complete"


def test_a_streamed_deprecated_function_call_is_recorded(
    http: httpx.Client, upstream: UpstreamServer
) -> None:
    upstream.script(
        {
            "body": sse(
                {
                    "index": 0,
                    "delta": {
                        "role": "assistant",
                        "content": None,
                        "function_call": {"name": "get_weather", "arguments": ""},
                    },
                },
                {"index": 0, "delta": {"function_call": {"arguments": '{"city"'}}},
                {"index": 0, "delta": {"function_call": {"arguments": ': "Oslo"}'}}},
                {"index": 0, "delta": {}, "finish_reason": "function_call"},
            )
        }
    )
    answer = http.post(
        "/v1/chat/completions",
        json={
            "model": "m",
            "stream": True,
            "messages": [{"role": "user", "content": uuid.uuid4().hex}],
            "functions": [{"name": "get_weather", "parameters": {"type": "object"}}],
        },
    )
    assert answer.status_code == 200
    [_, reply] = exported(http, answer.headers[HEADER], 2)
    assert reply["function_call"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert reply["content"] is None


async def test_a_stream_cut_inside_an_event_ends_with_a_well_formed_error_event(
    app: App,
) -> None:
    """A client that asked for the usage was relayed the upstream's bytes as they came, so a
    stream cut in the middle of an event left that event's first half on the wire and the
    error event was glued to it: one line `data: {"id": …data: {"error": …}`, which no client
    can parse (the OpenAI SDK raised a JSON error, not the APIError). Only whole events are
    relayed: the half event is dropped, and every event the client gets parses."""
    whole = {
        "id": "chatcmpl-cut",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hel"}}],
    }

    async def pieces() -> AsyncIterator[bytes]:
        yield f"data: {json.dumps(whole)}\n\n".encode()
        yield b'data: {"id": "chatcmpl-cut", "choi'
        raise httpx.ReadError("connection reset")

    class Cut(httpx.AsyncByteStream):
        def __aiter__(self) -> AsyncIterator[bytes]:
            return pieces()

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Cut())

    mock = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    upstream = Upstream([mock], base_url="http://upstream.test/v1", api_key=None)
    cut = App(app.app, dataclasses.replace(app.state, upstream=upstream))
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"cut {uuid.uuid4().hex}"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with cut.client() as client:
            response = await client.post("/v1/chat/completions", json=body)
    finally:
        await mock.aclose()
    assert response.status_code == 200
    events = [event for event in response.text.split("\n\n") if event.strip()]
    payloads = [json.loads(event.removeprefix("data: ")) for event in events]
    assert payloads[0]["choices"][0]["delta"]["content"] == "hel"
    assert payloads[-1]["error"]["code"] == "upstream_stream_interrupted"
