"""The memory browser on a 10,000-message conversation: how fast it draws, and its screenshots.

`python -m bench.ui [--messages 10000] [--repeat 5] [--screenshots]` starts a throw-away
Postgres, the fake upstream and a `memstrata serve` with its in-process worker (extractive
summaries, local embeddings), imports a synthetic conversation of `--messages` messages (after
a system prompt) and a few small ones (`devkit.synthetic`), waits until every tree is built,
sends the large one `TURNS` chat requests in a 4,000-token budget (its prompts then come from
its working context: what the list's tokens sent, cached tokens, memory reuse and compactions
show), then measures:

* **the admin API** the page reads, by httpx (10 requests per `--repeat`): a page of the
  tree's roots, a page of one node's children and of one segment's messages, the whole tree at
  once (`/hierarchy`, what the page never asks for) for comparison, on the large conversation
  and on a 100-message one;
* **the page** in headless Chromium (`devkit.browser`), `--repeat` times each, from the action
  to the result drawn: the conversation opened (its tree's roots), a node opened, a search hit
  followed down to its place in the tree, and a dry-run prompt (from the working context).

Results go to `bench/results/ui.json` (the machine beside the figures). With `--screenshots`,
the main views are saved to `docs/img/ui-*.png` at 1280 px wide, and the tree at 390 px, for
the README.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import httpx
from playwright.async_api import Page, ViewportSize, async_playwright, expect

from bench import harness as h
from devkit import synthetic
from devkit.browser import launch, seed, wait_built
from devkit.gateway import GatewayProcess
from devkit.postgres import throwaway_postgres
from devkit.upstream import UpstreamServer
from memory.build import jobs
from memory.db import connect

LARGE = "support-desk"
SMALL = "weekend-trip"
IMAGES = h.REPO_ROOT / "docs" / "img"
RESULTS = h.REPO_ROOT / "bench" / "results" / "ui.json"
WIDE = {"width": 1280, "height": 900}
NARROW: ViewportSize = {"width": 390, "height": 844}
SYSTEM = "You are the support desk's assistant: answer briefly, and name the ticket."
BUDGET = 4000
TURNS = (
    "Where did we leave the refund for the broken headset?",
    "Which flight did we book to Nairobi, and with what seat?",
    "Remind me what the hotel in Lisbon cost.",
)


async def prepare(http: httpx.AsyncClient, database_url: str, messages: int) -> dict[str, Any]:
    """The conversations the page shows, their trees built, and one dead letter."""
    began = time.perf_counter()
    large = await seed(http, LARGE, messages=messages, seed=11, user="alice", system=SYSTEM)
    await seed(http, SMALL, messages=100, seed=12, user="bob")
    for index, size in enumerate((24, 60, 8)):
        await seed(http, f"chat-{index + 41}", messages=size, seed=20 + index, user="carol")
    async with asyncio.timeout(3600):
        await wait_built(http)
    built = time.perf_counter() - began
    h.log(f"{messages:,} messages imported and summarized in {built:.0f} s")
    for question in TURNS:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "gpt-4o", "messages": [{"role": "user", "content": question}]},
            headers={"X-Memstrata-Conversation": LARGE, "X-Memstrata-Budget": str(BUDGET)},
        )
        answer.raise_for_status()
    # A job no worker can run, dead-lettered at its first attempt: what the retry button is for.
    listed = (await http.get("/admin/jobs", params={"conversation": LARGE, "limit": 1})).json()
    tenant = (await http.get("/admin/tenants/default")).json()["id"]
    engine = connect(database_url)
    try:
        async with engine.begin() as conn:
            await jobs.enqueue(
                conn,
                kind="reindex-archive",
                tenant_id=tenant,
                conversation_id=listed["jobs"][0]["conversation_id"],
                max_attempts=1,
            )
    finally:
        await engine.dispose()
    async with asyncio.timeout(60):
        await wait_built(http)
    return {"built_seconds": round(built, 1), "facts": large.facts}


async def api_timings(http: httpx.AsyncClient, repeat: int) -> dict[str, Any]:
    """Milliseconds per request of what the tree view reads, large vs small conversation."""
    figures: dict[str, Any] = {}
    for conversation in (LARGE, SMALL):
        base = f"/admin/conversations/{conversation}"
        roots = (await http.get(f"{base}/tree")).json()["nodes"]
        node = roots[0]
        segment = node
        while segment["level"] > 1:
            segment = (await http.get(f"{base}/tree", params={"parent": segment["id"]})).json()[
                "nodes"
            ][0]
        calls = {
            "roots": (f"{base}/tree", {}),
            "children": (f"{base}/tree", {"parent": node["id"]}),
            "messages": (f"{base}/tree", {"parent": segment["id"]}),
            "whole_tree": (f"{base}/hierarchy", {}),
        }
        timings: dict[str, Any] = {}
        for name, (path, params) in calls.items():
            spent = []
            for _ in range(repeat * 10):
                started = time.perf_counter()
                answer = await http.get(path, params=params)
                spent.append((time.perf_counter() - started) * 1000)
                answer.raise_for_status()
            timings[name] = {**h.summarize(spent), "bytes": len(answer.content)}
        figures[conversation] = timings
    return figures


def since(started: float) -> float:
    """Milliseconds since `started` (a `time.perf_counter()`)."""
    return (time.perf_counter() - started) * 1000


async def page_timings(
    page: Page, root: str, facts: list[synthetic.Fact], repeat: int
) -> dict[str, Any]:
    """Milliseconds from a user's action to its result drawn, in Chromium."""
    found: dict[str, list[float]] = {"open": [], "expand": [], "follow_hit": [], "prompt": []}
    fact = next(f for f in facts if f.kind in ("reference", "ticket"))
    roots = page.locator("ul.tree > li[role=treeitem]")
    for _ in range(repeat):
        await page.goto(f"{root}/ui/#/")
        await page.reload()
        started = time.perf_counter()
        await page.goto(f"{root}/ui/#/c/{LARGE}/tree")
        await expect(roots.first).to_be_visible()
        found["open"].append(since(started))

        started = time.perf_counter()
        await roots.first.locator(":scope > .node-row > button.toggle").click()
        await expect(roots.first.locator("ul.children > li").first).to_be_visible()
        found["expand"].append(since(started))

        await page.goto(f"{root}/ui/#/c/{LARGE}/search")
        await page.fill("input[name=q]", fact.value)
        await page.select_option("select[name=level]", "0")
        await page.click("form[role=search] button[type=submit]")
        await expect(page.locator("li.hit").first).to_be_visible()
        started = time.perf_counter()
        await page.locator("a.hit-link").first.click()
        await expect(page.locator("li.target")).to_be_visible()
        found["follow_hit"].append(since(started))

        await page.goto(f"{root}/ui/#/c/{LARGE}/prompt")
        await page.fill("textarea[name=query]", f"What happened with {fact.value}?")
        started = time.perf_counter()
        await page.click(".prompt-form button[type=submit]")
        await expect(page.locator("section.why")).to_be_visible()
        found["prompt"].append(since(started))
    return {name: h.summarize(values) for name, values in found.items()}


async def screenshots(page: Page, root: str, facts: list[synthetic.Fact]) -> list[str]:
    """The README's images of the main views."""
    saved: list[str] = []

    async def shot(name: str, *, full: bool = False) -> None:
        path = IMAGES / f"ui-{name}.png"
        await page.screenshot(path=str(path), full_page=full)
        saved.append(str(path.relative_to(h.REPO_ROOT)))

    await page.goto(f"{root}/ui/#/")
    await expect(page.locator("a.conversation-link").first).to_be_visible()
    await shot("conversations")

    await page.goto(f"{root}/ui/#/c/{LARGE}/tree")
    node = page.locator("ul.tree > li[role=treeitem]").first
    while await node.get_attribute("data-level") != "0":
        await node.locator(":scope > .node-row > button.toggle").click()
        node = node.locator(":scope > ul.children > li[role=treeitem]").first
        await expect(node).to_be_visible()
    await node.scroll_into_view_if_needed()
    await page.evaluate("window.scrollBy(0, 260)")
    await shot("tree")

    question = "Which flight did we book to Nairobi, and with what seat?"
    await page.goto(f"{root}/ui/#/c/{LARGE}/search")
    await page.fill("input[name=q]", question)
    await page.click("form[role=search] button[type=submit]")
    await expect(page.locator("li.hit").first).to_be_visible()
    await page.evaluate("document.querySelector('.tabs').scrollIntoView()")
    await shot("search")

    await page.goto(f"{root}/ui/#/c/{LARGE}/prompt")
    await page.fill("textarea[name=query]", question)
    await page.fill("input[name=budget]", str(BUDGET))
    await page.click(".prompt-form button[type=submit]")
    await expect(page.locator("section.why")).to_be_visible()
    # The note folded, so that the parts and why the note quotes each message show together.
    await page.locator("li.part-note > details > summary").click()
    await page.evaluate("document.querySelector('.prompt-total').scrollIntoView()")
    await shot("prompt")

    await page.goto(f"{root}/ui/#/jobs")
    await page.click(".segmented button[data-status=dead]")
    await expect(page.locator("tr.job-dead").first).to_be_visible()
    await shot("jobs")

    await page.set_viewport_size(NARROW)
    await page.goto(f"{root}/ui/#/c/{SMALL}/tree")
    first = page.locator("ul.tree > li[role=treeitem]").first
    await first.locator(":scope > .node-row > button.toggle").click()
    await expect(first.locator("ul.children > li").first).to_be_visible()
    await page.locator(".tabs").scroll_into_view_if_needed()
    await shot("phone")
    return saved


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--screenshots", action="store_true", help="write docs/img/ui-*.png")
    args = parser.parse_args()
    settings: dict[str, Any] = {"summary_mode": "extractive", "log_level": "warning", "workers": 2}
    with (
        throwaway_postgres(prefix="memstrata-bench-ui-") as postgres,
        UpstreamServer() as upstream,
        GatewayProcess(
            database_url=postgres.url, upstream_url=upstream.url, startup_timeout=120, **settings
        ) as gateway,
    ):
        async with httpx.AsyncClient(base_url=gateway.root_url, timeout=600) as http:
            prepared = await prepare(http, postgres.url, args.messages)
            stats = (await http.get(f"/admin/conversations/{LARGE}")).json()
            api = await api_timings(http, args.repeat)
        async with async_playwright() as playwright:
            browser = await launch(playwright)
            page = await browser.new_page(viewport=WIDE)
            measured = await page_timings(page, gateway.root_url, prepared["facts"], args.repeat)
            saved = (
                await screenshots(page, gateway.root_url, prepared["facts"])
                if args.screenshots
                else []
            )
            await browser.close()
    results = {
        "machine": h.machine_info(),
        "messages": args.messages,
        "levels": stats["levels"],
        "turns": {
            name: stats[name]
            for name in ("requests", "tokens_sent", "tokens_cached", "memory_reuse", "compactions")
        },
        "built_seconds": prepared["built_seconds"],
        "api_ms": api,
        "page_ms": measured,
        "screenshots": saved,
    }
    h.write_results(RESULTS, results)
    h.log(f"levels: {stats['levels']}; turns: {results['turns']}")
    for conversation, timings in api.items():
        for name, figures in timings.items():
            h.log(f"api {conversation} {name}: p50 {figures['p50']} ms, {figures['bytes']:,} bytes")
    for name, figures in measured.items():
        h.log(f"page {name}: p50 {figures['p50']} ms (median of {figures['n']})")


if __name__ == "__main__":
    asyncio.run(main())
