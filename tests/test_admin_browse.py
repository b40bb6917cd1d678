"""What the memory browser reads besides the rest of the admin API, and how `/ui` is served.

The tree a page at a time (`GET /admin/conversations/{id}/tree`), one conversation's jobs
(`GET /admin/jobs?conversation=`), the dry run's labelled parts and why each quoted message was
picked, and the page's own files under the admin API's guard. The app runs in-process
(`tests.inprocess`) on the session's Postgres; each test makes tenants of its own.
"""

import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from devkit import synthetic
from devkit.upstream import UpstreamServer
from gateway import ui
from gateway.settings import Settings
from memory import tokens
from memory.build import tree
from memory.build.segments import SegmentPolicy
from memory.build.summarize import ExtractiveSummarizer
from tests.inprocess import App, running_app

RUN = uuid.uuid4().hex[:8]
TOKEN = "browse-admin-token-0123456789"


@pytest.fixture(scope="module", autouse=True)
async def _delete_tenants_afterwards(app: App) -> AsyncIterator[None]:
    yield
    async with app.client() as admin:
        for tenant in (await admin.get("/admin/tenants")).json()["data"]:
            if tenant["name"].startswith(f"b-{RUN}-"):
                await admin.delete(f"/admin/tenants/{tenant['name']}")


async def new_tenant(admin: httpx.AsyncClient) -> tuple[str, int]:
    name = f"b-{RUN}-{uuid.uuid4().hex[:10]}"
    created = await admin.post("/admin/tenants", json={"name": name})
    assert created.status_code == 201, created.text
    return name, int(created.json()["id"])


async def stored(
    app: App, admin: httpx.AsyncClient, messages: list[dict[str, Any]], *, built: bool
) -> tuple[str, str]:
    """A tenant with conversation `c` holding `messages`, its tree built (segments of 4
    messages, roll-ups of 2) when `built`."""
    tenant, tenant_id = await new_tenant(admin)
    answer = await admin.post(
        "/admin/conversations/c/messages", params={"tenant": tenant}, json={"messages": messages}
    )
    assert answer.status_code == 201, answer.text
    if built:
        jobs = (await admin.get("/admin/jobs", params={"tenant": tenant})).json()["jobs"]
        config = tree.TreeConfig(
            embedder=app.state.embedder,
            summarizer=ExtractiveSummarizer("gpt-4o"),
            policy=SegmentPolicy(shift_threshold=2.0, max_messages=4),
            fanout=2,
        )
        await tree.build(
            app.state.engine,
            tenant_id=tenant_id,
            conversation_id=jobs[0]["conversation_id"],
            config=config,
            final=True,
        )
    return tenant, "c"


async def page(
    admin: httpx.AsyncClient, tenant: str, conversation: str, **params: Any
) -> dict[str, Any]:
    answer = await admin.get(
        f"/admin/conversations/{conversation}/tree", params={"tenant": tenant, **params}
    )
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


# -- the tree, a page at a time -------------------------------------------------------------


async def test_the_roots_and_children_cover_every_message_once(
    app: App, admin: httpx.AsyncClient
) -> None:
    messages = synthetic.messages(40, seed=2, with_tools=False)
    tenant, conversation = await stored(app, admin, messages, built=True)
    roots = await page(admin, tenant, conversation)
    assert roots["parent"] is None and not roots["more_before"] and not roots["more_after"]
    assert max(node["level"] for node in roots["nodes"]) >= 2

    async def leaves(node: dict[str, Any]) -> list[int]:
        if node["level"] == 0:
            return [node["seq"]]
        children = await page(admin, tenant, conversation, parent=node["id"])
        assert [child["id"] for child in children["nodes"]] == node["children"]
        assert all(child["level"] == node["level"] - 1 for child in children["nodes"])
        assert all(child["parent_id"] == node["id"] for child in children["nodes"])
        assert node["span"] == [children["nodes"][0]["span"][0], children["nodes"][-1]["span"][1]]
        return [seq for child in children["nodes"] for seq in await leaves(child)]

    covered = [seq for root in roots["nodes"] for seq in await leaves(root)]
    assert covered == list(range(len(messages)))
    # The verbatim messages, as stored.
    first = await page(admin, tenant, conversation, parent=roots["nodes"][0]["id"])
    while first["nodes"][0]["level"] > 0:
        first = await page(admin, tenant, conversation, parent=first["nodes"][0]["id"])
    assert first["nodes"][0]["text"] == messages[0]["content"]
    assert first["nodes"][0]["role"] == messages[0]["role"]
    # A node's path: the summaries above it, the root first, each the parent of the next.
    message = first["nodes"][0]
    path = (await admin.get(f"/admin/nodes/{message['id']}/path", params={"tenant": tenant})).json()
    assert path["conversation"] == conversation
    assert path["path"][0]["id"] == roots["nodes"][0]["id"] and path["path"][-1] == message
    for above, below in zip(path["path"], path["path"][1:], strict=False):
        assert below["parent_id"] == above["id"] and below["level"] == above["level"] - 1
    elsewhere = await admin.get(f"/admin/nodes/{message['id']}/path", params={"tenant": "default"})
    assert elsewhere.status_code == 404


async def test_pages_go_forwards_and_backwards_by_the_messages_they_cover(
    app: App, admin: httpx.AsyncClient
) -> None:
    # Not built: every message is a root, as in a conversation no worker has reached yet.
    tenant, conversation = await stored(
        app, admin, synthetic.messages(25, seed=4, with_tools=False), built=False
    )
    first = await page(admin, tenant, conversation, limit=10)
    assert [node["seq"] for node in first["nodes"]] == list(range(10))
    assert (first["more_before"], first["more_after"]) == (False, True)
    second = await page(admin, tenant, conversation, limit=10, after=9)
    assert [node["seq"] for node in second["nodes"]] == list(range(10, 20))
    assert (second["more_before"], second["more_after"]) == (True, True)
    last = await page(admin, tenant, conversation, limit=10, after=19)
    assert [node["seq"] for node in last["nodes"]] == list(range(20, 25))
    assert (last["more_before"], last["more_after"]) == (True, False)
    back = await page(admin, tenant, conversation, limit=10, before=20)
    assert back["nodes"] == second["nodes"]
    assert (back["more_before"], back["more_after"]) == (True, True)
    start = await page(admin, tenant, conversation, limit=10, before=3)
    assert [node["seq"] for node in start["nodes"]] == [0, 1, 2]
    assert (start["more_before"], start["more_after"]) == (False, True)


async def test_a_tree_page_of_a_node_elsewhere_is_missing(
    app: App, admin: httpx.AsyncClient
) -> None:
    tenant, conversation = await stored(app, admin, synthetic.messages(12, seed=1), built=True)
    other, _ = await stored(app, admin, synthetic.messages(12, seed=1), built=True)
    [theirs, *_] = (await page(admin, other, conversation))["nodes"]
    # Another tenant's node, even in a conversation of the same name: 404, as if it did not exist.
    answer = await admin.get(
        f"/admin/conversations/{conversation}/tree",
        params={"tenant": tenant, "parent": theirs["id"]},
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["message"] == f"node {theirs['id']} does not exist"
    # The same tenant's node under another conversation: 404 too.
    await admin.post(
        "/admin/conversations/d/messages",
        params={"tenant": other},
        json={"messages": [{"role": "user", "content": "elsewhere"}]},
    )
    answer = await admin.get(
        "/admin/conversations/d/tree", params={"tenant": other, "parent": theirs["id"]}
    )
    assert answer.status_code == 404
    for bad in ({"limit": 0}, {"limit": 201}, {"after": -2}, {"parent": 0}):
        refused = await admin.get(
            f"/admin/conversations/{conversation}/tree", params={"tenant": tenant, **bad}
        )
        assert refused.status_code == 400, bad
    missing = await admin.get("/admin/conversations/nope/tree", params={"tenant": tenant})
    assert missing.status_code == 404


# -- jobs of one conversation, the dry run's parts ------------------------------------------------


async def test_jobs_of_one_conversation_name_it(app: App, admin: httpx.AsyncClient) -> None:
    tenant, conversation = await stored(app, admin, synthetic.messages(4, seed=1), built=False)
    await admin.post(
        "/admin/conversations/other/messages",
        params={"tenant": tenant},
        json={"messages": [{"role": "user", "content": "hello"}]},
    )
    every = (await admin.get("/admin/jobs", params={"tenant": tenant})).json()
    assert sorted(job["conversation"] for job in every["jobs"]) == [conversation, "other"]
    only = (
        await admin.get("/admin/jobs", params={"tenant": tenant, "conversation": conversation})
    ).json()
    assert [job["conversation"] for job in only["jobs"]] == [conversation]
    assert only["depth"] == every["depth"]  # the depth stays the tenant's
    missing = await admin.get("/admin/jobs", params={"tenant": tenant, "conversation": "nope"})
    assert missing.status_code == 404
    # The listing says what each conversation still has to do.
    listed = (await admin.get("/admin/conversations", params={"tenant": tenant})).json()["data"]
    assert {item["conversation"]: item["pending_jobs"] for item in listed} == {
        "other": {"queued": 1},
        conversation: {"queued": 1},
    }


async def test_the_dry_run_labels_its_parts_and_says_why_each_message_is_quoted(
    app: App, admin: httpx.AsyncClient
) -> None:
    messages = synthetic.generate(200, seed=7, with_tools=False)
    tenant, conversation = await stored(app, admin, messages.messages, built=True)
    fact = next(f for f in messages.facts if f.kind in ("reference", "ticket", "flight"))
    question = f"What do you know about {fact.value}?"
    answer = await admin.post(
        f"/admin/conversations/{conversation}/context",
        params={"tenant": tenant},
        json={"query": question, "budget": 1500},
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    parts = body["parts"]
    # The working context's parts: stable memory, the verbatim turns, the note, the question.
    assert [part["label"] for part in parts] == ["stable", "verbatim", "note", "new"]
    starts = [sum(part["messages"] for part in parts[:index]) for index in range(len(parts))]
    assert [part["start"] for part in parts] == starts
    assert sum(part["messages"] for part in parts) == len(body["messages"])
    for part in parts:
        run = body["messages"][part["start"] : part["start"] + part["messages"]]
        assert part["tokens"] == sum(tokens.count_message(m, model="gpt-4o") for m in run)
    assert sum(part["tokens"] for part in parts) + tokens.REPLY_PRIMING_TOKENS == body["tokens"]
    assert body["working_context"] and not body["compacted"]
    note = body["messages"][parts[2]["start"]]["content"]
    recalled = body["recalled"]
    assert recalled and [one["rank"] for one in recalled] == sorted(o["rank"] for o in recalled)
    assert all(f"[#{one['node_id']} " in note for one in recalled)
    holder = next(one for one in recalled if fact.value in messages.messages[one["seq"]]["content"])
    assert {"full text"} <= {leg["leg"] for leg in holder["legs"]}
    assert not holder["lent"]
    for one in recalled:
        if not one["pinned"]:  # a message no leg found is there by a neighbour's share
            assert one["lent"] == (not one["legs"])
        for leg in one["legs"]:
            assert leg["rank"] >= 1
            assert (leg["similarity"] is None) == (leg["leg"] == "full text")
    # A conversation that fits goes as stored: no working context, nothing recalled.
    small, name = await stored(app, admin, synthetic.messages(4, seed=1), built=False)
    fits = (
        await admin.post(
            f"/admin/conversations/{name}/context",
            params={"tenant": small},
            json={"query": "and now?"},
        )
    ).json()
    assert [part["label"] for part in fits["parts"]] == ["history"]
    assert fits["parts"][0]["messages"] == 5 and fits["recalled"] == []
    assert not fits["working_context"]


# -- the page itself ----------------------------------------------------------------------------


async def test_the_page_and_its_files_are_guarded_like_the_admin_api(
    app: App, database_url: str, upstream: UpstreamServer
) -> None:
    files = sorted(entry.name for entry in ui.STATIC.iterdir())
    assert "index.html" in files and "app.js" in files
    async with app.client() as local:
        bare = await local.get("/ui")
        assert bare.status_code == 308 and bare.headers["location"] == "ui/"
        shell = await local.get("/ui/")
        assert shell.status_code == 200 and shell.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in shell.headers["content-security-policy"]
        for name in files:
            served = await local.get(f"/ui/static/{name}")
            assert served.status_code == 200, name
            assert served.content == (ui.STATIC / name).read_bytes()
        # A loopback client must also name a loopback host (not a page of another site whose
        # name resolves to 127.0.0.1).
        for path in ("/ui", "/ui/", "/ui/static/app.js"):
            named = await local.get(path, headers={"Host": "memstrata.example.com"})
            assert named.status_code == 403, path
            assert named.json()["error"]["code"] == "admin_forbidden"
        for bad in ("nope.js", "..%2Fapp.py", "%2e%2e%2f__init__.py", "App.JS", "__init__.py"):
            assert (await local.get(f"/ui/static/{bad}")).status_code == 404, bad
    async with app.client(host="10.1.2.3") as remote:
        for path in ("/ui/", "/ui/static/app.js", "/admin/tenants"):
            refused = await remote.get(path)
            assert refused.status_code == 403, path
            assert refused.json()["error"]["code"] == "admin_forbidden"
    settings = Settings(
        database_url=database_url, upstream_base_url=upstream.url, workers=0, admin_token=TOKEN
    )
    async with running_app(settings) as guarded, guarded.client(host="10.1.2.3") as remote:
        # The page holds no data: served to anyone; the data needs the token.
        assert (await remote.get("/ui/")).status_code == 200
        assert (await remote.get("/ui/static/api.js")).status_code == 200
        assert (await remote.get("/admin/conversations")).status_code == 401
        allowed = await remote.get(
            "/admin/conversations", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert allowed.status_code == 200
