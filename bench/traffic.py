"""The load generator the performance scenarios share (`bench.overhead`, `bench.load`,
`bench.scale`, `bench.profile`, `bench.context_latency`, `bench.side_by_side`).

`run_load()` keeps `concurrency` requests in flight until a request count or a duration is
reached, each a `Call` prepared before the clock starts, and records each request's latency,
time to first body byte, status and the gateway's own `X-Memstrata-Overhead-Ms` (`Sample`);
`load_client()` gives one `httpx.AsyncClient` per worker (`ClientPool`), and
`latency_figures()` turns samples into the milliseconds every report prints
(`bench.harness.summarize`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from bench.harness import OVERHEAD_HEADER, summarize


@dataclass(frozen=True)
class Call:
    """One request to send: everything is prepared before the clock starts."""

    url: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    keep_body: bool = False


@dataclass
class Sample:
    """What one request did (times in seconds from `run_load`'s start / of its own)."""

    worker: int
    started: float
    latency: float
    ttfb: float | None
    status: int
    error: str | None = None
    overhead_ms: float | None = None
    body: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300


async def send(client: httpx.AsyncClient, call: Call, *, worker: int, origin: float) -> Sample:
    """Send one request, reading the answer as it arrives: the time to its first body byte
    (for a stream, the first event) and its total latency."""
    started = time.perf_counter()
    ttfb: float | None = None
    chunks: list[bytes] = []
    try:
        async with client.stream("POST", call.url, content=call.body, headers=call.headers) as r:
            async for chunk in r.aiter_raw():
                if ttfb is None:
                    ttfb = time.perf_counter() - started
                if call.keep_body or r.status_code >= 400:
                    chunks.append(chunk)
            latency = time.perf_counter() - started
            overhead = r.headers.get(OVERHEAD_HEADER)
            body = b"".join(chunks)
            error = None if r.status_code < 400 else body[:300].decode(errors="replace")
            return Sample(
                worker=worker,
                started=started - origin,
                latency=latency,
                ttfb=ttfb,
                status=r.status_code,
                error=error,
                overhead_ms=float(overhead) if overhead else None,
                body=body if call.keep_body else None,
            )
    except (httpx.HTTPError, OSError) as exc:
        return Sample(
            worker=worker,
            started=started - origin,
            latency=time.perf_counter() - started,
            ttfb=ttfb,
            status=0,
            error=f"{type(exc).__name__}: {exc}",
        )


Factory = Callable[[int, int], Call]
"""(request index, worker number) -> the request to send."""
Observer = Callable[[int, Sample], None]
"""(worker number, sample): called after each request (a conversation script reads replies)."""


async def run_load(
    client: Client,
    factory: Factory,
    *,
    concurrency: int,
    count: int | None = None,
    duration: float | None = None,
    observe: Observer | None = None,
) -> list[Sample]:
    """Keep `concurrency` requests in flight until `count` were started or `duration` seconds
    have passed (whichever comes first); every request's `Sample`, in completion order."""
    if count is None and duration is None:
        raise ValueError("run_load needs a count or a duration")
    origin = time.perf_counter()
    deadline = origin + duration if duration is not None else None
    samples: list[Sample] = []
    issued = 0

    async def worker(number: int) -> None:
        nonlocal issued
        while True:
            if count is not None and issued >= count:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            index = issued
            issued += 1
            own = client.for_worker(number) if isinstance(client, ClientPool) else client
            sample = await send(own, factory(index, number), worker=number, origin=origin)
            samples.append(sample)
            if observe is not None:
                observe(number, sample)

    await asyncio.gather(*(worker(number) for number in range(concurrency)))
    return samples


class ClientPool:
    """One `httpx.AsyncClient` per load-generator worker.

    A single client shared by many concurrent requests does not scale: on this machine one
    client reached 340 requests/s against the fake upstream at concurrency 8 but only 111 at 32
    and 61 at 64 (its connection pool is the bottleneck), while one client per worker reached
    550-580. Attribute access other than `for_worker` goes to the first client, for the
    occasional admin call."""

    def __init__(self, concurrency: int, *, timeout: float = 120.0) -> None:
        self.clients = [
            httpx.AsyncClient(
                timeout=httpx.Timeout(timeout),
                # Below uvicorn's 5 s keep-alive: never reuse a connection the server is closing.
                limits=httpx.Limits(
                    max_connections=2, max_keepalive_connections=2, keepalive_expiry=2.0
                ),
                trust_env=False,
            )
            for _ in range(max(concurrency, 1))
        ]

    def for_worker(self, worker: int) -> httpx.AsyncClient:
        return self.clients[worker % len(self.clients)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.clients[0], name)

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


Client = httpx.AsyncClient | ClientPool
"""What the load generator sends with: one client, or one per worker."""


def load_client(concurrency: int, *, timeout: float = 120.0) -> ClientPool:
    """The load generator's clients (a `ClientPool`; used like an `httpx.AsyncClient`)."""
    return ClientPool(concurrency, timeout=timeout)


def latency_figures(samples: Sequence[Sample]) -> dict[str, Any]:
    """Latency, time to first byte and the gateway's own overhead header, in milliseconds."""
    good = [s for s in samples if s.ok]
    errors = len(samples) - len(good)
    figures: dict[str, Any] = {
        "latency_ms": summarize([s.latency * 1000 for s in good], errors=errors),
        "ttfb_ms": summarize([s.ttfb * 1000 for s in good if s.ttfb is not None], errors=errors),
    }
    overheads = [s.overhead_ms for s in good if s.overhead_ms is not None]
    if overheads:
        figures["overhead_header_ms"] = summarize(overheads)
    first_errors = sorted({s.error or f"HTTP {s.status}" for s in samples if not s.ok})[:5]
    if first_errors:
        figures["error_examples"] = first_errors
    return figures
