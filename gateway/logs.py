"""Structured logs: one JSON object per line, each carrying the id of the request it concerns.

`configure(level=..., format="json")` installs `JsonFormatter` on the root logger (uvicorn's own
loggers propagate to it; its access log is replaced by `RequestIdMiddleware`'s one line per
request). A line holds `time`, `level`, `logger`, `message`, `request_id` (when logged while
serving a request) and every `extra={...}` field of the call; an exception adds `exc`.

`RequestIdMiddleware` takes the client's `X-Request-Id` when it is sane (1-128 characters of
`A-Za-z0-9._:-`), or makes one, keeps it in a context variable for the request's duration, and
echoes it in the response's `X-Request-Id`. An upstream answer's own `X-Request-Id` is relayed
as `X-Upstream-Request-Id` instead, and logged beside ours. The access line says method, route,
status, duration and that upstream id, never a body or another header's value.

What is never logged at INFO or above, by memstrata's own code: message contents, gateway keys,
upstream keys, admin tokens. Code that logs follows that rule; the access line logs the route
template, not the raw path, and no query string.
"""

import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Final, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER: Final = "X-Request-Id"

request_id: ContextVar[str | None] = ContextVar("memstrata_request_id", default=None)
"""The id of the request being served, if any."""

_SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Attributes every LogRecord has: anything else on a record came from `extra=`.
_STANDARD = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys()
    | {"message", "asctime", "taskName", "color_message"}
)
access_log = logging.getLogger("memstrata.access")
# Routes polled by orchestrators and scrapers: their access lines are DEBUG.
_PROBES: Final = frozenset({"/healthz", "/readyz", "/metrics"})


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        current = request_id.get()
        if current is not None:
            line["request_id"] = current
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class _RequestIdFilter(logging.Filter):
    """Adds the request id to plain-text lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get() or "-"
        return True


def configure(*, level: str, format: Literal["json", "text"] = "json") -> None:
    """Send every log line to stderr in `format`, at `level` and above."""
    handler = logging.StreamHandler(sys.stderr)
    if format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.addFilter(_RequestIdFilter())
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
        )
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # uvicorn's loggers: through the root handler, in our format.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    # One line per upstream call is noise at INFO (and httpx would log URLs). The openai SDK
    # (summaries, upstream embeddings) calls through its own fork of httpx, `httpx2`.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)


def route_template(scope: Scope) -> str | None:
    """The template of the route that served the request (`/admin/nodes/{node_id}`), if any.

    FastAPI ≥ 0.16x keeps included routers as they are and records the route's full template in
    the scope's `fastapi.effective_route_context`; `scope["route"].path` is then relative to its
    own router. Older versions only set `scope["route"]`, with the full path."""
    context = (scope.get("fastapi") or {}).get("effective_route_context")
    template = getattr(context, "path_format", None)
    if isinstance(template, str):
        return template
    template = getattr(scope.get("route"), "path", None)
    return template if isinstance(template, str) else None


def _incoming_id(headers: Mapping[bytes, bytes]) -> str:
    raw = headers.get(b"x-request-id")
    if raw is not None:
        candidate = raw.decode("latin-1")
        if _SANE_ID.fullmatch(candidate):
            return candidate
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Gives every HTTP request an id, echoed and logged (see the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {key.lower(): value for key, value in scope.get("headers", [])}
        rid = _incoming_id(headers)
        token = request_id.set(rid)
        started = time.perf_counter()
        status = 500
        upstream_id: str | None = None

        async def echoed(message: Message) -> None:
            nonlocal status, upstream_id
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = []
                for key, value in message.get("headers", []):
                    if key.lower() == b"x-request-id":  # the upstream's own, relayed
                        upstream_id = value.decode("latin-1")
                        headers.append((b"x-upstream-request-id", value))
                    else:
                        headers.append((key, value))
                headers.append((b"x-request-id", rid.encode()))
                message["headers"] = headers
            await send(message)

        try:
            await self.app(scope, receive, echoed)
        except BaseException:
            # Left set: the 500 answer and the traceback logged outside us carry the id (the
            # next request served by this task sets its own).
            self._access(scope, status, started, upstream_id)
            raise
        self._access(scope, status, started, upstream_id)
        request_id.reset(token)

    @staticmethod
    def _access(scope: Scope, status: int, started: float, upstream_id: str | None) -> None:
        route = route_template(scope) or "-"
        access_log.log(
            logging.DEBUG if route in _PROBES else logging.INFO,
            "%s %s %d",
            scope.get("method", ""),
            route,
            status,
            extra={
                "method": scope.get("method", ""),
                "route": route,
                "status": status,
                "duration_ms": round((time.perf_counter() - started) * 1000, 2),
                **({"upstream_request_id": upstream_id} if upstream_id else {}),
            },
        )
