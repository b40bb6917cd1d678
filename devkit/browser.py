"""A real headless Chromium for the memory browser's tests and screenshots, and the data they show.

`chromium()` is the system's browser (Debian's `chromium` package: `/usr/bin/chromium`, else the
one on `PATH`), or None; Playwright drives it by its `executable_path`, with `ARGS` (no sandbox,
no GPU, no network of its own: no updates, sync or QUIC), so `playwright install` never runs.
`launch(playwright)` starts it.

`seed(http, conversation, messages=n, seed=s)` imports a synthetic conversation
(`devkit.synthetic`), after a system prompt when given one, through the admin API of the
gateway `http` reaches, and `wait_built(http)` waits until the tenant's queue has nothing left
to do (a gateway or worker builds the tree meanwhile).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx

from devkit import synthetic

SYSTEM_CHROMIUM = Path("/usr/bin/chromium")
ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
_BATCH = 2000


def chromium() -> str | None:
    """The system's Chromium, if installed."""
    if SYSTEM_CHROMIUM.exists():
        return str(SYSTEM_CHROMIUM)
    return shutil.which("chromium") or shutil.which("chromium-browser")


async def launch(playwright: Any) -> Any:
    """A headless Chromium (Playwright's `Browser`) on the system's executable."""
    executable = chromium()
    if executable is None:
        raise RuntimeError("no Chromium: install Debian's `chromium` (apt-get install chromium)")
    return await playwright.chromium.launch(executable_path=executable, args=list(ARGS))


async def seed(
    http: httpx.AsyncClient,
    conversation: str,
    *,
    messages: int,
    seed: int = 0,
    tenant: str | None = None,
    user: str | None = None,
    system: str | None = None,
) -> synthetic.Conversation:
    """Import a synthetic conversation of `messages` messages (with their times), after the
    `system` prompt if given, through the admin API, `_BATCH` at a time; its processing is
    queued."""
    generated = synthetic.generate(messages, seed=seed)
    rows = generated.with_created_at()
    if system is not None:
        rows = [{"role": "system", "content": system, "created_at": rows[0]["created_at"]}, *rows]
    params = {"tenant": tenant} if tenant else {}
    for start in range(0, len(rows), _BATCH):
        body: dict[str, Any] = {"messages": rows[start : start + _BATCH]}
        if user is not None:
            body["user"] = user
        answer = await http.post(
            f"/admin/conversations/{conversation}/messages", params=params, json=body
        )
        answer.raise_for_status()
    return generated


async def wait_built(http: httpx.AsyncClient, *, tenant: str | None = None) -> None:
    """Wait until the tenant has no queued or running job (its trees are built); callers
    bound the wait (`asyncio.timeout`)."""
    params = {"tenant": tenant} if tenant else {}
    while True:
        answer = await http.get("/admin/jobs", params={**params, "limit": 1})
        answer.raise_for_status()
        depth = answer.json()["depth"]
        if depth["queued"] == 0 and depth["running"] == 0:
            return
        await asyncio.sleep(0.2)
