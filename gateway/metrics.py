"""Prometheus metrics of one app (served at `GET /metrics` by `gateway.routes.metrics`).

`Metrics` owns a `CollectorRegistry` of its own (one per app: tests build many apps in one
process, and nothing here is global). What moves them:

* `MetricsMiddleware` (pure ASGI, outermost): requests by method, route *template* (never the
  raw path, whose ids would make unbounded label values) and status; request durations; the
  gateway's own overhead on chat requests, read from `X-Memstrata-Overhead-Ms`; and streams
  open, counted from the `text/event-stream` response start to its last body chunk (or the
  client leaving).
* `Upstream` calls `observe_upstream` with the time to the upstream's response headers.
* `Turn.record` calls `observe_request` with the prompt tokens sent, what the whole history
  would have cost, the tokens that repeated the previous prompt's prefix (memory reuse is
  `memstrata_prompt_reused_tokens_total / memstrata_prompt_tokens_total`) and what the
  upstream reported (cached tokens included); `Turn.sent` calls `observe_compaction` for a
  prompt whose working context was compacted; the degraded path calls `degraded.inc()`.
* The job worker calls `observe_job` with each job's duration and outcome.
* Queue depth and summaries by level and method are read from the database on scrape
  (`refresh`), at most once per `refresh_seconds`; `memstrata_database_up` says whether the
  last read worked. They cover every process sharing the database; the rest is this process's.

No metric carries a tenant, a conversation or any content as a label.
"""

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.logs import route_template
from memory.build import backlog, tree
from memory.db import transaction
from memory.errors import StorageUnavailable
from memory.write.appends import RequestStats

log = logging.getLogger(__name__)

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_FAST_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SLOW_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _DatabaseFigures(Collector):
    """Gauges read from the database by `Metrics.refresh` and served from that cache."""

    def __init__(self) -> None:
        self.up = 0.0
        self.depth: dict[str, int] = {}
        self.summaries: dict[tuple[int, str], int] = {}

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(
            "memstrata_database_up", "1 if the last read of the database for metrics worked"
        )
        up.add_metric([], self.up)
        yield up
        depth = GaugeMetricFamily(
            "memstrata_jobs",
            "Jobs in the queue by status (failures: failed at least once, not done)",
            labels=["status"],
        )
        for status, count in sorted(self.depth.items()):
            depth.add_metric([status], count)
        yield depth
        summaries = GaugeMetricFamily(
            "memstrata_summaries", "Summary nodes by level and method", labels=["level", "method"]
        )
        for (level, method), count in sorted(self.summaries.items()):
            summaries.add_metric([str(level), method], count)
        yield summaries


class Metrics:
    """The metrics of one app (see the module's docstring)."""

    def __init__(self, *, refresh_seconds: float = 5.0) -> None:
        self.registry = registry = CollectorRegistry()
        self.refresh_seconds = refresh_seconds
        self.requests = Counter(
            "memstrata_http_requests",
            "HTTP requests by method, route template and status",
            ["method", "route", "status"],
            registry=registry,
        )
        self.request_seconds = Histogram(
            "memstrata_http_request_duration_seconds",
            "Time to answer an HTTP request (a stream: until its last chunk)",
            ["method", "route"],
            buckets=_SLOW_BUCKETS,
            registry=registry,
        )
        self.overhead = Histogram(
            "memstrata_gateway_overhead_seconds",
            "Time the gateway added to a chat request, not waiting for the upstream",
            buckets=_FAST_BUCKETS,
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "memstrata_request_stage_seconds",
            "Time a chat request spent in each stage of the request path (`memory.stages`)",
            ["stage"],
            buckets=_FAST_BUCKETS,
            registry=registry,
        )
        self.upstream_latency = Histogram(
            "memstrata_upstream_latency_seconds",
            "Time until the upstream's response headers, by path and outcome",
            ["path", "outcome"],
            buckets=_SLOW_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "memstrata_prompt_tokens",
            "Prompt tokens sent upstream for answered chat requests",
            registry=registry,
        )
        self.history_tokens = Counter(
            "memstrata_history_tokens",
            "Tokens the whole histories of those requests would have cost",
            registry=registry,
        )
        self.reused_tokens = Counter(
            "memstrata_prompt_reused_tokens",
            "Prompt tokens that repeated the previous prompt's prefix (memory reuse)",
            registry=registry,
        )
        self.upstream_prompt_tokens = Counter(
            "memstrata_upstream_prompt_tokens",
            "Prompt tokens the upstream reported in usage (summed over hidden tool rounds)",
            registry=registry,
        )
        self.upstream_cached_tokens = Counter(
            "memstrata_upstream_cached_tokens",
            "Prompt tokens the upstream reported as cached (prompt_tokens_details.cached_tokens)",
            registry=registry,
        )
        self.compactions = Counter(
            "memstrata_compactions",
            "Working contexts compacted for a turn (the turns whose prompt prefix changed)",
            registry=registry,
        )
        self.streams_open = Gauge(
            "memstrata_streams_open", "Streamed responses being relayed now", registry=registry
        )
        self.degraded = Counter(
            "memstrata_degraded_requests",
            "Chat requests forwarded unchanged because the database was down (fail-open)",
            registry=registry,
        )
        self.job_seconds = Histogram(
            "memstrata_job_duration_seconds",
            "Time to run a background job in this process, by kind and outcome",
            ["kind", "outcome"],
            buckets=_SLOW_BUCKETS,
            registry=registry,
        )
        self.job_failures = Counter(
            "memstrata_job_failures",
            "Failed attempts of background jobs in this process, by kind",
            ["kind"],
            registry=registry,
        )
        self._figures = _DatabaseFigures()
        registry.register(self._figures)
        ProcessCollector(registry=registry)
        self._refreshed_at: float | None = None

    # -- observers -------------------------------------------------------------------------

    def observe_upstream(self, path: str, seconds: float, outcome: str) -> None:
        self.upstream_latency.labels(path, outcome).observe(seconds)

    def observe_request(self, stats: RequestStats) -> None:
        self.prompt_tokens.inc(max(stats.sent, 0))
        self.history_tokens.inc(max(stats.full, 0))
        self.reused_tokens.inc(max(stats.reused, 0))
        self.upstream_prompt_tokens.inc(stats.upstream_prompt)
        self.upstream_cached_tokens.inc(stats.upstream_cached)

    def observe_stages(self, record: Mapping[str, float]) -> None:
        for name, seconds in record.items():
            self.stage_seconds.labels(name).observe(seconds)

    def observe_job(self, kind: str, seconds: float, outcome: str) -> None:
        self.job_seconds.labels(kind, outcome).observe(seconds)
        if outcome == "failed":
            self.job_failures.labels(kind).inc()

    # -- scraping --------------------------------------------------------------------------

    async def refresh(self, engine: AsyncEngine) -> None:
        """Read queue depth and summary counts, unless read less than `refresh_seconds` ago."""
        now = time.monotonic()
        if self._refreshed_at is not None and now - self._refreshed_at < self.refresh_seconds:
            return
        self._refreshed_at = now
        try:
            async with transaction(engine) as conn:
                depth = await backlog.depth(conn)
                summaries = await tree.summary_counts(conn)
        except StorageUnavailable as exc:
            log.warning("metrics cannot read the database: %s", exc)
            self._figures.up = 0.0
            return
        self._figures.up = 1.0
        self._figures.depth = depth
        self._figures.summaries = summaries

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _mounts(app: ASGIApp) -> Iterator[str]:
    for route in getattr(app, "routes", ()):
        if isinstance(route, Mount):
            yield route.path


class MetricsMiddleware:
    """Counts every HTTP request by route template and status (see the module's docstring)."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, routes: ASGIApp) -> None:
        self.app = app
        self.metrics = metrics
        self._routes = routes

    def _route(self, scope: Scope, status: int) -> str:
        template = route_template(scope)
        if template is not None:
            return template
        for mount in _mounts(self._routes):
            if scope["path"] == mount or scope["path"].startswith(mount + "/"):
                return mount
        return "unmatched" if status in (404, 405) else "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500
        streaming = False
        metrics = self.metrics

        async def observed(message: Message) -> None:
            nonlocal status, streaming
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = message.get("headers", [])
                content_type = _header(headers, b"content-type") or b""
                if content_type.startswith(b"text/event-stream"):
                    streaming = True
                    metrics.streams_open.inc()
                overhead = _header(headers, b"x-memstrata-overhead-ms")
                if overhead is not None:
                    with contextlib.suppress(ValueError):
                        metrics.overhead.observe(float(overhead) / 1000)
            elif (
                message["type"] == "http.response.body"
                and streaming
                and not message.get("more_body", False)
            ):
                streaming = False
                metrics.streams_open.dec()
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            if streaming:  # the client left, or the app failed, mid-stream
                metrics.streams_open.dec()
            route = self._route(scope, status)
            method = str(scope.get("method", ""))
            metrics.requests.labels(method, route, str(status)).inc()
            metrics.request_seconds.labels(method, route).observe(time.perf_counter() - started)
