"""Bad input is refused with a clear 4xx in OpenAI's error shape, and nothing is written.

The app runs in-process (`create_app` + `httpx.ASGITransport`, its lifespan entered by hand,
its state handed to each request the way a server does), so a test can pose as a non-loopback
client; the upstream is the real fake server process, so "the upstream received nothing" is
checked on what it actually recorded. "Nothing written" counts the default tenant's
conversations, messages and queued jobs before and after each request.
"""

import dataclasses
import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.types import Receive, Scope, Send

from devkit.service import free_port
from devkit.upstream import UpstreamServer
from gateway.app import create_app
from gateway.settings import Settings
from gateway.state import State
from memory.db import connect
from memory.schema import conversations, jobs, nodes
from tests.inprocess import running_app

MAX_BODY = 4096
CHAT = "/v1/chat/completions"
JSON_HEADERS = {"content-type": "application/json"}


pytestmark = pytest.mark.usefixtures("fresh_upstream")


def _user(text: str = "hello") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


@dataclasses.dataclass
class InProcess:
    """The app with its lifespan entered, and clients that reach it without a socket."""

    app: FastAPI
    state: State

    def client(self, *, host: str = "127.0.0.1", state: State | None = None) -> httpx.AsyncClient:
        """A client that connects from `host`; requests see `state` (default: the app's)."""
        app, lifespan = self.app, {"memstrata": state or self.state}

        async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
            # What a server does with the lifespan's state: a copy for each request.
            scope["state"] = dict(lifespan)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=asgi, client=(host, 1234))
        return httpx.AsyncClient(transport=transport, base_url="http://localhost")


@pytest.fixture(scope="module")
async def gateway(database_url: str, upstream: UpstreamServer) -> AsyncIterator[InProcess]:
    app = create_app(
        Settings(
            database_url=database_url,
            upstream_base_url=upstream.url,
            max_body_bytes=MAX_BODY,
            workers=0,
        )
    )
    async with app.router.lifespan_context(app) as lifespan_state:
        assert lifespan_state is not None
        state = lifespan_state["memstrata"]
        assert isinstance(state, State)
        yield InProcess(app, state)


@pytest.fixture
async def client(gateway: InProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with gateway.client() as http:
        yield http


async def _counts(engine: AsyncEngine, tenant: int) -> dict[str, int]:
    counts = {}
    async with engine.connect() as conn:
        for table in (conversations, nodes, jobs):
            counts[table.name] = int(
                await conn.scalar(
                    select(func.count()).select_from(table).where(table.c.tenant_id == tenant)
                )
                or 0
            )
    return counts


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return dict(error)


class _Refused:
    """Run a request and check it was refused in OpenAI's shape with nothing written."""

    def __init__(self, engine: AsyncEngine, state: State, upstream: UpstreamServer) -> None:
        self.engine = engine
        self.state = state
        self.upstream = upstream

    async def __call__(
        self, status: int, send: Callable[[], Awaitable[httpx.Response]]
    ) -> dict[str, Any]:
        tenant = self.state.default_tenant_id
        before = await _counts(self.engine, tenant)
        response = await send()
        error = _assert_openai_error(response, status)
        assert await _counts(self.engine, tenant) == before, "a refused request wrote rows"
        assert self.upstream.requests() == [], "a refused request went upstream"
        return error


@pytest.fixture
def refused(engine: AsyncEngine, gateway: InProcess, upstream: UpstreamServer) -> _Refused:
    return _Refused(engine, gateway.state, upstream)


# -- control: a valid request through the same app does write and forward ------------------


async def test_valid_request_writes_and_forwards(
    client: httpx.AsyncClient, engine: AsyncEngine, gateway: InProcess, upstream: UpstreamServer
) -> None:
    tenant = gateway.state.default_tenant_id
    before = await _counts(engine, tenant)
    text = f"control {uuid.uuid4().hex}"
    response = await client.post(CHAT, json={"model": "m", "messages": _user(text)})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == f"echo: {text}"
    assert response.headers["x-memstrata-conversation"]
    after = await _counts(engine, tenant)
    assert after["conversations"] == before["conversations"] + 1
    assert after["nodes"] == before["nodes"] + 2
    assert len(upstream.requests(CHAT)) == 1


# -- malformed bodies ----------------------------------------------------------------------

MALFORMED = {
    "truncated": b'{"model": "m", "messages": [',
    "empty body": b"",
    "not json": b"model=m&messages=hi",
    "trailing garbage": b'{"model": "m", "messages": [{"role": "user", "content": "x"}]} x',
    "NaN constant": (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    ),
    "Infinity constant": (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}'
    ),
    "invalid utf-8": b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_json_is_400(
    client: httpx.AsyncClient, refused: _Refused, raw: bytes
) -> None:
    error = await refused(400, lambda: client.post(CHAT, content=raw, headers=JSON_HEADERS))
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"hello"', b"null", b"42", b"true"])
async def test_non_object_json_is_400(
    client: httpx.AsyncClient, refused: _Refused, raw: bytes
) -> None:
    error = await refused(400, lambda: client.post(CHAT, content=raw, headers=JSON_HEADERS))
    assert error["type"] == "invalid_request_error"


# -- wrong shapes and types ----------------------------------------------------------------

INVALID = {
    "messages missing": ({"model": "m"}, "messages"),
    "messages empty": ({"model": "m", "messages": []}, "messages"),
    "messages a string": ({"model": "m", "messages": "hello"}, "messages"),
    "messages null": ({"model": "m", "messages": None}, "messages"),
    "message not an object": ({"model": "m", "messages": ["hello"]}, "messages[0]"),
    "model missing": ({"messages": _user()}, "model"),
    "model an int": ({"model": 4, "messages": _user()}, "model"),
    "model empty": ({"model": "", "messages": _user()}, "model"),
    "unknown role": (
        {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
        "messages[0].role",
    ),
    "role missing": ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
    "content an int": (
        {"model": "m", "messages": [{"role": "user", "content": 42}]},
        "messages[0].content",
    ),
    "content an object": (
        {"model": "m", "messages": [{"role": "user", "content": {"text": "x"}}]},
        "messages[0].content",
    ),
    "content part not an object": (
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, 5]}],
        },
        "messages[0].content",
    ),
    "user message without content": ({"model": "m", "messages": [{"role": "user"}]}, "messages[0]"),
    "tool message without tool_call_id": (
        {
            "model": "m",
            "messages": [*_user(), {"role": "tool", "content": "42"}],
        },
        "messages[1]",
    ),
    "assistant without content or tool calls": (
        {"model": "m", "messages": [*_user(), {"role": "assistant"}]},
        "messages[1]",
    ),
    "tool_calls not a list": (
        {
            "model": "m",
            "messages": [*_user(), {"role": "assistant", "tool_calls": "get_weather"}],
        },
        "messages[1].tool_calls",
    ),
    "tool call without function": (
        {
            "model": "m",
            "messages": [*_user(), {"role": "assistant", "tool_calls": [{"id": "c1"}]}],
        },
        "messages[1].tool_calls[0].function",
    ),
    "name an int": (
        {"model": "m", "messages": [{"role": "user", "content": "x", "name": 7}]},
        "messages[0].name",
    ),
    "stream not a bool": ({"model": "m", "messages": _user(), "stream": "maybe"}, "stream"),
    "user an int": ({"model": "m", "messages": _user(), "user": 12}, "user"),
}


@pytest.mark.parametrize(("body", "param"), INVALID.values(), ids=INVALID.keys())
async def test_invalid_request_is_400(
    client: httpx.AsyncClient, refused: _Refused, body: dict[str, Any], param: str
) -> None:
    error = await refused(400, lambda: client.post(CHAT, json=body))
    assert error["type"] == "invalid_request_error"
    # Named as OpenAI names it (`messages[0].content`), in `param` and in the message.
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error


INVALID_INPUT = {
    "a role": ([{"role": "robot", "content": "hi"}], "input[0].role"),
    "content": ([{"role": "user", "content": 7}], "input[0].content"),
    "an item type": ([{"role": "user", "content": "hi"}, {"type": "hologram"}], "input[1].type"),
    "a reference without id": ([{"type": "item_reference"}], "input[0].id"),
}


@pytest.mark.parametrize(("items", "param"), INVALID_INPUT.values(), ids=INVALID_INPUT.keys())
async def test_a_bad_responses_input_item_is_named_in_param(
    client: httpx.AsyncClient, refused: _Refused, items: list[Any], param: str
) -> None:
    # `param` named the whole `input`, though the message named the item and field.
    body = {"model": "m", "input": items}
    error = await refused(400, lambda: client.post("/v1/responses", json=body))
    assert error["param"] == param, error
    assert error["message"].startswith(param.split(".")[0]), error


UNSTORABLE = {
    "NUL in content": {"role": "user", "content": "a\u0000b"},
    "NUL in a content part": {"role": "user", "content": [{"type": "text", "text": "a\u0000"}]},
    "NUL in name": {"role": "user", "content": "x", "name": "a\u0000"},
    "lone surrogate": {"role": "user", "content": "a\ud800b"},
    # After escapes that are harmless (json.dumps escapes "é" too), which alone skip the check.
    "NUL after other escapes": {"role": "user", "content": "caf\u00e9 a\u0000b"},
}


@pytest.mark.parametrize("message", UNSTORABLE.values(), ids=UNSTORABLE.keys())
async def test_text_postgres_cannot_store_is_400(
    client: httpx.AsyncClient, refused: _Refused, message: dict[str, Any]
) -> None:
    # Valid JSON (as escapes), but Postgres text/jsonb cannot hold NUL or unpaired surrogates.
    raw = json.dumps({"model": "m", "messages": [message]}).encode()
    error = await refused(400, lambda: client.post(CHAT, content=raw, headers=JSON_HEADERS))
    assert error["param"] is not None and error["param"].startswith("messages[0]"), error


# -- oversize bodies -----------------------------------------------------------------------


def _oversize_body() -> bytes:
    body = json.dumps({"model": "m", "messages": _user("x" * (MAX_BODY + 100))}).encode()
    assert len(body) > MAX_BODY
    return body


async def test_oversize_body_with_content_length_is_413(
    client: httpx.AsyncClient, refused: _Refused
) -> None:
    raw = _oversize_body()
    error = await refused(413, lambda: client.post(CHAT, content=raw, headers=JSON_HEADERS))
    assert error["code"] == "request_too_large"


async def test_oversize_chunked_body_without_content_length_is_413(
    client: httpx.AsyncClient, refused: _Refused
) -> None:
    raw = _oversize_body()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(raw), 1000):
            yield raw[start : start + 1000]

    def send() -> Awaitable[httpx.Response]:
        request = client.build_request("POST", CHAT, content=chunks(), headers=JSON_HEADERS)
        assert "content-length" not in request.headers
        assert request.headers["transfer-encoding"] == "chunked"
        return client.send(request)

    error = await refused(413, send)
    assert error["code"] == "request_too_large"


async def test_lying_small_content_length_is_still_413(
    client: httpx.AsyncClient, refused: _Refused
) -> None:
    raw = _oversize_body()

    async def chunks() -> AsyncIterator[bytes]:
        yield raw

    def send() -> Awaitable[httpx.Response]:
        request = client.build_request(
            "POST", CHAT, content=chunks(), headers={**JSON_HEADERS, "content-length": "100"}
        )
        return client.send(request)

    await refused(413, send)


async def test_oversize_embeddings_body_is_413(
    client: httpx.AsyncClient, refused: _Refused
) -> None:
    raw = json.dumps({"model": "e", "input": "x" * (MAX_BODY + 100)}).encode()
    await refused(413, lambda: client.post("/v1/embeddings", content=raw, headers=JSON_HEADERS))


async def test_body_just_under_the_limit_is_accepted(
    client: httpx.AsyncClient, upstream: UpstreamServer
) -> None:
    text = f"{uuid.uuid4().hex} "
    envelope = len(json.dumps({"model": "m", "messages": _user(text)}).encode())
    body = {"model": "m", "messages": _user(text + "y" * (MAX_BODY - envelope))}
    assert len(json.dumps(body).encode()) == MAX_BODY
    response = await client.post(CHAT, content=json.dumps(body).encode(), headers=JSON_HEADERS)
    assert response.status_code == 200, response.text
    assert len(upstream.requests(CHAT)) == 1


# -- conversation ids ----------------------------------------------------------------------

BAD_IDS = {
    "too long": "c" * 129,
    "space and bang": "my conv!",
    "slash": "conv/1",
    "empty": "",
    "percent": "conv%201",
    "dot": ".",
    "dot dot": "..",
}


@pytest.mark.parametrize("conversation", BAD_IDS.values(), ids=BAD_IDS.keys())
async def test_bad_conversation_id_is_400(
    client: httpx.AsyncClient, refused: _Refused, conversation: str
) -> None:
    body = {"model": "m", "messages": _user()}
    error = await refused(
        400,
        lambda: client.post(CHAT, json=body, headers={"X-Memstrata-Conversation": conversation}),
    )
    assert error["param"] == "X-Memstrata-Conversation"


async def test_a_turn_larger_than_the_budget_is_400_and_stores_nothing(
    client: httpx.AsyncClient, refused: _Refused, upstream: UpstreamServer
) -> None:
    conversation = f"budget-{uuid.uuid4().hex}"
    headers = {"X-Memstrata-Conversation": conversation}
    first = await client.post(CHAT, json={"model": "m", "messages": _user()}, headers=headers)
    assert first.status_code == 200, first.text
    upstream.reset()
    big = " ".join(f"word{i}" for i in range(400))
    tight = {**headers, "X-Memstrata-Budget": "200"}
    error = await refused(
        400, lambda: client.post(CHAT, json={"model": "m", "messages": _user(big)}, headers=tight)
    )
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "200" in error["message"]
    # The same turn within a budget that holds it is stored and answered.
    response = await client.post(CHAT, json={"model": "m", "messages": _user(big)}, headers=headers)
    assert response.status_code == 200, response.text


async def test_an_unknown_model_may_ask_for_more_output_than_the_assumed_window(
    client: httpx.AsyncClient, upstream: UpstreamServer
) -> None:
    # A model the gateway has no limits for (served through LiteLLM, vLLM, Ollama ...) may have
    # a far larger window than MEMSTRATA_CONTEXT_WINDOW guesses: its client knows, the upstream
    # judges. Counted against the guess, this max_tokens left no budget and was refused here.
    upstream.reset()
    for field in ("max_tokens", "max_completion_tokens"):
        body = {"model": "claude-sonnet-x", "messages": _user(), field: 64_000}
        response = await client.post(CHAT, json=body)
        assert response.status_code == 200, response.text
    sent = [request["body"] for request in upstream.requests("/v1/chat/completions")]
    assert [sent[0].get("max_tokens"), sent[1].get("max_completion_tokens")] == [64_000, 64_000]


async def test_longest_valid_conversation_id_is_accepted(client: httpx.AsyncClient) -> None:
    conversation = ("A-z0.9_:" + uuid.uuid4().hex) * 8
    conversation = conversation[:128]
    response = await client.post(
        CHAT,
        json={"model": "m", "messages": _user()},
        headers={"X-Memstrata-Conversation": conversation},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-memstrata-conversation"] == conversation


# -- admin ---------------------------------------------------------------------------------


async def test_admin_refuses_non_loopback_clients(
    client: httpx.AsyncClient, gateway: InProcess
) -> None:
    conversation = f"admin-{uuid.uuid4().hex}"
    created = await client.post(
        CHAT,
        json={"model": "m", "messages": _user()},
        headers={"X-Memstrata-Conversation": conversation},
    )
    assert created.status_code == 200
    path = f"/admin/conversations/{conversation}/messages"
    assert (await client.get(path)).status_code == 200
    async with gateway.client(host="10.0.0.5") as remote:
        error = _assert_openai_error(await remote.get(path), 403)
        assert error["type"] == "permission_error"
        # Unknown conversations are refused the same way: nothing is revealed.
        _assert_openai_error(await remote.get("/admin/conversations/nope/messages"), 403)


async def test_admin_unknown_conversation_is_404(client: httpx.AsyncClient) -> None:
    response = await client.get(f"/admin/conversations/unknown-{uuid.uuid4().hex}/messages")
    error = _assert_openai_error(response, 404)
    assert error["type"] == "not_found_error"


async def test_admin_bad_conversation_id_is_400(client: httpx.AsyncClient) -> None:
    _assert_openai_error(await client.get(f"/admin/conversations/{'c' * 129}/messages"), 400)
    for dots in ("..%2E", "%2E%2E%2E"):  # ids of dots alone, which URLs would resolve
        response = await client.get(f"/admin/conversations/{dots}/messages")
        assert response.status_code in (400, 404), dots


# -- hostile input found by the fault and fuzz runs (each a 500 once) ----------------------

VALID = b'"model": "m", "messages": [{"role": "user", "content": "x"}]'
HOSTILE = {
    # A lone surrogate in a field passed through upstream cannot be encoded to UTF-8.
    "surrogate in metadata": b"{" + VALID + b', "metadata": {"k": "\\ud800"}}',
    "surrogate in stop": b"{" + VALID + b', "stop": ["\\udfff"]}',
    "surrogate in a key": b"{" + VALID + b', "metadata": {"\\ud800": "v"}}',
    "upper-case surrogate escape": b"{" + VALID + b', "metadata": {"k": "\\uDBFF"}}',
    # Finite in JSON's grammar, infinite as a double.
    "1e400": b"{" + VALID + b', "temperature": 1e400}',
    "-1e400": b"{" + VALID + b', "top_p": -1e400}',
    # An unpaired surrogate as raw (CESU-8) bytes rather than an escape: the parser's UTF-8
    # decoding let it through, and no escape sent the body down the full check.
    "surrogate as raw bytes": (
        b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    ),
    # UTF-16 and UTF-32 (which the parser detects) hide the escapes from that check too.
    "utf-16 surrogate escape": json.dumps({"model": "m", "messages": _user("a\ud800")}).encode(
        "utf-16-le"
    ),
    "utf-32 NUL escape": json.dumps({"model": "m", "messages": _user("a\u0000")}).encode("utf-32"),
    # The model is stored with the reply: with a NUL in it the reply could not be, and was
    # dropped from memory while the client got its answer.
    "NUL in model": b'{"model": "m\\u0000x", "messages": [{"role": "user", "content": "x"}]}',
    # Nesting: 1,000 levels raised RecursionError; the documented limit is 64.
    "1000 levels": b"{" + VALID + b', "metadata": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    "65 levels": b"{" + VALID + b', "x": ' + b"[" * 64 + b"]" * 64 + b"}",
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
async def test_hostile_bodies_are_400_before_anything_is_stored(
    client: httpx.AsyncClient, refused: _Refused, raw: bytes
) -> None:
    error = await refused(400, lambda: client.post(CHAT, content=raw, headers=JSON_HEADERS))
    assert error["code"] in ("invalid_value", "invalid_json")


async def test_a_legacy_function_call_history_is_accepted(
    client: httpx.AsyncClient, upstream: UpstreamServer
) -> None:
    """OpenAI's assistant message needs content "unless tool_calls or function_call is
    specified": one with the deprecated `function_call` and no content was refused with 400."""
    messages = [
        *_user(f"weather {uuid.uuid4().hex}"),
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    response = await client.post(CHAT, json={"model": "m", "messages": messages})
    assert response.status_code == 200, response.text
    (sent,) = upstream.requests(CHAT)
    assert sent["body"]["messages"] == messages


async def test_tool_call_arguments_nested_deeper_than_the_parser_goes_are_accepted(
    client: httpx.AsyncClient,
) -> None:
    """Arguments are a string, compared as parsed JSON where they parse: 1,800 levels of
    nesting in them made the parser raise RecursionError, a 500 (the body's own nesting limit
    does not reach inside a string). They are compared as written, as unparsable ones are."""
    deep = "[" * 1800 + "]" * 1800  # within MAX_BODY, past the parser's recursion limit
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [
        *_user(f"deep {uuid.uuid4().hex}"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    response = await client.post(CHAT, json={"model": "m", "messages": messages})
    assert response.status_code == 200, response.text
    items = [
        {"role": "user", "content": f"deep {uuid.uuid4().hex}"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]
    response = await client.post("/v1/responses", json={"model": "m", "input": items})
    assert response.status_code == 200, response.text


# Fields the gateway does not check are the upstream's to judge, whatever their shape.
ODD_TOOLS = {
    "name an object": [{"type": "function", "function": {"name": {"a": 1}}}],
    "name a list": [{"type": "function", "function": {"name": ["memory_search"]}}],
}


@pytest.mark.parametrize("tools", ODD_TOOLS.values(), ids=ODD_TOOLS.keys())
async def test_odd_client_tools_are_forwarded_not_a_500(
    client: httpx.AsyncClient, upstream: UpstreamServer, tools: list[dict[str, Any]]
) -> None:
    """Checking the client's tool names against the memory tools' hashed each name: a name
    that is not a string (unhashable) was a 500 before anything went upstream."""
    body = {"model": "m", "messages": _user(f"tools {uuid.uuid4().hex}"), "tools": tools}
    response = await client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    (sent,) = upstream.requests(CHAT)
    assert sent["body"]["tools"] == tools


async def test_text_that_only_looks_unstorable_is_accepted(client: httpx.AsyncClient) -> None:
    """Escapes of other characters, a surrogate pair (an emoji) and a backslash before "u0000"
    are text Postgres holds: read whole (the escapes send the body down the full check) and
    accepted, as a body without escapes is."""
    for content in ("caf\\u00e9 \\ud83d\\ude00 \\\\u0000 and \\\\ud800", "plain text"):
        raw = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % content.encode()
        response = await client.post(CHAT, content=raw, headers=JSON_HEADERS)
        assert response.status_code == 200, (content, response.text)


async def test_64_levels_of_nesting_are_accepted(client: httpx.AsyncClient) -> None:
    raw = b"{" + VALID + b', "x": ' + b"[" * 63 + b"]" * 63 + b"}"
    response = await client.post(CHAT, content=raw, headers=JSON_HEADERS)
    assert response.status_code == 200, response.text


# Header bytes are read as latin-1: 0xB2 is "²", which `str.isdigit` accepts and `int` refuses.
BAD_BUDGETS = {
    "superscript two": "²".encode("latin-1"),
    "superscripts": "1²³".encode("latin-1"),
    "100,000 digits": b"9" * 100_000,
}


@pytest.mark.parametrize("budget", BAD_BUDGETS.values(), ids=BAD_BUDGETS.keys())
async def test_budget_header_of_other_digits_is_400(
    client: httpx.AsyncClient, refused: _Refused, budget: bytes
) -> None:
    body = {"model": "m", "messages": _user()}
    headers = {b"X-Memstrata-Budget": budget}
    error = await refused(400, lambda: client.post(CHAT, json=body, headers=headers))
    assert error["param"] == "X-Memstrata-Budget"


@pytest.mark.parametrize("path", [CHAT, "/v1/embeddings", "/admin/conversations/ct/messages"])
async def test_a_body_that_is_not_json_is_415_everywhere(
    client: httpx.AsyncClient, refused: _Refused, path: str
) -> None:
    body = json.dumps({"model": "m", "messages": _user(), "input": "x"})
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        send = functools.partial(client.post, path, content=body, headers={"content-type": media})
        error = await refused(415, send)
        assert (error["code"], error["param"]) == ("unsupported_media_type", "Content-Type")
    for media in ("application/json; charset=utf-8", "application/merge-patch+json"):
        response = await client.post(CHAT, content=body, headers={"content-type": media})
        assert response.status_code == 200, (media, response.text)


# -- other routes --------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["", "/input_items"])
async def test_a_response_id_postgres_cannot_hold_is_404(
    client: httpx.AsyncClient, suffix: str
) -> None:
    """A NUL in a response id (`%00` in the path) was sent to Postgres, which refused the text:
    a 500. No stored response has such an id."""
    response = await client.get(f"/v1/responses/resp_a%00b{suffix}")
    error = _assert_openai_error(response, 404)
    assert error["code"] == "not_found"


async def test_unknown_route_is_404_openai_shape(client: httpx.AsyncClient) -> None:
    _assert_openai_error(await client.get("/v1/nothing-here"), 404)


async def test_wrong_method_is_405_openai_shape(client: httpx.AsyncClient) -> None:
    # Not a /v1 path: every method of those is the upstream's to answer (GET /v1/chat/completions
    # lists OpenAI's stored completions), so they are relayed.
    response = await client.post("/healthz")
    _assert_openai_error(response, 405)
    assert response.headers["allow"] == "GET"


async def test_healthz_and_readyz(client: httpx.AsyncClient) -> None:
    healthz = await client.get("/healthz")
    assert (healthz.status_code, healthz.json()) == (200, {"status": "ok"})
    readyz = await client.get("/readyz")
    assert (readyz.status_code, readyz.json()) == (200, {"status": "ok", "database": "ok"})


async def test_readyz_answers_503_when_the_database_is_unreachable(gateway: InProcess) -> None:
    unreachable = connect(f"postgresql+asyncpg://nobody@127.0.0.1:{free_port()}/none")
    try:
        state = dataclasses.replace(gateway.state, engine=unreachable)
        async with gateway.client(state=state) as http:
            healthz = await http.get("/healthz")
            readyz = await http.get("/readyz")
    finally:
        await unreachable.dispose()
    assert healthz.status_code == 200  # the process is up ...
    assert readyz.status_code == 503  # ... but not ready
    assert readyz.json()["status"] == "unavailable"


async def test_too_many_messages_is_413_before_anything_is_stored(
    database_url: str, engine: AsyncEngine, upstream: UpstreamServer
) -> None:
    settings = Settings(
        database_url=database_url, upstream_base_url=upstream.url, workers=0, max_messages=3
    )
    async with running_app(settings) as app, app.client() as client:
        refused = _Refused(engine, app.state, upstream)
        for count in (4, 7):  # over the limit; over twice the limit (refused unparsed)
            body = {"model": "m", "messages": _user() * count}
            error = await refused(413, functools.partial(client.post, CHAT, json=body))
            assert (error["code"], error["param"]) == ("too_many_messages", "messages")
        response = await client.post(CHAT, json={"model": "m", "messages": _user() * 3})
        assert response.status_code == 200, response.text
