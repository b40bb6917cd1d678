"""The memory tools over MCP (`/mcp`), through the official `mcp` SDK's client against a real
`memstrata serve` process.

Conversations are filled through the chat API (the fake upstream answers), so the MCP tools
read what a real client stored. Tenants: one gateway runs with `MEMSTRATA_AUTH=on`, and two
tenants' keys (created in the database with `memory.write.tenants`) must each see their own
conversations only, while a missing or wrong key is refused before any MCP processing.
"""

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from memory.write import tenants

HEADER = "X-Memstrata-Conversation"
TOOL_NAMES = ["memory_expand", "memory_search", "memory_browse", "memory_find", "memory_stats"]


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=0,
        auth="on",
        upstream_api_key="sk-upstream",
    ) as process:
        yield process


@pytest.fixture(scope="module")
async def keys(engine: AsyncEngine) -> tuple[str, str]:
    """Gateway keys of two fresh tenants."""
    made = []
    async with engine.begin() as conn:
        for _ in range(2):
            tenant = await tenants.create_tenant(conn, name=f"mcp-{uuid.uuid4().hex[:12]}")
            made.append((await tenants.create_key(conn, tenant_id=tenant.id)).secret)
    return made[0], made[1]


@asynccontextmanager
async def connect(
    gateway: GatewayProcess, key: str | None, *, mode: str = "auto"
) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=20) as http,
        Client(
            streamable_http_client(f"{gateway.root_url}/mcp", http_client=http),
            mode=mode,
        ) as client,
    ):
        yield client


async def chat(gateway: GatewayProcess, key: str, conversation: str, text: str) -> None:
    async with httpx.AsyncClient(timeout=20) as http:
        response = await http.post(
            f"{gateway.url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": text}]},
            headers={"Authorization": f"Bearer {key}", HEADER: conversation},
        )
    assert response.status_code == 200, response.text


def text(result: types.CallToolResult) -> str:
    [block] = result.content
    assert isinstance(block, types.TextContent)
    return block.text


def ids(found: str) -> list[int]:
    return [int(node) for node in re.findall(r"\[#(\d+)\]", found)]


@pytest.fixture(scope="module")
async def conversation(gateway: GatewayProcess, keys: tuple[str, str]) -> str:
    """A conversation of the first tenant: three user messages, three echoed replies."""
    name = f"mcp-{uuid.uuid4().hex}"
    for line in ("Book flight LX318 to Zurich.", "Hotel near the lake.", "Tomatoes turn yellow."):
        await chat(gateway, keys[0], name, line)
    return name


# -- the tools -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "legacy"])  # the 2026 protocol, and the handshake
async def test_lists_five_tools_taking_a_conversation(
    gateway: GatewayProcess, keys: tuple[str, str], conversation: str, mode: str
) -> None:
    async with connect(gateway, keys[0], mode=mode) as client:
        listed = await client.list_tools()
        stats = await client.call_tool("memory_stats", {"conversation": conversation})
    assert not stats.is_error
    assert [tool.name for tool in listed.tools] == TOOL_NAMES
    for tool in listed.tools:
        assert tool.input_schema["required"][0] == "conversation"
        assert tool.description
        assert tool.annotations is not None and tool.annotations.read_only_hint


async def test_browse_find_expand_and_stats(
    gateway: GatewayProcess, keys: tuple[str, str], conversation: str
) -> None:
    async with connect(gateway, keys[0]) as client:
        browsed = await client.call_tool(
            "memory_browse", {"conversation": conversation, "level": 0}
        )
        found = await client.call_tool(
            "memory_find", {"conversation": conversation, "pattern": r"LX\d+", "end_seq": 0}
        )
        stats = await client.call_tool("memory_stats", {"conversation": conversation})
        searched = await client.call_tool(
            "memory_search", {"conversation": conversation, "query": "tomatoes", "limit": 2}
        )
        nodes = ids(text(browsed))
        expanded = await client.call_tool(
            "memory_expand", {"conversation": conversation, "node_id": nodes[2]}
        )

    assert not browsed.is_error
    assert text(browsed).startswith("messages 0-5:")
    assert len(nodes) == 6
    assert "user: Book flight LX318 to Zurich." in text(browsed)
    assert "assistant: echo: Book flight LX318 to Zurich." in text(browsed)
    assert ids(text(found)) == [nodes[0]]
    assert ids(text(expanded)) == [nodes[2], *nodes[0:5]]
    assert nodes[4] in ids(text(searched))
    assert len(ids(text(searched))) <= 2
    assert not stats.is_error
    assert stats.structured_content is not None
    assert json.loads(text(stats)) == stats.structured_content
    assert {
        key: stats.structured_content[key] for key in ("conversation", "messages", "levels")
    } == {"conversation": conversation, "messages": 6, "levels": {"0": 6}}


OURS = "<the conversation>"


@pytest.mark.parametrize(
    ("name", "arguments", "error"),
    [
        ("memory_browse", {"level": 0}, "conversation is required"),
        ("memory_browse", {"conversation": "no such one", "level": 0}, "conversation id"),
        ("memory_browse", {"conversation": "never-stored", "level": 0}, "does not exist"),
        ("memory_expand", {"conversation": OURS, "node_id": 2**62}, f"node {2**62} does not"),
        ("memory_expand", {"conversation": OURS, "node_id": "x"}, "node_id must be an integer"),
        ("memory_find", {"conversation": OURS, "pattern": "(a|aa"}, "not a valid regular"),
        ("memory_nothing", {"conversation": OURS}, "there is no tool 'memory_nothing'"),
    ],
)
async def test_mistakes_are_tool_errors(
    gateway: GatewayProcess,
    keys: tuple[str, str],
    conversation: str,
    name: str,
    arguments: dict[str, Any],
    error: str,
) -> None:
    arguments = {k: conversation if v == OURS else v for k, v in arguments.items()}
    async with connect(gateway, keys[0]) as client:
        result = await client.call_tool(name, arguments)
    assert result.is_error
    assert error in text(result)


async def test_a_search_for_a_megabyte_of_words_is_answered(
    gateway: GatewayProcess, keys: tuple[str, str], conversation: str
) -> None:
    """A query of a megabyte of distinct words is read from its start: Postgres refused its
    search vector, and the call failed as a protocol error."""
    query = "tomatoes " + " ".join(f"w{i:07d}" for i in range(120_000))
    async with connect(gateway, keys[0]) as client:
        result = await client.call_tool(
            "memory_search", {"conversation": conversation, "query": query}
        )
    assert not result.is_error, text(result)
    assert "tomatoes" in text(result)


# -- tenants -------------------------------------------------------------------------------


async def test_another_tenant_sees_nothing(
    gateway: GatewayProcess, keys: tuple[str, str], conversation: str
) -> None:
    async with connect(gateway, keys[0]) as mine:
        browsed = await mine.call_tool("memory_browse", {"conversation": conversation, "level": 0})
    node = ids(text(browsed))[0]
    # The second tenant has a conversation of the same name, and cannot reach the first's.
    await chat(gateway, keys[1], conversation, "Something else entirely.")
    async with connect(gateway, keys[1]) as theirs:
        expanded = await theirs.call_tool(
            "memory_expand", {"conversation": conversation, "node_id": node}
        )
        found = await theirs.call_tool(
            "memory_find", {"conversation": conversation, "pattern": "LX318"}
        )
        stats = await theirs.call_tool("memory_stats", {"conversation": conversation})
    assert expanded.is_error and text(expanded) == f"node {node} does not exist"
    assert text(found) == "0 messages match 'LX318'."
    assert stats.structured_content is not None
    assert stats.structured_content["messages"] == 2


def test_a_missing_or_unknown_key_is_refused(gateway: GatewayProcess) -> None:
    for key in (None, "msk-" + "x" * 43):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(
            f"{gateway.root_url}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={**headers, "Accept": "application/json, text/event-stream"},
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_no_stream_to_get_and_no_session_to_delete(
    gateway: GatewayProcess, keys: tuple[str, str]
) -> None:
    for method in ("GET", "DELETE"):
        response = httpx.request(
            method,
            f"{gateway.root_url}/mcp",
            headers={"Authorization": f"Bearer {keys[0]}", "Accept": "text/event-stream"},
            timeout=5,
        )
        assert response.status_code == 405
