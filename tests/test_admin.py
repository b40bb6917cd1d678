"""The admin API: every endpoint does what README says, within the tenant it is given.

The app runs in-process (`tests.inprocess`) on the session's Postgres with the real fake
upstream; each test makes tenants of its own (`POST /admin/tenants`) and addresses them with
`?tenant=`, so tests never see each other's rows. Summary trees are built by calling
`tree.build` with the extractive summarizer, as a worker would.
"""

import asyncio
import functools
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.service import child_env, memstrata
from devkit.upstream import UpstreamServer
from gateway.settings import Settings
from memory.build import jobs as job_queue
from memory.build import tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer, Summary, SummaryInput
from memory.schema import api_keys, conversations, jobs, nodes
from memory.write import conversations as conversations_store
from memory.write import store
from tests.inprocess import App, running_app

TOPICS = [
    "The invoice INV-2041 for Acme was paid twice; refund 18,400 dollars to the customer.",
    "Refund approved by Priya Raman on 2026-03-14, ticket PAY-3310 closed.",
    "Now the garden: plant tomatoes in the raised bed after the last frost in April.",
    "Water the tomato seedlings every morning and stake them once they reach 30 centimetres.",
]


RUN = uuid.uuid4().hex[:8]


@pytest.fixture(scope="module", autouse=True)
async def _delete_tenants_afterwards(app: App) -> AsyncIterator[None]:
    """This module's tenants go at the end, with the jobs they queued (other modules' workers
    would otherwise run them)."""
    yield
    async with app.client() as admin:
        for tenant in (await admin.get("/admin/tenants")).json()["data"]:
            if tenant["name"].startswith(f"t-{RUN}-"):
                await admin.delete(f"/admin/tenants/{tenant['name']}")


async def new_tenant(admin: httpx.AsyncClient) -> str:
    name = f"t-{RUN}-{uuid.uuid4().hex[:12]}"
    response = await admin.post("/admin/tenants", json={"name": name})
    assert response.status_code == 201, response.text
    return name


async def import_messages(
    admin: httpx.AsyncClient,
    tenant: str,
    conversation: str,
    texts: list[str],
    *,
    user: str | None = None,
    start: datetime | None = None,
) -> dict[str, Any]:
    start = start or datetime(2026, 1, 1, tzinfo=UTC)
    messages = [
        {
            "role": "user" if index % 2 == 0 else "assistant",
            "content": text,
            "created_at": (start + timedelta(minutes=index)).isoformat(),
        }
        for index, text in enumerate(texts)
    ]
    response = await admin.post(
        f"/admin/conversations/{conversation}/messages",
        params={"tenant": tenant},
        json={"messages": messages, **({"user": user} if user else {})},
    )
    assert response.status_code == 201, response.text
    result: dict[str, Any] = response.json()
    return result


async def tenant_id(engine: AsyncEngine, admin: httpx.AsyncClient, tenant: str) -> int:
    found = (await admin.get(f"/admin/tenants/{tenant}")).json()
    return int(found["id"])


async def conversation_row(engine: AsyncEngine, tenant: int, conversation: str) -> int:
    async with engine.connect() as conn:
        found = await conn.scalar(
            select(conversations.c.id).where(
                conversations.c.tenant_id == tenant, conversations.c.external_id == conversation
            )
        )
    assert found is not None
    return int(found)


async def build(app: App, tenant: int, conversation_id: int) -> None:
    config = tree.TreeConfig(
        embedder=app.state.embedder,
        summarizer=ExtractiveSummarizer("gpt-4o"),
        policy=SegmentPolicy(shift_threshold=2.0, max_messages=2),
    )
    await tree.build(
        app.state.engine,
        tenant_id=tenant,
        conversation_id=conversation_id,
        config=config,
        final=True,
    )


# -- OpenAPI -----------------------------------------------------------------------------------

ADMIN_OPERATIONS = {
    ("post", "/admin/tenants"),
    ("get", "/admin/tenants"),
    ("get", "/admin/tenants/{tenant}"),
    ("delete", "/admin/tenants/{tenant}"),
    ("post", "/admin/tenants/{tenant}/keys"),
    ("get", "/admin/tenants/{tenant}/keys"),
    ("delete", "/admin/tenants/{tenant}/keys/{key_id}"),
    ("get", "/admin/conversations"),
    ("get", "/admin/conversations/{conversation}"),
    ("delete", "/admin/conversations/{conversation}"),
    ("get", "/admin/conversations/{conversation}/messages"),
    ("post", "/admin/conversations/{conversation}/messages"),
    ("get", "/admin/conversations/{conversation}/hierarchy"),
    ("get", "/admin/conversations/{conversation}/tree"),
    ("get", "/admin/conversations/{conversation}/export"),
    ("post", "/admin/conversations/{conversation}/compact"),
    ("post", "/admin/conversations/{conversation}/context"),
    ("get", "/admin/nodes/{node_id}"),
    ("get", "/admin/nodes/{node_id}/path"),
    ("get", "/admin/search"),
    ("get", "/admin/jobs"),
    ("post", "/admin/jobs/{job_id}/retry"),
}


async def test_openapi_documents_every_admin_endpoint_with_its_schema(
    admin: httpx.AsyncClient,
) -> None:
    schema = (await admin.get("/openapi.json")).json()
    documented = {
        (method, path)
        for path, operations in schema["paths"].items()
        if path.startswith("/admin")
        for method in operations
    }
    assert documented == ADMIN_OPERATIONS
    for method, path in ADMIN_OPERATIONS:
        operation = schema["paths"][path][method]
        assert operation["summary"], (method, path)
        assert operation["security"] == [{"AdminToken": []}], (method, path)
        [success] = [code for code in operation["responses"] if code.startswith("2")]
        content = operation["responses"][success]["content"]
        [(media_type, body)] = content.items()
        if path.endswith("/export"):
            assert media_type == "application/x-ndjson"
        else:
            assert media_type == "application/json"
            assert body["schema"].get("$ref", "").startswith("#/components/schemas/"), (
                method,
                path,
            )
    docs = await admin.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


# -- tenants and keys ----------------------------------------------------------------------------


async def test_tenants_create_list_get_delete(admin: httpx.AsyncClient) -> None:
    name = await new_tenant(admin)
    duplicate = await admin.post("/admin/tenants", json={"name": name})
    assert duplicate.status_code == 409
    assert duplicate.json()["error"]["type"] == "conflict_error"
    assert (await admin.post("/admin/tenants", json={"name": "no spaces"})).status_code == 400
    listed = (await admin.get("/admin/tenants")).json()["data"]
    assert name in [tenant["name"] for tenant in listed]
    assert "default" in [tenant["name"] for tenant in listed]
    one = (await admin.get(f"/admin/tenants/{name}")).json()
    assert (one["name"], one["conversations"], one["active_keys"]) == (name, 0, 0)

    await import_messages(admin, name, "c1", ["hello"])
    assert (await admin.get(f"/admin/tenants/{name}")).json()["conversations"] == 1
    deleted = await admin.delete(f"/admin/tenants/{name}")
    assert deleted.json() == {"name": name, "deleted": True}
    assert (await admin.get(f"/admin/tenants/{name}")).status_code == 404
    assert (await admin.delete(f"/admin/tenants/{name}")).status_code == 404
    assert (await admin.get("/admin/conversations", params={"tenant": name})).status_code == 404
    assert (await admin.delete("/admin/tenants/default")).status_code == 409


async def test_keys_are_shown_once_stored_hashed_and_revoked(
    admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    tenant, other = await new_tenant(admin), await new_tenant(admin)
    created = await admin.post(f"/admin/tenants/{tenant}/keys", json={"name": "laptop"})
    assert created.status_code == 201
    key = created.json()
    assert key["key"].startswith("msk-") and len(key["key"]) >= 36
    assert key["prefix"] == key["key"][:12]
    assert (key["tenant"], key["name"], key["revoked_at"]) == (tenant, "laptop", None)
    # No name is fine too.
    assert (await admin.post(f"/admin/tenants/{tenant}/keys")).status_code == 201

    listed = (await admin.get(f"/admin/tenants/{tenant}/keys")).json()["data"]
    assert len(listed) == 2 and all("key" not in row for row in listed)
    assert key["key"] not in json.dumps(listed)
    async with engine.connect() as conn:
        stored = (await conn.execute(select(api_keys).where(api_keys.c.id == key["id"]))).one()
    assert key["key"] not in json.dumps([str(value) for value in stored])

    # Another tenant's key id is missing, not forbidden.
    wrong = await admin.delete(f"/admin/tenants/{other}/keys/{key['id']}")
    assert wrong.status_code == 404
    revoked = (await admin.delete(f"/admin/tenants/{tenant}/keys/{key['id']}")).json()
    assert revoked["revoked_at"] is not None
    again = (await admin.delete(f"/admin/tenants/{tenant}/keys/{key['id']}")).json()
    assert again["revoked_at"] == revoked["revoked_at"]
    assert (await admin.get(f"/admin/tenants/{tenant}")).json()["active_keys"] == 1
    assert (await admin.delete(f"/admin/tenants/{tenant}/keys/{2**63}")).status_code == 400


# -- conversations -------------------------------------------------------------------------------


async def test_conversations_page_by_cursor_and_filter(admin: httpx.AsyncClient) -> None:
    tenant = await new_tenant(admin)
    for index in range(5):
        await import_messages(
            admin,
            tenant,
            f"{'red' if index % 2 else 'blue'}-{index}",
            [f"message {index}"],
            user="ann" if index < 3 else "bob",
        )
    seen: list[str] = []
    cursor = None
    for _ in range(5):
        params: dict[str, Any] = {"tenant": tenant, "limit": 2}
        if cursor:
            params["cursor"] = cursor
        page = (await admin.get("/admin/conversations", params=params)).json()
        seen += [item["conversation"] for item in page["data"]]
        assert page["has_more"] == (page["next_cursor"] is not None)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ["blue-4", "red-3", "blue-2", "red-1", "blue-0"]  # newest first, once each

    async def listed(**params: Any) -> list[str]:
        response = await admin.get("/admin/conversations", params={"tenant": tenant, **params})
        assert response.status_code == 200, response.text
        return [item["conversation"] for item in response.json()["data"]]

    assert await listed(user="bob") == ["blue-4", "red-3"]
    assert await listed(prefix="red-") == ["red-3", "red-1"]
    assert await listed(prefix="%") == []  # LIKE wildcards are literal
    future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert await listed(active_after=future) == []
    assert len(await listed(active_before=future)) == 5
    bad = await admin.get("/admin/conversations", params={"tenant": tenant, "cursor": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cursor"


async def test_stats_count_tokens_stored_sent_and_levels(
    app: App, admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    conversation = f"stats-{uuid.uuid4().hex}"
    for turn in range(2):
        response = await admin.post(
            "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": [{"role": "user", "content": TOPICS[turn]}]},
            headers={"X-Memstrata-Conversation": conversation},
        )
        assert response.status_code == 200, response.text
    sent = int(response.headers["x-memstrata-context-tokens"])
    stats = (await admin.get(f"/admin/conversations/{conversation}")).json()
    assert stats["messages"] == 4
    assert stats["requests"] == 2
    assert stats["levels"] == {"0": 4}
    assert stats["tokens_stored"] == stats["level_tokens"]["0"] > 0
    assert stats["tokens_sent"] >= sent > 0
    assert stats["tokens_full"] > 0
    assert stats["compression_ratio"] == pytest.approx(stats["tokens_full"] / stats["tokens_sent"])
    assert stats["pending_jobs"] == {"queued": 1}
    assert stats["last_activity"] >= stats["created_at"]

    default = app.state.default_tenant_id
    await build(app, default, await conversation_row(engine, default, conversation))
    built = (await admin.get(f"/admin/conversations/{conversation}")).json()
    assert built["levels"]["1"] >= 1
    assert built["level_tokens"]["1"] > 0


async def test_export_is_jsonl_that_imports_back_identically(admin: httpx.AsyncClient) -> None:
    tenant = await new_tenant(admin)
    await import_messages(admin, tenant, "source", TOPICS)
    exported = await admin.get("/admin/conversations/source/export", params={"tenant": tenant})
    assert exported.status_code == 200
    assert exported.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in exported.text.splitlines()]
    assert [line["content"] for line in lines] == TOPICS
    assert lines[1]["created_at"].startswith("2026-01-01T00:01:00")

    again = await admin.post(
        "/admin/conversations/copy/messages", params={"tenant": tenant}, json={"messages": lines}
    )
    assert again.json()["imported"] == len(TOPICS)
    copy = await admin.get("/admin/conversations/copy/export", params={"tenant": tenant})
    assert copy.text == exported.text
    missing = await admin.get("/admin/conversations/nope/export", params={"tenant": tenant})
    assert missing.status_code == 404


async def test_a_replaced_system_prompt_is_exported_so_that_memstrata_import_restores_it(
    admin: httpx.AsyncClient,
    engine: AsyncEngine,
    module_database_url: str,
    module_engine: AsyncEngine,
    tmp_path: Path,
) -> None:
    """A client sending only its new messages with another system prompt replaced the
    conversation's: stored marked, never a turn. The export wrote it as a plain system message,
    which `memstrata import` (into a fresh database) stored as a turn of the history: every
    later prompt carried it mid-history. It is written `"system_prompt": true`, and restored."""
    conversation = f"sys-{uuid.uuid4().hex[:12]}"
    turns = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."}],
        [{"role": "system", "content": "You are verbose."}, {"role": "user", "content": "Why?"}],
    ]
    for messages in turns:
        answered = await admin.post(
            "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": messages},
            headers={"X-Memstrata-Conversation": conversation},
        )
        assert answered.status_code == 200, answered.text
    exported = await admin.get(f"/admin/conversations/{conversation}/export")
    lines = [json.loads(line) for line in exported.text.splitlines()]
    assert [(line["content"], line.get("system_prompt")) for line in lines][3:5] == [
        ("You are verbose.", True),
        ("Why?", None),
    ]
    path = tmp_path / "exported.jsonl"
    path.write_text(exported.text)
    run = await asyncio.to_thread(
        functools.partial(
            memstrata,
            # In batches of 2: a replaced system prompt leads a batch of its own.
            *("import", str(path), "--conversation", conversation, "--batch", "2"),
            env=child_env({"database_url": module_database_url, "log_level": "warning"}),
        )
    )
    assert run.returncode == 0, run.stderr

    async def kept(on: AsyncEngine) -> list[tuple[str, Any, bool]]:
        async with on.connect() as conn:
            tenant = await store.tenant_id_by_name(conn)
            ref = await store.find_conversation(conn, tenant_id=tenant, external_id=conversation)
            records = await store.list_messages(conn, tenant_id=tenant, conversation_id=ref.id)
            history = await store.history(
                conn, tenant_id=tenant, conversation_id=ref.id, before_seq=len(records)
            )
        assert [m["content"] for m in history] == [
            r.content for r in records if not r.system_prompt
        ]
        return [(r.role, r.content, r.system_prompt) for r in records]

    assert await kept(module_engine) == await kept(engine)
    async with module_engine.connect() as conn:
        tenant = await store.tenant_id_by_name(conn)
    again = conversations_store.export_messages(
        module_engine, tenant_id=tenant, external_id=conversation
    )
    assert [line async for line in again] == lines


async def test_a_bad_import_names_the_field_as_openai_does(admin: httpx.AsyncClient) -> None:
    """FastAPI's own validation (of the bulk import) names a field in OpenAI's form too, not
    pydantic's `body.messages.1.content.str`."""
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": 42}]
    refused = await admin.post("/admin/conversations/bad/messages", json={"messages": messages})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages[1].content", error
    assert error["message"].startswith("messages[1].content: "), error


async def test_delete_removes_messages_summaries_embeddings_and_jobs(
    app: App, admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    tenant = await new_tenant(admin)
    await import_messages(admin, tenant, "doomed", TOPICS)
    await import_messages(admin, tenant, "kept", TOPICS[:2])
    tid = await tenant_id(engine, admin, tenant)
    doomed = await conversation_row(engine, tid, "doomed")
    await build(app, tid, doomed)
    await admin.post("/admin/conversations/doomed/compact", params={"tenant": tenant})
    async with engine.connect() as conn:
        before = await conn.scalar(
            select(func.count()).where(nodes.c.conversation_id == doomed, nodes.c.level > 0)
        )
    assert before

    deleted = await admin.delete("/admin/conversations/doomed", params={"tenant": tenant})
    assert deleted.status_code == 200
    body = deleted.json()
    assert (body["messages"], body["summaries"], body["jobs"]) == (4, before, 2)
    async with engine.connect() as conn:
        for table in (nodes, jobs):
            left = await conn.scalar(
                select(func.count()).select_from(table).where(table.c.conversation_id == doomed)
            )
            assert left == 0, table.name
    assert (
        await admin.get("/admin/conversations/doomed", params={"tenant": tenant})
    ).status_code == 404
    again = await admin.delete("/admin/conversations/doomed", params={"tenant": tenant})
    assert again.status_code == 404
    listed = (await admin.get("/admin/conversations", params={"tenant": tenant})).json()["data"]
    assert [item["conversation"] for item in listed] == ["kept"]


async def test_a_build_running_while_its_conversation_is_deleted_writes_nothing(
    app: App, admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    """The build read the messages, then the conversation is deleted while it summarizes:
    its insert fails on the foreign key (the job fails) instead of bringing rows back."""
    tenant = await new_tenant(admin)
    await import_messages(admin, tenant, "racing", TOPICS)
    tid = await tenant_id(engine, admin, tenant)
    racing = await conversation_row(engine, tid, "racing")
    extractive = ExtractiveSummarizer("gpt-4o")

    class DeletingSummarizer:
        async def summarize(
            self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
        ) -> Summary:
            deleted = await admin.delete("/admin/conversations/racing", params={"tenant": tenant})
            assert deleted.status_code in (200, 404)
            return await extractive.summarize(items, level=level, target_tokens=target_tokens)

    config = tree.TreeConfig(
        embedder=app.state.embedder,
        summarizer=DeletingSummarizer(),
        policy=SegmentPolicy(shift_threshold=2.0, max_messages=2),
    )
    with pytest.raises(IntegrityError):
        await tree.build(engine, tenant_id=tid, conversation_id=racing, config=config, final=True)
    async with engine.connect() as conn:
        for table in (nodes, jobs, conversations):
            column = table.c.id if table is conversations else table.c.conversation_id
            left = await conn.scalar(
                select(func.count()).select_from(table).where(column == racing)
            )
            assert left == 0, table.name


async def test_compact_now_queues_a_final_build(
    admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    tenant = await new_tenant(admin)
    await import_messages(admin, tenant, "c", TOPICS[:1])
    response = await admin.post("/admin/conversations/c/compact", params={"tenant": tenant})
    assert response.status_code == 202
    assert response.json() == {"conversation": "c", "queued": True}
    tid = await tenant_id(engine, admin, tenant)
    async with engine.connect() as conn:
        payloads = (
            await conn.scalars(
                select(jobs.c.payload).where(jobs.c.tenant_id == tid, jobs.c.status == "queued")
            )
        ).all()
    assert {"final": True} in payloads
    missing = await admin.post("/admin/conversations/none/compact", params={"tenant": tenant})
    assert missing.status_code == 404


async def test_messages_hierarchy_and_node(
    app: App, admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    tenant, other = await new_tenant(admin), await new_tenant(admin)
    await import_messages(admin, tenant, "tree", TOPICS)
    tid = await tenant_id(engine, admin, tenant)
    await build(app, tid, await conversation_row(engine, tid, "tree"))
    params = {"tenant": tenant}
    messages = (await admin.get("/admin/conversations/tree/messages", params=params)).json()
    assert [m["content"] for m in messages["messages"]] == TOPICS
    page = await admin.get(
        "/admin/conversations/tree/messages", params={**params, "after_seq": 1, "limit": 1}
    )
    assert [m["seq"] for m in page.json()["messages"]] == [2]
    tree = (await admin.get("/admin/conversations/tree/hierarchy", params=params)).json()
    assert tree["levels"]["0"] == 4 and tree["levels"]["1"] >= 1
    summary = tree["nodes"][-1]
    node = (await admin.get(f"/admin/nodes/{summary['id']}", params=params)).json()
    assert node["conversation"] == "tree" and node["level"] >= 1 and node["children"]
    message = messages["messages"][0]["node_id"]
    assert (await admin.get(f"/admin/nodes/{message}", params=params)).json()["text"] == TOPICS[0]
    # Another tenant (or the default one) finds nothing.
    for scope in ({"tenant": other}, {}):
        assert (await admin.get(f"/admin/nodes/{message}", params=scope)).status_code == 404
        assert (
            await admin.get("/admin/conversations/tree/hierarchy", params=scope)
        ).status_code == 404


async def test_jobs_depth_failures_and_retry(admin: httpx.AsyncClient, engine: AsyncEngine) -> None:
    tenant, other = await new_tenant(admin), await new_tenant(admin)
    await import_messages(admin, tenant, "c", TOPICS[:1])
    tid = await tenant_id(engine, admin, tenant)
    async with engine.begin() as conn:
        dead = await job_queue.enqueue(
            conn, kind="test-kind", tenant_id=tid, conversation_id=None, payload={}
        )
        await conn.execute(
            update(jobs)
            .where(jobs.c.id == dead)
            .values(status="dead", attempts=5, last_error="RuntimeError: boom")
        )
    listed = (await admin.get("/admin/jobs", params={"tenant": tenant})).json()
    assert listed["depth"]["dead"] == 1 and listed["depth"]["failures"] == 1
    assert listed["depth"]["queued"] == 1
    only_dead = (await admin.get("/admin/jobs", params={"tenant": tenant, "status": "dead"})).json()
    assert [(job["id"], job["last_error"]) for job in only_dead["jobs"]] == [
        (dead, "RuntimeError: boom")
    ]
    assert (await admin.get("/admin/jobs", params={"tenant": other})).json()["jobs"] == []

    assert (
        await admin.post(f"/admin/jobs/{dead}/retry", params={"tenant": other})
    ).status_code == 404
    retried = await admin.post(f"/admin/jobs/{dead}/retry", params={"tenant": tenant})
    assert retried.json() == {"id": dead, "queued": True}
    after = (await admin.get("/admin/jobs", params={"tenant": tenant})).json()
    assert after["depth"]["dead"] == 0 and after["depth"]["queued"] == 2
    unknown = await admin.post("/admin/jobs/999999999/retry", params={"tenant": tenant})
    assert unknown.status_code == 404


async def test_search_within_a_tenant(
    app: App, admin: httpx.AsyncClient, engine: AsyncEngine
) -> None:
    tenant, other = await new_tenant(admin), await new_tenant(admin)
    await import_messages(admin, tenant, "billing", TOPICS[:2])
    await import_messages(admin, tenant, "garden", TOPICS[2:])
    await import_messages(admin, other, "billing", TOPICS[:2])
    tid = await tenant_id(engine, admin, tenant)
    for conversation in ("billing", "garden"):
        await build(app, tid, await conversation_row(engine, tid, conversation))

    found = await admin.get("/admin/search", params={"tenant": tenant, "q": "INV-2041 refund"})
    assert found.status_code == 200, found.text
    hits = found.json()["data"]
    assert hits and hits[0]["conversation"] == "billing"
    assert "INV-2041" in hits[0]["text"]
    other_ids = {
        m["node_id"]
        for m in (
            await admin.get("/admin/conversations/billing/messages", params={"tenant": other})
        ).json()["messages"]
    }
    assert not other_ids & {hit["node_id"] for hit in hits}

    scoped = await admin.get(
        "/admin/search", params={"tenant": tenant, "q": "tomatoes", "conversation": "garden"}
    )
    assert {hit["conversation"] for hit in scoped.json()["data"]} == {"garden"}
    messages_only = await admin.get(
        "/admin/search", params={"tenant": tenant, "q": "tomatoes", "level": 0}
    )
    assert messages_only.json()["data"] and all(
        hit["level"] == 0 for hit in messages_only.json()["data"]
    )
    assert (await admin.get("/admin/search", params={"tenant": tenant})).status_code == 400


async def test_context_dry_run(admin: httpx.AsyncClient) -> None:
    tenant = await new_tenant(admin)
    await import_messages(admin, tenant, "ctx", TOPICS)
    response = await admin.post(
        "/admin/conversations/ctx/context",
        params={"tenant": tenant},
        json={"query": "Who approved the refund?", "budget": 4000},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["messages"][-1] == {"role": "user", "content": "Who approved the refund?"}
    assert body["tokens"] > 0
    assert TOPICS[1] in json.dumps(body["messages"])
    after = (await admin.get("/admin/conversations/ctx", params={"tenant": tenant})).json()
    assert after["messages"] == len(TOPICS)  # nothing stored
    missing = await admin.post(
        "/admin/conversations/ctx/context", json={"query": "x"}, params={"tenant": "default"}
    )
    assert missing.status_code == 404


# -- the admin token ----------------------------------------------------------------------------

TOKEN = "admin-token-" + "x" * 20


async def test_admin_token_is_required_from_everywhere_when_set(
    database_url: str, upstream: UpstreamServer
) -> None:
    settings = Settings(
        database_url=database_url,
        upstream_base_url=upstream.url,
        workers=0,
        admin_token=TOKEN,
    )
    async with running_app(settings) as app:
        for host in ("127.0.0.1", "10.1.2.3"):
            async with app.client(host=host) as client:
                missing = await client.get("/admin/tenants")
                assert missing.status_code == 401
                # Refused before anything is looked up: unknown tenants do not show.
                unknown = await client.get("/admin/conversations", params={"tenant": "nope"})
                assert unknown.status_code == 401
                assert missing.json()["error"]["code"] == "invalid_admin_token"
                assert missing.headers["www-authenticate"] == "Bearer"
                wrong = await client.get(
                    "/admin/tenants", headers={"Authorization": f"Bearer {TOKEN}y"}
                )
                assert wrong.status_code == 401
                right = await client.get(
                    "/admin/tenants", headers={"Authorization": f"Bearer {TOKEN}"}
                )
                assert right.status_code == 200


def test_short_admin_tokens_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        Settings(admin_token="short")
    assert Settings(admin_token="").admin_token is None
