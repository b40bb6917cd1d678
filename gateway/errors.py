"""Errors at the HTTP edge, all answered in OpenAI's shape.

`{"error": {"message", "type", "param", "code"}}` with the status OpenAI would use. The domain's
exceptions (`memory.errors`) are mapped to statuses here and only here; upstream failures
have their own classes because an upstream error answer keeps its status and body unchanged.
Anything else that escapes a route is a bug: 500 `server_error`, with the request id.
"""

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.logs import REQUEST_ID_HEADER, request_id
from memory.errors import (
    Conflict,
    ContextOverflow,
    InvalidInput,
    MemstrataError,
    NotFound,
    ProviderError,
    StorageUnavailable,
)


class GatewayError(Exception):
    """An error answered to the client as-is, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


class UpstreamUnavailable(GatewayError):
    """The upstream could not be reached or broke the connection (502)."""

    def __init__(self, message: str) -> None:
        super().__init__(502, message, type="upstream_error", code="upstream_unavailable")


class UpstreamTimeout(GatewayError):
    """The upstream did not answer in time (504)."""

    def __init__(self, message: str) -> None:
        super().__init__(504, message, type="upstream_error", code="upstream_timeout")


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(error: GatewayError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(error.message, type=error.type, param=error.param, code=error.code),
        status_code=error.status,
        headers={**error.headers, **(headers or {})},
    )


def _domain_status(exc: MemstrataError) -> tuple[int, str, str | None]:
    if isinstance(exc, ContextOverflow):
        return 400, "invalid_request_error", "context_length_exceeded"
    if isinstance(exc, InvalidInput):
        return 400, "invalid_request_error", None
    if isinstance(exc, NotFound):
        return 404, "not_found_error", "not_found"
    if isinstance(exc, Conflict):
        return 409, "conflict_error", "conflict"
    if isinstance(exc, StorageUnavailable):
        return 503, "service_unavailable", "storage_unavailable"
    if isinstance(exc, ProviderError):
        return 502, "upstream_error", "provider_error"
    return 500, "server_error", None


def from_domain(exc: MemstrataError) -> GatewayError:
    """The edge's answer to a domain error."""
    status, type_, code = _domain_status(exc)
    param = exc.param if isinstance(exc, InvalidInput) else None
    return GatewayError(status, str(exc), type=type_, param=param, code=code)


def param_name(path: Sequence[str | int]) -> str | None:
    """A place in a body named as OpenAI names a parameter: indexes in brackets, fields
    dotted (`messages[0].content`), where pydantic writes `messages.0.content`."""
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else part
    return name or None


def validation_param(location: Sequence[str | int], body: Any, *, missing: bool) -> str | None:
    """The parameter a pydantic error's `location` in `body` names (`param_name`).

    Pydantic also names the member of a union a value failed as (`content.str`,
    `content.list[...]`); that is no field of the body, so it is left out: a name that indexes
    no object there is such a member, unless the error says the field is `missing`."""
    fields: list[str | int] = []
    value = body
    last = len(location) - 1
    for index, part in enumerate(location):
        if isinstance(part, int):
            fields.append(part)
            value = value[part] if isinstance(value, list) and 0 <= part < len(value) else None
        elif isinstance(value, dict) and (part in value or (missing and index == last)):
            fields.append(part)
            value = value.get(part)
    return param_name(fields)


# Where FastAPI found what it validated; a body's fields are named without it.
_SOURCES = ("body", "query", "path", "header", "cookie")


def _validation_param(exc: RequestValidationError) -> str | None:
    for error in exc.errors():
        location = list(error.get("loc", ()))
        source = location.pop(0) if location and location[0] in _SOURCES else "body"
        if source == "body":
            param = validation_param(location, exc.body, missing=error.get("type") == "missing")
        else:
            param = param_name(location)
        if param:
            return param
    return None


def install_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape."""

    async def on_gateway(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def on_domain(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, MemstrataError)
        return error_response(from_domain(exc))

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        param = _validation_param(exc)
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", exc))
        return error_response(GatewayError(400, message, param=param, code="invalid_value"))

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # A 405's `Allow` (the methods the path takes) goes with it, as HTTP asks.
        return error_response(
            GatewayError(
                exc.status_code, str(exc.detail), type=type_, headers=dict(exc.headers or {})
            )
        )

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug: answered in OpenAI's shape with the request id to quote; the traceback is
        # logged by the server, with the same id (`gateway.logs`).
        rid = request_id.get()
        suffix = f" (request id {rid})" if rid else ""
        return error_response(
            GatewayError(
                500,
                f"the gateway failed unexpectedly{suffix}",
                type="server_error",
                code="internal_error",
                headers={REQUEST_ID_HEADER: rid} if rid else None,
            )
        )

    app.add_exception_handler(GatewayError, on_gateway)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(MemstrataError, on_domain)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
