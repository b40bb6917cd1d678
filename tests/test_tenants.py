"""Two tenants end to end: nothing of one ever reaches the other.

A real `memstrata serve` with `MEMSTRATA_AUTH=on` and an admin token. The admin API creates two
tenants and their keys; each tenant chats (stream and not), its conversations get summary
trees, and then every read a tenant or an operator can make (the admin API scoped to the other
tenant, search, the context dry run, the memory tools in the chat loop, MCP) is checked to see
nothing of the other. Both tenants use the same conversation id and the same OpenAI `user`, so
a lookup that forgot the tenant would find the other's. Keys: missing, malformed, unknown and
revoked keys are refused, a revoked one from the very next request. The admin API refuses
non-loopback clients when no admin token is set (in-process, posing as a remote client).
"""

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from memory.build import tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer
from memory.embeddings import make_embedder
from memory.schema import conversations, tenants
from tests.inprocess import running_app

CHAT = "/v1/chat/completions"
HEADER = "X-Memstrata-Conversation"
SHARED = "shared-conversation"
USER = "pat"
ADMIN_TOKEN = "admin-" + uuid.uuid4().hex
UPSTREAM_KEY = "sk-upstream-" + uuid.uuid4().hex


@dataclass
class Tenant:
    name: str
    key: str
    secret: str  # a word only this tenant ever wrote

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(autouse=True)
def _fresh(upstream: UpstreamServer) -> None:
    upstream.reset()


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=0,
        auth="on",
        admin_token=ADMIN_TOKEN,
        upstream_api_key=UPSTREAM_KEY,
        memory_tools="never",
    ) as process:
        yield process


@pytest.fixture(scope="module")
def admin(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"{gateway.root_url}/admin",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=30,
    ) as client:
        yield client


def chat(
    gateway: GatewayProcess,
    tenant: Tenant,
    text: str,
    *,
    conversation: str = SHARED,
    stream: bool = False,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    body = {
        "model": "gpt-4o",
        "user": USER,
        "stream": stream,
        "messages": [{"role": "user", "content": text}],
    }
    response = httpx.post(
        f"{gateway.url}/chat/completions",
        json=body,
        headers={**tenant.auth, HEADER: conversation, **(headers or {})},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response


async def build_trees(engine: AsyncEngine, names: list[str]) -> None:
    """Summary trees for every conversation of these tenants, as a worker would build them."""
    config = tree.TreeConfig(
        embedder=make_embedder(provider="local"),
        summarizer=ExtractiveSummarizer("gpt-4o"),
        policy=SegmentPolicy(shift_threshold=2.0, max_messages=2),
    )
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(conversations.c.id, conversations.c.tenant_id)
                .join(tenants, tenants.c.id == conversations.c.tenant_id)
                .where(tenants.c.name.in_(names))
            )
        ).all()
    for row in rows:
        await tree.build(
            engine, tenant_id=row.tenant_id, conversation_id=row.id, config=config, final=True
        )


@pytest.fixture(scope="module")
async def pair(
    gateway: GatewayProcess, admin: httpx.Client, engine: AsyncEngine
) -> AsyncIterator[tuple[Tenant, Tenant]]:
    made = []
    for _ in range(2):
        name = f"iso-{uuid.uuid4().hex[:10]}"
        created = await asyncio.to_thread(admin.post, "/tenants", json={"name": name})
        assert created.status_code == 201
        key = (
            await asyncio.to_thread(admin.post, f"/tenants/{name}/keys", json={"name": "app"})
        ).json()["key"]
        made.append(Tenant(name, key, f"zq{uuid.uuid4().hex[:10]}"))
    first, second = made
    for tenant in made:
        chat(gateway, tenant, f"My locker code is {tenant.secret}, keep it safe.")
        chat(gateway, tenant, f"The password hint is {tenant.secret} too.", stream=True)
        chat(gateway, tenant, "Another thread of mine.", conversation=f"own-{tenant.name}")
    await build_trees(engine, [first.name, second.name])
    yield first, second
    # Gone at the end, with the jobs they queued (other modules' workers would run them).
    for tenant in made:
        deleted = await asyncio.to_thread(admin.delete, f"/tenants/{tenant.name}")
        assert deleted.status_code == 200


# -- keys ------------------------------------------------------------------------------------


def test_upstream_gets_the_gateway_key_never_the_client_key(
    gateway: GatewayProcess, pair: tuple[Tenant, Tenant], upstream: UpstreamServer
) -> None:
    first, _ = pair
    chat(gateway, first, "hello", conversation=f"misc-{uuid.uuid4().hex}")
    [sent] = upstream.requests(CHAT)
    assert sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert first.key not in json.dumps(sent)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer", "Basic abc", "Bearer sk-not-a-gateway-key", f"Bearer msk-{'x' * 43}"],
    ids=["missing", "empty", "basic", "provider key", "unknown key"],
)
def test_bad_keys_are_401_and_reach_nothing(
    gateway: GatewayProcess, upstream: UpstreamServer, authorization: str | None
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    for method, path, body in (
        ("POST", CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/embeddings", {"model": "e", "input": "x"}),
        ("POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
    ):
        response = httpx.request(
            method, f"{gateway.root_url}{path}", json=body, headers=headers, timeout=10
        )
        assert response.status_code == 401, (path, response.text)
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert response.headers["www-authenticate"] == "Bearer"
        if authorization and " " in authorization:
            assert authorization.split()[-1] not in response.text
    assert upstream.requests() == []


async def test_a_revoked_key_fails_at_once(
    gateway: GatewayProcess, admin: httpx.Client, pair: tuple[Tenant, Tenant]
) -> None:
    first, _ = pair
    made = await asyncio.to_thread(
        lambda: admin.post(f"/tenants/{first.name}/keys", json={"name": "short-lived"}).json()
    )
    doomed = Tenant(first.name, made["key"], first.secret)
    misc = f"misc-{uuid.uuid4().hex}"
    await asyncio.to_thread(chat, gateway, doomed, "still fine", conversation=misc)
    async with mcp_client(gateway, doomed) as client:
        assert (await client.list_tools()).tools

    revoked = await asyncio.to_thread(admin.delete, f"/tenants/{first.name}/keys/{made['id']}")
    assert revoked.status_code == 200
    async with httpx.AsyncClient(timeout=10, headers=doomed.auth) as http:
        refused = await http.post(
            f"{gateway.url}/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "after"}]},
        )
        assert refused.status_code == 401
        mcp = await http.post(
            f"{gateway.root_url}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={"Accept": "application/json, text/event-stream"},
        )
        assert mcp.status_code == 401
    await asyncio.to_thread(chat, gateway, first, "its other key works", conversation=misc)


# -- every admin read, scoped to the other tenant --------------------------------------------


def node_ids(admin: httpx.Client, tenant: Tenant) -> set[int]:
    """Every node (message or summary) of the tenant, as the admin API lists them."""
    scope = {"tenant": tenant.name}
    found: set[int] = set()
    for conversation in admin.get("/conversations", params=scope).json()["data"]:
        name = conversation["conversation"]
        messages = admin.get(f"/conversations/{name}/messages", params=scope).json()
        found |= {message["node_id"] for message in messages["messages"]}
        tree = admin.get(f"/conversations/{name}/hierarchy", params=scope).json()
        found |= {node["id"] for node in tree["nodes"]}
    return found


def test_admin_reads_never_cross_tenants(admin: httpx.Client, pair: tuple[Tenant, Tenant]) -> None:
    for me, other in (pair, pair[::-1]):
        mine = {"tenant": me.name}
        listed = admin.get("/conversations", params=mine).json()["data"]
        names = {c["conversation"] for c in listed}
        assert {SHARED, f"own-{me.name}"} <= names and f"own-{other.name}" not in names
        stats = admin.get(f"/conversations/{SHARED}", params=mine).json()
        assert (stats["messages"], stats["requests"]) == (4, 2)
        assert admin.get(f"/conversations/own-{other.name}", params=mine).status_code == 404

        messages = admin.get(f"/conversations/{SHARED}/messages", params=mine).json()["messages"]
        texts = json.dumps(messages)
        assert me.secret in texts and other.secret not in texts

        tree = admin.get(f"/conversations/{SHARED}/hierarchy", params=mine).json()
        assert tree["levels"]["1"] >= 1 and other.secret not in json.dumps(tree)
        exported = admin.get(f"/conversations/{SHARED}/export", params=mine).text
        assert me.secret in exported and other.secret not in exported

        # Hybrid search always finds neighbours, but only among the tenant's own nodes.
        found = admin.get("/search", params={**mine, "q": other.secret}).json()["data"]
        assert other.secret not in json.dumps(found)
        assert {hit["node_id"] for hit in found} <= node_ids(admin, me)
        assert not {hit["node_id"] for hit in found} & node_ids(admin, other)
        hits = admin.get("/search", params={**mine, "q": me.secret}).json()["data"]
        assert hits and all(hit["conversation"] != f"own-{other.name}" for hit in hits)

        context = admin.post(
            f"/conversations/{SHARED}/context", params=mine, json={"query": other.secret}
        ).json()
        *memory, question = context["messages"]
        assert question["content"] == other.secret
        assert me.secret in json.dumps(memory) and other.secret not in json.dumps(memory)

        jobs = admin.get("/jobs", params=mine).json()
        assert jobs["jobs"] and other.secret not in json.dumps(jobs)

        # The other tenant's ids behave as missing: nodes, jobs, keys, conversations.
        theirs = {"tenant": other.name}
        their_messages = admin.get(f"/conversations/{SHARED}/messages", params=theirs).json()
        for message in their_messages["messages"]:
            assert admin.get(f"/nodes/{message['node_id']}", params=mine).status_code == 404
        their_tree = admin.get(f"/conversations/{SHARED}/hierarchy", params=theirs).json()
        for node in their_tree["nodes"]:
            assert admin.get(f"/nodes/{node['id']}", params=mine).status_code == 404
        for job in admin.get("/jobs", params=theirs).json()["jobs"]:
            assert admin.post(f"/jobs/{job['id']}/retry", params=mine).status_code == 404
        for key in admin.get(f"/tenants/{other.name}/keys").json()["data"]:
            assert admin.delete(f"/tenants/{me.name}/keys/{key['id']}").status_code == 404
        assert admin.delete(f"/conversations/own-{other.name}", params=mine).status_code == 404
        assert (
            admin.post(f"/conversations/own-{other.name}/compact", params=mine).status_code == 404
        )


def test_the_default_tenant_sees_neither(admin: httpx.Client, pair: tuple[Tenant, Tenant]) -> None:
    for tenant in pair:
        assert admin.get(f"/conversations/own-{tenant.name}").status_code == 404
        found = admin.get("/search", params={"q": tenant.secret}).json()["data"]
        assert not {hit["node_id"] for hit in found} & node_ids(admin, tenant)


# -- the chat path: prompts and memory tools --------------------------------------------------


def _memory_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call = {"id": f"call-{uuid.uuid4().hex[:8]}", "name": name, "arguments": arguments}
    return {"tool_calls": [call]}


def without_echo(result: str) -> str:
    """A tool's result without its first line, which repeats the query or pattern."""
    return result.split("\n", 1)[1] if "\n" in result else ""


def cited(result: str) -> list[int]:
    """The node ids a tool result shows (`[#id]`)."""
    return [int(node) for node in re.findall(r"\[#(\d+)\]", result)]


@pytest.fixture(scope="module")
def tool_gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url,
        upstream_url=upstream.url,
        workers=0,
        auth="on",
        upstream_api_key=UPSTREAM_KEY,
        memory_tools="always",
    ) as process:
        yield process


def test_memory_tools_in_the_chat_loop_read_only_the_tenants_memory(
    tool_gateway: GatewayProcess,
    admin: httpx.Client,
    pair: tuple[Tenant, Tenant],
    upstream: UpstreamServer,
) -> None:
    for me, other in (pair, pair[::-1]):
        for call in (
            _memory_call("memory_search", {"query": other.secret, "limit": 10}),
            _memory_call("memory_find", {"pattern": other.secret}),
            _memory_call("memory_search", {"query": me.secret, "limit": 10}),
        ):
            upstream.reset()
            upstream.script(call)
            chat(tool_gateway, me, "Look it up.", conversation=f"own-{me.name}")
            first, second = upstream.requests(CHAT)
            assert any(t["function"]["name"] == "memory_search" for t in first["body"]["tools"])
            [result] = [m for m in second["body"]["messages"] if m["role"] == "tool"]
            shown = without_echo(result["content"])
            assert other.secret not in shown
            assert not set(cited(shown)) & node_ids(admin, other)
            if me.secret in json.dumps(call):  # control: the tenant's own memory is found
                assert me.secret in shown and cited(shown)


# -- MCP ------------------------------------------------------------------------------------


@asynccontextmanager
async def mcp_client(gateway: GatewayProcess, tenant: Tenant) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(headers=tenant.auth, timeout=20) as http,
        Client(streamable_http_client(f"{gateway.root_url}/mcp", http_client=http)) as client,
    ):
        yield client


def _text(result: types.CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, types.TextContent))


async def test_mcp_reads_only_the_tenants_memory(
    gateway: GatewayProcess, admin: httpx.Client, pair: tuple[Tenant, Tenant]
) -> None:
    for me, other in (pair, pair[::-1]):
        theirs = await asyncio.to_thread(node_ids, admin, other)
        async with mcp_client(gateway, me) as client:
            searched = await client.call_tool(
                "memory_search", {"conversation": SHARED, "query": other.secret}
            )
            shown = without_echo(_text(searched))
            assert other.secret not in shown
            assert not set(cited(shown)) & theirs
            own = await client.call_tool(
                "memory_search", {"conversation": SHARED, "query": me.secret}
            )
            assert me.secret in without_echo(_text(own))
            elsewhere = await client.call_tool(
                "memory_stats", {"conversation": f"own-{other.name}"}
            )
            assert elsewhere.is_error and "does not exist" in _text(elsewhere)
            expanded = await client.call_tool(
                "memory_expand", {"conversation": SHARED, "node_id": min(theirs)}
            )
            assert expanded.is_error and other.secret not in _text(expanded)


# -- logs ------------------------------------------------------------------------------------


def test_no_key_and_no_content_in_the_logs(
    gateway: GatewayProcess, pair: tuple[Tenant, Tenant]
) -> None:
    logs = gateway.logs()
    assert "memstrata.access" in logs
    for tenant in pair:
        assert tenant.key not in logs
        assert tenant.key[4:20] not in logs
        assert tenant.secret not in logs
    assert ADMIN_TOKEN not in logs and UPSTREAM_KEY not in logs


# -- prompts rebuilt from memory ----------------------------------------------------------


# Last: its questions name the other tenant's secret, and are stored in the asking tenant.
def test_rebuilt_prompts_hold_only_the_tenants_own_memory(
    gateway: GatewayProcess, pair: tuple[Tenant, Tenant], upstream: UpstreamServer
) -> None:
    filler = " ".join(
        f"Unrelated planning note number {n} about the weekly schedule." for n in range(40)
    )
    for me, other in (pair, pair[::-1]):
        upstream.reset()
        ask = f"ask-{me.name}"
        chat(gateway, me, filler, conversation=ask)
        # The history no longer fits this budget: the prompt is rebuilt from memory, with
        # search over the tenant's conversations of the same user.
        response = chat(
            gateway,
            me,
            f"What was the code, {other.secret} or {me.secret}?",
            conversation=ask,
            headers={"X-Memstrata-Budget": "300"},
        )
        assert int(response.headers["x-memstrata-context-tokens"]) < int(
            response.headers["x-memstrata-full-tokens"]
        )
        sent = upstream.requests(CHAT)[-1]
        prompt = json.dumps(sent["body"]["messages"])
        assert prompt.count(other.secret) == 1  # only in the question itself
        assert prompt.count(me.secret) > 1  # recalled from the tenant's other conversation


# -- the admin API without a token -----------------------------------------------------------


async def test_admin_without_token_refuses_non_loopback_clients(
    database_url: str, upstream: UpstreamServer
) -> None:
    settings = Settings(database_url=database_url, upstream_base_url=upstream.url, workers=0)
    async with running_app(settings) as app:
        for host in ("10.0.0.5", "192.168.1.20", "2001:db8::1", "testclient"):
            async with app.client(host=host) as remote:
                for path in ("/admin/tenants", "/admin/jobs", "/admin/conversations/x"):
                    response = await remote.get(path)
                    assert response.status_code == 403, (host, path)
                    assert response.json()["error"]["type"] == "permission_error"
                # A token does not help while none is configured.
                with_token = await remote.get(
                    "/admin/tenants", headers={"Authorization": "Bearer whatever-it-is-123"}
                )
                assert with_token.status_code == 403
        for host in ("127.0.0.1", "::1"):
            async with app.client(host=host) as local:
                assert (await local.get("/admin/tenants")).status_code == 200


async def test_admin_without_token_needs_a_loopback_host(
    database_url: str, upstream: UpstreamServer
) -> None:
    """DNS rebinding: a page whose name resolves to 127.0.0.1 reaches loopback, but its
    browser names the page's own host; only loopback names are let in."""
    settings = Settings(database_url=database_url, upstream_base_url=upstream.url, workers=0)
    async with running_app(settings) as app, app.client(host="127.0.0.1") as local:
        for host in ("localhost", "localhost:8080", "127.0.0.1:9", "[::1]", "[::1]:8080"):
            response = await local.get("/admin/tenants", headers={"Host": host})
            assert response.status_code == 200, host
        for host in ("evil.example", "evil.example:8080", "127.0.0.1.nip.io", "localhost.evil"):
            for path in ("/admin/tenants", "/metrics"):
                response = await local.get(path, headers={"Host": host})
                assert response.status_code == 403, (host, path)
                assert response.json()["error"]["code"] == "admin_forbidden"


async def test_proxy_headers_count_only_from_trusted_proxies(
    database_url: str, upstream: UpstreamServer
) -> None:
    base: dict[str, Any] = {
        "database_url": database_url,
        "upstream_base_url": upstream.url,
        "workers": 0,
    }
    forwarded_remote = [
        {"X-Forwarded-For": "203.0.113.9"},
        {"X-Real-IP": "203.0.113.9"},
        {"Forwarded": 'for="203.0.113.9:5555";proto=https'},
    ]
    async with running_app(Settings(**base)) as app, app.client(host="127.0.0.1") as local:
        # A local proxy relaying a remote client, not declared: refused, whatever it says.
        for headers in [*forwarded_remote, {"X-Forwarded-For": "127.0.0.1"}]:
            assert (await local.get("/admin/tenants", headers=headers)).status_code == 403
    trusted = Settings(**base, trusted_proxies="127.0.0.1, 10.0.0.0/8")
    async with running_app(trusted) as app:
        async with app.client(host="10.1.2.3") as proxy:
            for headers in forwarded_remote:
                assert (await proxy.get("/admin/tenants", headers=headers)).status_code == 403
            local_client = {"X-Forwarded-For": "203.0.113.9, 127.0.0.1"}
            assert (await proxy.get("/admin/tenants", headers=local_client)).status_code == 200
            forwarded_v6 = {"Forwarded": 'for="[::1]:4711"'}
            assert (await proxy.get("/admin/tenants", headers=forwarded_v6)).status_code == 200
        # Headers from a peer that is not a trusted proxy are ignored.
        async with app.client(host="203.0.113.7") as remote:
            spoofed = {"X-Forwarded-For": "127.0.0.1"}
            assert (await remote.get("/admin/tenants", headers=spoofed)).status_code == 403
