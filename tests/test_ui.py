"""The memory browser (`/ui`) in a real headless Chromium.

Debian's `chromium`, driven by Playwright for Python through its `executable_path`
(`devkit.browser`; `make test` installs the package when it is missing). The gateway is a real
`memstrata serve` process on the session's Postgres with the fake upstream, and without
in-process workers: the trees of the synthetic conversations this module imports are built by
a `memstrata worker` process, which also dead-letters a job no worker knows how to run; once it
stops, nothing moves in the queue but what the page does. One conversation, which starts with a
system prompt, also answers chat requests with a tenant key under a small budget, so that its
prompts come from its working context and cost what the page shows. Everything lives in two
tenants of this module's own: the page works within the first, and nothing of the second may
show.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from devkit import synthetic
from devkit.browser import chromium, launch, seed, wait_built
from devkit.gateway import GatewayProcess, WorkerProcess
from devkit.service import own_address
from devkit.upstream import UpstreamServer
from memory.build import jobs

if chromium() is None:
    pytest.skip(
        "no Chromium to drive: install Debian's `chromium` (`make test` does, as root)",
        allow_module_level=True,
    )

from playwright.async_api import Browser, Page, async_playwright, expect

RUN = uuid.uuid4().hex[:8]
SETTINGS: dict[str, Any] = {"summary_mode": "extractive", "fanout": 4, "log_level": "warning"}
TOKEN = "ui-admin-token-0123456789"
SECRET = "ZEBRA-4417 is the other tenant's vault code"
SYSTEM = "You are the travel desk's assistant: answer in one short paragraph."
MODEL = "gpt-4o"
BUDGET = "700"
TURNS = ("Which hotel did we pick in the end?", "And what did the refund come to?")


@dataclass(frozen=True)
class Data:
    """What this module stored: two tenants, their conversations, and a dead job."""

    tenant: str
    other: str
    trip: str
    chat: str
    secret: str
    generated: synthetic.Conversation
    dead_job: int


@pytest.fixture(scope="module")
def gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    # Chat requests name their tenant by its key.
    with GatewayProcess(
        database_url=database_url, upstream_url=upstream.url, workers=0, auth="on", **SETTINGS
    ) as process:
        yield process


@pytest.fixture
async def http(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.root_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
async def data(
    gateway: GatewayProcess, database_url: str, engine: AsyncEngine
) -> AsyncIterator[Data]:
    tenant, other = f"ui-{RUN}-a", f"ui-{RUN}-b"
    async with httpx.AsyncClient(base_url=gateway.root_url, timeout=120) as http:
        ids = {}
        for name in (tenant, other):
            created = await http.post("/admin/tenants", json={"name": name})
            assert created.status_code == 201, created.text
            ids[name] = created.json()["id"]
        trip, chat, secret = f"trip-{RUN}", f"chat-{RUN}", f"vault-{RUN}"
        generated = await seed(http, trip, messages=300, seed=3, tenant=tenant, user="alice")
        await seed(http, chat, messages=40, seed=5, tenant=tenant, user="bob", system=SYSTEM)
        key = await http.post(f"/admin/tenants/{tenant}/keys", json={"name": "ui chat"})
        assert key.status_code == 201, key.text
        hidden = await http.post(
            f"/admin/conversations/{secret}/messages",
            params={"tenant": other},
            json={"messages": [{"role": "user", "content": SECRET}]},
        )
        assert hidden.status_code == 201, hidden.text
        with WorkerProcess(database_url, **SETTINGS):
            async with asyncio.timeout(240):
                for name in (tenant, other):
                    await wait_built(http, tenant=name)
                await _chat(http, key.json()["key"], chat)
                await wait_built(http, tenant=tenant)
            built = (await http.get("/admin/jobs", params={"tenant": tenant})).json()["jobs"]
            conversation_id = next(
                job["conversation_id"] for job in built if job["conversation"] == trip
            )
            async with engine.begin() as conn:
                dead = await jobs.enqueue(
                    conn,
                    kind="ui-test-unknown-kind",
                    tenant_id=ids[tenant],
                    conversation_id=conversation_id,
                    max_attempts=1,
                )
            assert dead is not None
            for _ in range(300):  # the worker fails it at once: no handler runs that kind
                if await _is_dead(http, tenant, dead):
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError(f"job {dead} was not dead-lettered")
        yield Data(tenant, other, trip, chat, secret, generated, dead)
        for name in (tenant, other):
            await http.delete(f"/admin/tenants/{name}")


async def _chat(http: httpx.AsyncClient, key: str, conversation: str) -> None:
    """`TURNS`, one request each, in `BUDGET` tokens: the history does not fit it, so every
    prompt comes from the conversation's working context, the second repeating the first's
    start."""
    for question in TURNS:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": question}]},
            headers={
                "Authorization": f"Bearer {key}",
                "X-Memstrata-Conversation": conversation,
                "X-Memstrata-Budget": BUDGET,
            },
        )
        assert answer.status_code == 200, answer.text


async def _is_dead(http: httpx.AsyncClient, tenant: str, job_id: int) -> bool:
    found = await http.get("/admin/jobs", params={"tenant": tenant, "status": "dead"})
    return any(job["id"] == job_id for job in found.json()["jobs"])


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with async_playwright() as playwright:
        started = await launch(playwright)
        yield started
        await started.close()


@pytest.fixture
async def page(browser: Browser) -> AsyncIterator[Page]:
    """A fresh browser session (its own sessionStorage) at 1280 px; a script error fails the
    test."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    opened = await context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    yield opened
    await context.close()
    assert errors == []


async def open_ui(page: Page, root_url: str, tenant: str, route: str = "#/") -> None:
    """The page at `route` with `tenant` picked, as the picker leaves it in this tab."""
    await page.goto(f"{root_url}/ui/")
    await page.evaluate("name => sessionStorage.setItem('memstrata.tenant', name)", tenant)
    await page.goto(f"{root_url}/ui/{route}")
    await page.reload()


# -- the tests ------------------------------------------------------------------------------


async def test_the_list_shows_the_tenants_conversations_newest_first(
    page: Page, gateway: GatewayProcess, data: Data
) -> None:
    await page.goto(f"{gateway.root_url}/ui/")
    await page.select_option("#tenant", data.tenant)
    links = page.locator("a.conversation-link")
    await expect(links).to_have_text([data.chat, data.trip])
    row = page.locator("tr", has=page.get_by_role("link", name=data.trip, exact=True))
    await expect(row.locator("td[data-label=Messages]")).to_have_text("300")
    await expect(row.locator("td[data-label=User]")).to_have_text("alice")
    await expect(row.locator("td[data-label='Pending jobs']")).to_have_text("1 dead")

    await page.fill("input[name=user]", "bob")
    await page.click("form.filters button[type=submit]")
    await expect(links).to_have_text([data.chat])
    await page.fill("input[name=user]", "")
    await page.fill("input[name=prefix]", "trip-")
    await page.click("form.filters button[type=submit]")
    await expect(links).to_have_text([data.trip])
    await page.select_option("select[name=active]", "idle30d")
    await page.click("form.filters button[type=submit]")
    await expect(page.locator(".empty")).to_contain_text("No conversation matches")


async def test_a_conversation_shows_its_figures_and_the_roots_of_its_tree(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    await open_ui(page, gateway.root_url, data.tenant)
    await page.get_by_role("link", name=data.trip, exact=True).click()
    await expect(page.locator("h1.conversation-id")).to_have_text(data.trip)
    stats = await http.get(f"/admin/conversations/{data.trip}", params={"tenant": data.tenant})
    levels = stats.json()["levels"]
    assert len(levels) >= 3, levels  # messages, segments and at least one roll-up
    figures = page.locator(".figures")
    await expect(figures.locator(".stat[data-stat=Messages] dd")).to_have_text("300")
    await expect(figures).to_contain_text(f"{levels['1']} segments")
    await expect(figures).to_contain_text(f"{levels['2']} cores")
    roots = (
        await http.get(f"/admin/conversations/{data.trip}/tree", params={"tenant": data.tenant})
    ).json()["nodes"]
    shown = page.locator("ul.tree > li[role=treeitem]")
    await expect(shown).to_have_count(len(roots))
    ids = [await item.get_attribute("data-node-id") for item in await shown.all()]
    assert ids == [str(node["id"]) for node in roots]


async def test_a_node_opens_down_to_a_verbatim_message(
    page: Page, gateway: GatewayProcess, data: Data
) -> None:
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{data.trip}/tree")
    first = page.locator("ul.tree > li[role=treeitem]").first
    await expect(first).to_have_attribute("data-level", re.compile(r"[1-9]"))
    level = int(await first.get_attribute("data-level") or 0)
    node = first
    for depth in range(level):
        toggle = node.locator(":scope > .node-row > button.toggle")
        if depth % 2:  # keyboard reachable: focus and Enter opens it as a click does
            await toggle.focus()
            await page.keyboard.press("Enter")
        else:
            await toggle.click()
        await expect(node).to_have_attribute("aria-expanded", "true")
        node = node.locator(":scope > ul.children > li[role=treeitem]").first
        await expect(node).to_have_attribute("data-level", str(level - depth - 1))
    seq = int((await node.locator(".badge").inner_text()).split()[-1])
    assert seq == 0  # the first node of every level starts at the first message
    expected = data.generated.messages[seq]["content"]
    await expect(node.locator(".verbatim")).to_have_text(expected)
    await expect(node.locator(".speaker")).to_have_text(data.generated.messages[seq]["role"])


async def test_a_search_hit_leads_to_its_place_in_the_tree(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    fact = next(f for f in data.generated.facts if f.kind in ("reference", "ticket", "flight"))
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{data.trip}/search")
    await page.fill("input[name=q]", fact.value)
    await page.select_option("select[name=level]", "0")
    await page.click("form[role=search] button[type=submit]")
    hit = page.locator("li.hit").first
    await expect(hit).to_contain_text(fact.value)
    node_id = await hit.get_attribute("data-node-id")
    await hit.locator("a.hit-link").click()
    target = page.locator("li.target")
    await expect(target).to_have_attribute("data-node-id", str(node_id))
    await expect(target).to_contain_text(fact.value)
    await expect(target.locator(".node-row").first).to_be_focused()
    # Opened at its place: every summary above it is open, one level per ancestor.
    chain = []
    parent = (await http.get(f"/admin/nodes/{node_id}", params={"tenant": data.tenant})).json()
    while parent["parent_id"] is not None:
        parent = (
            await http.get(f"/admin/nodes/{parent['parent_id']}", params={"tenant": data.tenant})
        ).json()
        chain.append(str(parent["id"]))
    opened = target.locator("xpath=ancestor::li[@role='treeitem']")
    await expect(opened).to_have_count(len(chain))
    assert [await li.get_attribute("data-node-id") for li in await opened.all()] == chain[::-1]
    for li in await opened.all():
        assert await li.get_attribute("aria-expanded") == "true"


def _formatted(value: float | None, *, percent: bool = False) -> str:
    """A figure as the page writes it (`dom.js`: `number`, `percent`)."""
    if value is None:
        return "\N{EN DASH}"
    return f"{100 * value:.0f}%" if percent else f"{value:,}"


async def test_the_list_and_a_conversation_show_what_its_prompts_cost(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    """Tokens sent, cached tokens the upstream reported, memory reuse and compactions: the
    admin API's figures, in the list and in the conversation's own figures."""
    stats = (
        await http.get(f"/admin/conversations/{data.chat}", params={"tenant": data.tenant})
    ).json()
    # The turns' prompts came from the working context: the second repeated the first's start,
    # and the fake upstream reported that run of leading messages as cached.
    assert stats["requests"] == len(TURNS) and stats["working_context"] is not None
    assert stats["tokens_sent"] > 0 and stats["tokens_cached"] > 0 and stats["memory_reuse"] > 0
    expected = {
        "Tokens sent": _formatted(stats["tokens_sent"]),
        "Cached tokens": _formatted(stats["tokens_cached"]),
        "Memory reuse": _formatted(stats["memory_reuse"], percent=True),
        "Compactions": _formatted(stats["compactions"]),
    }
    await open_ui(page, gateway.root_url, data.tenant)
    row = page.locator("tr", has=page.get_by_role("link", name=data.chat, exact=True))
    for column, value in expected.items():
        await expect(row.locator(f"td[data-label='{column}']")).to_have_text(value)
    await row.get_by_role("link", name=data.chat, exact=True).click()
    figures = page.locator(".figures")
    for label, value in expected.items():
        await expect(figures.locator(f".stat[data-stat='{label}'] dd")).to_have_text(value)
    await expect(figures.locator(".stat[data-stat='Working context'] dd")).to_contain_text(
        f"version {stats['working_context']['version']}"
    )


async def test_a_dry_run_shows_the_prompt_parts_with_the_apis_token_counts(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    question = "What was the booking reference of the flight?"
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{data.trip}/prompt")
    await page.fill("textarea[name=query]", question)
    await page.fill("input[name=budget]", "2000")
    await page.click(".prompt-form button[type=submit]")
    parts = page.locator("ol.parts > li.part")
    await expect(parts.first).to_be_visible()
    api = (
        await http.post(
            f"/admin/conversations/{data.trip}/context",
            params={"tenant": data.tenant},
            json={"query": question, "budget": 2000},
        )
    ).json()
    # The working context's parts: stable memory, the verbatim turns, the recall note, the
    # question.
    assert [part["label"] for part in api["parts"]] == ["stable", "verbatim", "note", "new"]
    await _same_parts(page, api)
    await expect(page.locator("p.reuse")).to_contain_text(
        f"({api['reused_tokens']:,} tokens, what a provider can cache)"
    )
    # Why each message of the recall note was picked: the same messages, in the same order, as
    # the API, each one the note quotes.
    why = page.locator(".why-list > li")
    await expect(why).to_have_count(len(api["recalled"]))
    assert len(api["recalled"]) > 0
    [note] = [part for part in api["parts"] if part["label"] == "note"]
    quoted = api["messages"][note["start"]]["content"]
    for item, recalled in zip(await why.all(), api["recalled"], strict=True):
        assert await item.get_attribute("data-node-id") == str(recalled["node_id"])
        assert f"[#{recalled['node_id']} " in quoted
        await expect(item.locator(".rank")).to_have_text(f"rank {recalled['rank']}")

    # A conversation with a system prompt: the client's, first, with its tokens.
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{data.chat}/prompt")
    await page.fill("textarea[name=query]", question)
    await page.fill("input[name=budget]", BUDGET)
    await page.click(".prompt-form button[type=submit]")
    await expect(parts.first).to_be_visible()
    api = (
        await http.post(
            f"/admin/conversations/{data.chat}/context",
            params={"tenant": data.tenant},
            json={"query": question, "budget": int(BUDGET)},
        )
    ).json()
    labels = [part["label"] for part in api["parts"]]
    assert labels[0] == "system" and labels[-1] == "new" and "verbatim" in labels, labels
    assert api["working_context"] and api["reuse"] > 0
    await _same_parts(page, api)
    await expect(parts.first).to_contain_text(SYSTEM)


async def _same_parts(page: Page, api: dict[str, Any]) -> None:
    """The page shows the dry run's parts, in order, each with the API's label and tokens, and
    the API's total."""
    parts = page.locator("ol.parts > li.part")
    await expect(parts).to_have_count(len(api["parts"]))
    shown = [
        (await part.get_attribute("data-label"), int(await part.get_attribute("data-tokens") or -1))
        for part in await parts.all()
    ]
    assert shown == [(part["label"], part["tokens"]) for part in api["parts"]]
    for part, expected in zip(await parts.all(), api["parts"], strict=True):
        await expect(part.locator(".part-tokens")).to_have_text(f"{expected['tokens']:,} tokens")
    await expect(page.locator(".prompt-total strong")).to_have_text(f"{api['tokens']:,} tokens")


@pytest.mark.parametrize("width", [390, 1280])
async def test_every_view_fits_the_width_without_sideways_scrolling(
    browser: Browser, gateway: GatewayProcess, data: Data, width: int
) -> None:
    context = await browser.new_context(viewport={"width": width, "height": 844})
    page = await context.new_page()
    await open_ui(page, gateway.root_url, data.tenant)
    views = {
        "#/": "a.conversation-link",
        f"#/c/{data.trip}/tree": "ul.tree li[role=treeitem]",
        f"#/c/{data.trip}/search?q=refund": "li.hit",
        f"#/c/{data.trip}/jobs": "tr.job",
        "#/jobs": "tr.job",
        "#/tenants": "tr[data-tenant]",
    }
    for route, drawn in views.items():
        await page.goto(f"{gateway.root_url}/ui/{route}")
        await expect(page.locator(drawn).first).to_be_visible()
        if route.endswith("/tree"):  # open a node down to its messages
            first = page.locator("ul.tree > li[role=treeitem]").first
            await first.locator(":scope > .node-row > button.toggle").click()
            await expect(first.locator("ul.children > li").first).to_be_visible()
        wide = await page.evaluate("document.documentElement.scrollWidth")
        assert wide <= width, (route, wide)
    # Keyboard reachable: from the top of the page, Tab alone reaches the first conversation.
    await page.goto(f"{gateway.root_url}/ui/#/")
    first = page.locator("a.conversation-link").first
    await expect(first).to_be_visible()
    for _ in range(20):
        await page.keyboard.press("Tab")
        if await first.evaluate("element => element === document.activeElement"):
            break
    await expect(first).to_be_focused()
    await page.keyboard.press("Enter")
    await expect(page.locator("h1.conversation-id")).to_be_visible()
    await context.close()


async def test_the_graph_says_plainly_that_there_is_none(
    page: Page, gateway: GatewayProcess, data: Data
) -> None:
    """The gateway builds no concept graph (issue #14 has not landed): the tab says so, in
    words, without asking the gateway for one."""
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url))
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{data.trip}/graph")
    await expect(page.locator(".tab-panel .empty")).to_contain_text("No concept graph")
    await expect(page.locator(".figures .stat[data-stat=Messages] dd")).to_have_text("300")
    assert not [url for url in asked if "graph" in url]
    await expect(page.locator("main .error")).to_have_count(0)


async def test_a_dead_job_is_retried_from_the_page(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    await open_ui(page, gateway.root_url, data.tenant, "#/jobs")
    await page.click(".segmented button[data-status=dead]")
    row = page.locator(f"tr[data-job-id='{data.dead_job}']")
    await expect(row.locator(".last-error")).to_contain_text("no handler for job kind")
    await expect(row.locator("td[data-label=Conversation]")).to_have_text(data.trip)
    await row.get_by_role("button", name=f"Retry job {data.dead_job}").click()
    await expect(page.locator("p.ok")).to_contain_text(f"Job {data.dead_job} is queued")
    await expect(row).to_have_count(0)  # the dead letters are listed again, without it
    queued = await http.get("/admin/jobs", params={"tenant": data.tenant, "status": "queued"})
    [job] = [job for job in queued.json()["jobs"] if job["id"] == data.dead_job]
    assert job["attempts"] == 0


async def test_nothing_of_another_tenant_is_listed(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    hidden = await http.get(
        f"/admin/conversations/{data.secret}/tree", params={"tenant": data.other}
    )
    [hidden_node] = hidden.json()["nodes"]
    await open_ui(page, gateway.root_url, data.tenant)
    await expect(page.locator("a.conversation-link")).to_have_count(2)
    await expect(page.locator("main")).not_to_contain_text(data.secret)
    # Search across every recent conversation of the tenant: not the other tenant's.
    await page.goto(f"{gateway.root_url}/ui/#/c/{data.trip}/search")
    await page.fill("input[name=q]", "ZEBRA-4417 vault code")
    await page.check("input[name=everywhere]")
    await page.click("form[role=search] button[type=submit]")
    await expect(page.locator(".results")).not_to_contain_text("Searching")
    await expect(page.locator(".results")).not_to_contain_text("ZEBRA")
    # Jobs of the tenant only.
    await page.goto(f"{gateway.root_url}/ui/#/jobs")
    await expect(page.locator("tr.job").first).to_be_visible()
    await expect(page.locator("main")).not_to_contain_text(data.secret)
    # Asked by name or by node id, the other tenant's things are missing, said in words.
    await page.goto(f"{gateway.root_url}/ui/#/c/{data.secret}")
    await expect(page.locator(".figures .error")).to_contain_text("does not exist")
    await expect(page.locator(".tab-panel .error")).to_contain_text("does not exist")
    await page.goto(f"{gateway.root_url}/ui/#/c/{data.trip}/tree?node={hidden_node['id']}")
    await expect(page.locator(".tab-panel .error")).to_contain_text(
        f"node {hidden_node['id']} does not exist"
    )
    await expect(page.locator("main")).not_to_contain_text("ZEBRA")


async def test_deleting_a_conversation_asks_first(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    doomed = f"doomed-{RUN}"
    await seed(http, doomed, messages=6, tenant=data.tenant)
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{doomed}")
    await page.get_by_role("button", name="Delete…").click()
    dialog = page.locator("#confirm-dialog")
    await expect(dialog).to_be_visible()
    await expect(dialog).to_contain_text(f"Delete conversation {doomed}?")
    await page.keyboard.press("Escape")
    await expect(dialog).to_be_hidden()
    assert (
        await http.get(f"/admin/conversations/{doomed}", params={"tenant": data.tenant})
    ).is_success
    await page.get_by_role("button", name="Delete…").click()
    await dialog.get_by_role("button", name="Delete conversation").click()
    await expect(page.locator("main p.ok")).to_contain_text(
        f"Deleted conversation {doomed}: 6 messages"
    )
    await expect(page.get_by_role("link", name=data.trip, exact=True)).to_be_visible()
    await expect(page.get_by_role("link", name=doomed, exact=True)).to_have_count(0)
    gone = await http.get(f"/admin/conversations/{doomed}", params={"tenant": data.tenant})
    assert gone.status_code == 404


async def test_a_key_is_shown_once_and_can_be_revoked(
    page: Page, gateway: GatewayProcess, data: Data, http: httpx.AsyncClient
) -> None:
    await open_ui(page, gateway.root_url, data.tenant, "#/tenants")
    row = page.locator(f"tr[data-tenant='{data.other}']")
    await row.get_by_role("button", name="Keys").click()
    keys = page.locator("tr.keys-row")
    await keys.locator("input[name=key-name]").fill("ui test")
    await keys.get_by_role("button", name="Create key").click()
    key = await keys.locator("code.key").inner_text()
    listed = (await http.get(f"/admin/tenants/{data.other}/keys")).json()["data"]
    [record] = [k for k in listed if k["name"] == "ui test"]
    assert key.startswith(record["prefix"]) and len(key) > len(record["prefix"])
    await expect(keys.locator("table")).not_to_contain_text(key)
    await keys.get_by_role("button", name="Revoke…").click()
    await page.locator("#confirm-dialog").get_by_role("button", name="Revoke key").click()
    await expect(keys.locator("table")).not_to_contain_text("active")
    listed = (await http.get(f"/admin/tenants/{data.other}/keys")).json()["data"]
    assert [k["revoked_at"] is not None for k in listed if k["name"] == "ui test"] == [True]


# -- who may open it -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def remote_gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    """A gateway without an admin token, listening on an address of this machine that is not
    loopback: a browser reaching it there is a remote client."""
    address = own_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    with GatewayProcess(
        database_url=database_url, upstream_url=upstream.url, host=address, workers=0
    ) as process:
        yield process


@pytest.fixture(scope="module")
def guarded_gateway(database_url: str, upstream: UpstreamServer) -> Iterator[GatewayProcess]:
    with GatewayProcess(
        database_url=database_url, upstream_url=upstream.url, workers=0, admin_token=TOKEN
    ) as process:
        yield process


async def test_without_a_token_a_remote_browser_is_refused(
    page: Page, remote_gateway: GatewayProcess
) -> None:
    for path in ("/ui/", "/ui/static/app.js", "/admin/conversations"):
        answer = await page.goto(f"{remote_gateway.root_url}{path}")
        assert answer is not None and answer.status == 403, path
        body: dict[str, Any] = await answer.json()
        assert body["error"]["code"] == "admin_forbidden"
        assert "loopback" in body["error"]["message"]


async def test_without_a_token_a_page_named_by_another_host_is_refused(
    gateway: GatewayProcess, http: httpx.AsyncClient
) -> None:
    """A loopback client is not enough: the page must be addressed by a loopback name too (a
    page of another site whose name resolves to 127.0.0.1 sends its own `Host`)."""
    for path in ("/ui", "/ui/", "/ui/static/app.js", "/admin/conversations"):
        answer = await http.get(path, headers={"Host": "memstrata.example.com"})
        assert answer.status_code == 403, path
        assert answer.json()["error"]["code"] == "admin_forbidden"
    assert (await http.get("/ui/")).status_code == 200


async def test_with_a_token_set_the_page_shows_nothing_until_given_it(
    page: Page, guarded_gateway: GatewayProcess, data: Data
) -> None:
    await page.goto(f"{guarded_gateway.root_url}/ui/")
    dialog = page.locator("#token-dialog")
    await expect(dialog).to_be_visible()
    await expect(dialog).to_contain_text("refused")
    error = page.locator("main .error")
    await expect(error).to_contain_text("Could not load the conversations")
    await expect(error).to_contain_text("HTTP 401")
    await page.fill("#token-input", "not-the-token-0123456789")
    await page.click("#token-save")
    await expect(page.locator("main .error")).to_contain_text("HTTP 401")
    await expect(page.locator("a.conversation-link")).to_have_count(0)
    await expect(dialog).to_be_visible()
    await page.fill("#token-input", TOKEN)
    await page.click("#token-save")
    await expect(dialog).to_be_hidden()
    await page.select_option("#tenant", data.tenant)
    await expect(page.locator("a.conversation-link")).to_have_count(2)
    # The token stays for the tab: a reload needs no new one.
    await page.reload()
    await expect(page.locator("a.conversation-link")).to_have_count(2)
    await expect(dialog).to_be_hidden()


async def test_a_replaced_system_prompt_is_marked_in_the_tree(
    page: Page, gateway: GatewayProcess, http: httpx.AsyncClient, data: Data
) -> None:
    """A client sending only its new messages changed its system prompt: the new one is kept,
    marked as the conversation's system prompt rather than a turn; the first is not marked."""
    key = await http.post(f"/admin/tenants/{data.tenant}/keys", json={"name": "ui prompts"})
    assert key.status_code == 201, key.text
    conversation = f"prompts-{RUN}"
    for turn in range(2):
        messages = [
            {"role": "system", "content": f"It is 10:0{turn}."},
            {"role": "user", "content": f"What now? ({turn})"},
        ]
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages},
            headers={
                "Authorization": f"Bearer {key.json()['key']}",
                "X-Memstrata-Conversation": conversation,
            },
        )
        assert answer.status_code == 200, answer.text
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{conversation}/tree")
    await expect(page.locator("ul.tree > li[role=treeitem]")).to_have_count(6)
    marked = page.locator(
        "ul.tree > li[role=treeitem]", has=page.locator(".mark", has_text="system prompt")
    )
    await expect(marked).to_have_count(1)
    await expect(marked.locator(".verbatim")).to_have_text("It is 10:01.")


async def test_a_refusal_and_a_deprecated_function_call_are_shown_in_the_tree(
    page: Page, gateway: GatewayProcess, http: httpx.AsyncClient, data: Data
) -> None:
    """Replies without content: what the model refused with, and a call in the deprecated
    `function_call` form, are what the message says (it read "(no text)")."""
    conversation = f"refusals-{RUN}"
    messages = [
        {"role": "user", "content": "Write my thesis for me."},
        {"role": "assistant", "content": None, "refusal": "I can't write it for you."},
        {"role": "user", "content": "Then look up the deadline."},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "deadline", "arguments": '{"course": "<b>CS101</b>"}'},
        },
    ]
    imported = await http.post(
        f"/admin/conversations/{conversation}/messages",
        params={"tenant": data.tenant},
        json={"messages": messages},
    )
    assert imported.status_code == 201, imported.text
    await open_ui(page, gateway.root_url, data.tenant, f"#/c/{conversation}/tree")
    replies = page.locator("ul.tree > li.role-assistant")
    await expect(replies).to_have_count(2)
    await expect(replies.nth(0)).to_contain_text("refused: I can't write it for you.")
    await expect(replies.nth(1).locator(".tool-call")).to_have_text(
        'deadline({"course": "<b>CS101</b>"})'
    )
    await expect(page.get_by_text("(no text)")).to_have_count(0)
