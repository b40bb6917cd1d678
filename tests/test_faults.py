"""The upstream fault matrix: whatever an upstream sends, the client gets an answer in OpenAI's
shape or the upstream's own, never a dropped connection or a 500, and what arrived is stored.

Each fault runs stream and non-stream, through the plain relay and through the memory-tool
loop (`MEMSTRATA_MEMORY_TOOLS=always`), against the real fake upstream process; the app runs
in-process. Checked every time: the status, the body's shape, the user's message stored, and
the reply (or the part of it that arrived) stored.
"""

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from tests.inprocess import App, running_app

CHAT = "/v1/chat/completions"

pytestmark = pytest.mark.usefixtures("fresh_upstream")


@pytest.fixture(scope="module", params=["never", "always"], ids=["relay", "tool-loop"])
async def app(
    request: pytest.FixtureRequest, database_url: str, upstream: UpstreamServer
) -> AsyncIterator[App]:
    settings = Settings(
        database_url=database_url,
        upstream_base_url=upstream.url,
        workers=0,
        memory_tools=request.param,
    )
    async with running_app(settings) as running:
        yield running


@pytest.fixture
async def client(app: App) -> AsyncIterator[httpx.AsyncClient]:
    async with app.client() as http:
        yield http


def chunk(delta: Any, *, finish: str | None = None) -> str:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return json.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [choice]})


async def ask(client: httpx.AsyncClient, *, stream: bool) -> tuple[httpx.Response, str, str]:
    """Send one user message in a conversation of its own; the response, its text (a stream
    read to its end), and the conversation."""
    conversation = f"fault-{uuid.uuid4().hex}"
    question = f"question {uuid.uuid4().hex}"
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "stream": stream}
    headers = {"X-Memstrata-Conversation": conversation}
    async with client.stream("POST", CHAT, json=body, headers=headers) as response:
        text = (await response.aread()).decode()
    return response, text, conversation


async def stored(client: httpx.AsyncClient, conversation: str) -> list[dict[str, Any]]:
    response = await client.get(f"/admin/conversations/{conversation}/messages")
    assert response.status_code == 200, response.text
    messages: list[dict[str, Any]] = response.json()["messages"]
    return messages


MALFORMED_CHUNKS = {
    "choices a string": json.dumps({"id": "c1", "choices": "oops"}),
    "choices [1]": json.dumps({"id": "c1", "choices": [1]}),
    "choices [null]": json.dumps({"id": "c1", "choices": [None]}),
    "delta a string": json.dumps({"id": "c1", "choices": [{"index": 0, "delta": "x"}]}),
    "content an int": chunk({"content": 42}),
    "content a list": chunk({"content": ["a", {"b": 1}]}),
    "tool call fragments of the wrong shape": chunk({"tool_calls": ["x", {"index": [1]}]}),
    "not a chunk": json.dumps({"hello": "world"}),
    "not JSON": "{{{",
}


@pytest.mark.parametrize("bad", MALFORMED_CHUNKS.values(), ids=MALFORMED_CHUNKS.keys())
async def test_a_malformed_chunk_mid_stream_keeps_the_stream_and_the_reply(
    client: httpx.AsyncClient, upstream: UpstreamServer, bad: str
) -> None:
    upstream.script(
        {
            "sse": [
                chunk({"role": "assistant", "content": "partial "}),
                bad,
                chunk({"content": "end"}),
                chunk({}, finish="stop"),
                "[DONE]",
            ]
        }
    )
    response, text, conversation = await ask(client, stream=True)
    assert response.status_code == 200
    assert text.rstrip().endswith("data: [DONE]")
    user, reply = await stored(client, conversation)
    assert user["role"] == "user"
    assert (reply["role"], reply["content"], reply["status"]) == (
        "assistant",
        "partial end",
        "complete",
    )


async def test_a_stream_of_nothing_but_garbage_ends_cleanly(
    client: httpx.AsyncClient, upstream: UpstreamServer
) -> None:
    upstream.script({"sse": [json.dumps({"hello": "world"})]})
    response, text, conversation = await ask(client, stream=True)
    assert response.status_code == 200
    assert "hello" in text
    [user] = await stored(client, conversation)  # nothing of a reply arrived: none stored
    assert user["role"] == "user"


UNSTORABLE_TEXT = {"NUL": ("a\u0000b", "a\\u0000b"), "lone surrogate": ("a\ud800b", "a\\ud800b")}


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("text", UNSTORABLE_TEXT.values(), ids=UNSTORABLE_TEXT.keys())
async def test_a_reply_postgres_cannot_hold_reaches_the_client_and_is_stored_escaped(
    client: httpx.AsyncClient, upstream: UpstreamServer, text: tuple[str, str], stream: bool
) -> None:
    sent, kept = text
    # JSON with escapes (ensure_ascii), as a server would send it: valid JSON, odd text.
    if stream:
        upstream.script(
            {
                "sse": [
                    chunk({"role": "assistant", "content": sent}),
                    chunk({}, finish="stop"),
                    "[DONE]",
                ]
            }
        )
    else:
        completion = {
            "id": "c1",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": sent},
                    "finish_reason": "stop",
                }
            ],
        }
        upstream.script({"body": json.dumps(completion)})
    response, body, conversation = await ask(client, stream=stream)
    assert response.status_code == 200, body
    assert json.dumps(sent)[1:-1] in body  # the client got the answer as the upstream sent it
    _user, reply = await stored(client, conversation)
    assert (reply["content"], reply["escaped"]) == (kept, True)


@pytest.mark.parametrize(
    "calls", ["x", [1], [None], {"a": 1}], ids=["string", "[1]", "[null]", "object"]
)
async def test_a_reply_with_tool_calls_of_the_wrong_shape_is_relayed_and_stored(
    client: httpx.AsyncClient, upstream: UpstreamServer, calls: Any
) -> None:
    message = {"role": "assistant", "content": "fine", "tool_calls": calls}
    completion = {
        "id": "c1",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }
    upstream.script({"body": completion})
    response, body, conversation = await ask(client, stream=False)
    assert response.status_code == 200
    assert json.loads(body) == completion  # relayed untouched
    _user, reply = await stored(client, conversation)
    assert reply["content"] == "fine" and reply["tool_calls"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
@pytest.mark.parametrize("status", [429, 500, 503])
async def test_an_upstream_error_is_relayed_and_the_message_kept(
    client: httpx.AsyncClient, upstream: UpstreamServer, status: int, stream: bool
) -> None:
    upstream.script({"status": status, "headers": {"Retry-After": "3"}})
    response, body, conversation = await ask(client, stream=stream)
    assert response.status_code == status
    assert response.headers["retry-after"] == "3"
    assert set(json.loads(body)["error"]) >= {"message", "type"}
    [user] = await stored(client, conversation)
    assert user["role"] == "user"


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
async def test_an_upstream_that_hangs_up_keeps_what_arrived(
    client: httpx.AsyncClient, upstream: UpstreamServer, stream: bool
) -> None:
    upstream.script({"reply": "one two three four five", "cut_after": 2})
    response, body, conversation = await ask(client, stream=stream)
    messages = await stored(client, conversation)
    assert messages[0]["role"] == "user"
    if stream:
        assert response.status_code == 200
        assert "upstream_stream_interrupted" in body  # an error event, then a clean end
        reply = messages[1]
        assert reply["status"] == "incomplete" and reply["content"]
    else:
        error = json.loads(body)["error"]
        assert response.status_code == 502 and error["type"] == "upstream_error"
        assert len(messages) == 1
