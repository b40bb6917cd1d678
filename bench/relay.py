"""The practical floor: a minimal pass-through relay (httpx + Starlette, no memory).

    python -m bench.relay --port P --upstream http://127.0.0.1:U/v1

Every request under `/v1/` is sent to the same path of the upstream with its body and content
type and authorization headers, by one of `--clients` httpx clients in turn, and the answer is
relayed: an event stream chunk by chunk, any other answer read whole. It is served by uvicorn
with the same loop and HTTP parser the gateway gets (uvloop, httptools), so the difference
between it and the gateway is what memstrata adds: parsing and validating, storing, assembling,
recording.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

_FORWARDED = ("content-type", "authorization")
_DROPPED = frozenset({"content-length", "transfer-encoding", "connection", "date", "server"})


def create_relay_app(upstream: str, *, clients: int = 16) -> Starlette:
    # Several clients, used in turn: one httpx client's connection pool slows down sharply
    # with many requests in flight (see bench/README.md), and a floor should not.
    pool = [
        httpx.AsyncClient(
            base_url=upstream.rstrip("/"),
            timeout=httpx.Timeout(600, connect=10),
            limits=httpx.Limits(
                max_connections=64, max_keepalive_connections=64, keepalive_expiry=2.0
            ),
        )
        for _ in range(max(clients, 1))
    ]
    turn = itertools.count()

    async def relay(request: Request) -> Response:
        client = pool[next(turn) % len(pool)]
        headers = {name: request.headers[name] for name in _FORWARDED if name in request.headers}
        upstream_request = client.build_request(
            request.method,
            "/" + request.path_params["path"],
            content=await request.body(),
            headers=headers,
        )
        answer = await client.send(upstream_request, stream=True)
        relayed = {k: v for k, v in answer.headers.items() if k.lower() not in _DROPPED}
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                answer.aiter_raw(),
                status_code=answer.status_code,
                headers=relayed,
                background=BackgroundTask(answer.aclose),
            )
        content = await answer.aread()
        await answer.aclose()
        return Response(content, status_code=answer.status_code, headers=relayed)

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        for client in pool:
            await client.aclose()

    return Starlette(
        routes=[
            Route("/v1/{path:path}", relay, methods=["GET", "POST"]),
            Route("/healthz", healthz),
        ],
        lifespan=lifespan,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL ending in /v1")
    parser.add_argument("--clients", type=int, default=16, help="httpx clients used in turn")
    args = parser.parse_args(argv)
    uvicorn.run(
        create_relay_app(args.upstream, clients=args.clients),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
