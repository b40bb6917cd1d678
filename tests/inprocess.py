"""Run the app in-process for API tests: `async with running_app(settings) as app: ...`.

The lifespan is entered and left inside one task of its own (the MCP session manager's cancel
scope must be exited by the task that entered it; pytest-asyncio runs a fixture's setup and
teardown in different tasks). `app.client(host=...)` reaches the app without a socket, posing as
a client at `host`, with the lifespan's state handed to each request the way a server does.
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from gateway.app import create_app
from gateway.settings import Settings
from gateway.state import State


@dataclasses.dataclass
class App:
    """The app with its lifespan entered."""

    app: FastAPI
    state: State

    def client(
        self,
        *,
        host: str = "127.0.0.1",
        headers: dict[str, str] | None = None,
        raise_app_exceptions: bool = True,
    ) -> httpx.AsyncClient:
        app, lifespan = self.app, {"memstrata": self.state}

        async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
            scope["state"] = dict(lifespan)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(
            app=asgi, client=(host, 1234), raise_app_exceptions=raise_app_exceptions
        )
        return httpx.AsyncClient(
            transport=transport, base_url="http://localhost", headers=headers, timeout=30
        )


@asynccontextmanager
async def running_app(settings: Settings) -> AsyncIterator[App]:
    app = create_app(settings)
    ready: asyncio.Future[State] = asyncio.get_running_loop().create_future()
    leave = asyncio.Event()

    async def hold() -> None:
        try:
            async with app.router.lifespan_context(app) as lifespan_state:
                assert lifespan_state is not None
                ready.set_result(lifespan_state["memstrata"])
                await leave.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise

    task = asyncio.create_task(hold())
    try:
        yield App(app, await ready)
    finally:
        leave.set()
        await task
