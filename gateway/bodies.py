"""Request bodies: read within a size limit, parsed and checked off the event loop.

Every JSON body the gateway reads itself (chat completions, embeddings, responses) goes through
`read_json`, which refuses, before anything is stored or forwarded:

* a `Content-Type` that is not JSON (415; a body without one is read as JSON, as OpenAI does);
* a body over `MEMSTRATA_MAX_BODY_BYTES` (413), refused from its declared length before it is
  read when it declares one;
* text that is not JSON in UTF-8 (a UTF-8 byte order mark is ignored; UTF-16 and UTF-32, which
  the parser would detect, and surrogates encoded as UTF-8 bytes are refused), `NaN`/`Infinity`,
  and numbers too large for a double (`1e400`) (400: none of them can be sent upstream as JSON);
* nesting deeper than `MAX_DEPTH` (400);
* unpaired surrogates (`"\\ud800"`) anywhere, which no UTF-8 request can carry upstream (400).

Bodies over `OFF_LOOP_BYTES` are parsed and checked in a worker thread, so that a large body does
not hold the event loop (and `/healthz`) while it is read; `then` lets a caller validate the
parsed body in the same thread. A NUL or a surrogate can reach a parsed string only through a
JSON escape (raw control characters and bytes that are not UTF-8 are refused by the parser):
a body whose raw bytes hold no such escape (`unsafe_escapes`) has its strings left unread,
and its caller is told so, where walking every string cost ~1.5 ms per 50 kB of history resent.
"""

import json
import math
import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import anyio
from fastapi import Request

from gateway.errors import GatewayError, param_name

MAX_DEPTH: Final = 64
"""Deepest nesting of arrays and objects a body may have."""
OFF_LOOP_BYTES: Final = 64 * 1024
"""Bodies larger than this are parsed in a worker thread."""

T = TypeVar("T")

_UNSAFE_ESCAPE: Final = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")


async def read_json(
    request: Request,
    *,
    max_bytes: int,
    then: Callable[[Any, bool], T] | None = None,
    before: Callable[[bytes], None] | None = None,
) -> Any:
    """The request's JSON body, checked (see the module docstring); with `then`, what `then`
    makes of it and of whether any of its strings may hold a NUL or a surrogate
    (`unsafe_escapes`), computed in the same place (a worker thread for a large body). `before`
    may refuse the raw bytes first, while that costs less than parsing them."""
    _check_content_type(request.headers.get("content-type"))
    raw = await read_bytes(request, max_bytes=max_bytes)
    if before is not None:
        before(raw)

    def parse() -> Any:
        unsafe = unsafe_escapes(raw)
        body = loads(raw, unsafe=unsafe)
        return then(body, unsafe) if then is not None else body

    if len(raw) > OFF_LOOP_BYTES:
        return await anyio.to_thread.run_sync(parse)
    return parse()


async def json_only(request: Request) -> None:
    """A dependency for routes whose body FastAPI reads: 415 for a body that is not JSON, the
    same answer `read_json` gives."""
    _check_content_type(request.headers.get("content-type"))


async def read_bytes(request: Request, *, max_bytes: int) -> bytes:
    """The raw body, refusing bodies over `max_bytes` before reading them whole."""
    declared = request.headers.get("content-length")
    # A length of a million digits is refused by its length, before `int` reads it.
    digits = declared is not None and declared.isascii() and declared.isdigit()
    if digits and declared is not None and (len(declared) > 18 or int(declared) > max_bytes):
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


def unsafe_escapes(raw: bytes) -> bool:
    """Whether JSON text `raw` escapes a NUL (`\\u0000`) or a surrogate (`\\ud800`-`\\udfff`):
    without one, none of its strings holds either. An escaped backslash before `u` counts too
    (a false alarm that only costs the full check)."""
    return _UNSAFE_ESCAPE.search(raw) is not None


def loads(raw: bytes, *, unsafe: bool = True) -> Any:
    """`raw` as JSON, refusing what cannot be forwarded as JSON (see the module docstring);
    its strings are read only if `unsafe` (`unsafe_escapes`)."""
    try:
        # Decoded here, strictly: given bytes, the parser also reads UTF-16 and UTF-32 (whose
        # escapes `unsafe_escapes` cannot see) and lets surrogates encoded as UTF-8 through.
        text = raw.decode("utf-8-sig")
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError as exc:
        raise _too_deep() from exc
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise GatewayError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    _check_tree(body, strings=unsafe)
    return body


def _check_content_type(value: str | None) -> None:
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media in ("", "application/json") or media.endswith("+json"):
        return
    raise GatewayError(
        415,
        f"the body must be JSON (Content-Type: application/json), not {media!r}",
        param="Content-Type",
        code="unsupported_media_type",
    )


def _check_tree(body: Any, *, strings: bool) -> None:
    """Depth and, with `strings`, encodable strings, walked without recursion."""
    pending: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while pending:
        value, path = pending.pop()
        if isinstance(value, str):
            _encodable(value, path)
        elif isinstance(value, dict | list):
            if len(path) >= MAX_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if strings and isinstance(key, str):
                    _encodable(key, path)
                if isinstance(item, dict | list) or (strings and isinstance(item, str)):
                    pending.append((item, (*path, key)))


def _encodable(text: str, path: tuple[str | int, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GatewayError(
            400,
            "the body holds an unpaired surrogate (such as \\ud800), which is not text",
            param=param_name(path),
            code="invalid_value",
        ) from exc


def _no_constant(name: str) -> Any:
    """NaN and ±Infinity are not JSON (RFC 8259); Python's parser would accept them."""
    raise ValueError(f"{name} is not a JSON value")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} is too large")
    return value


def _too_deep() -> GatewayError:
    return GatewayError(
        400, f"the body is nested deeper than {MAX_DEPTH} levels", code="invalid_value"
    )


def _too_large(max_bytes: int) -> GatewayError:
    return GatewayError(
        413,
        f"the body is larger than {max_bytes} bytes (MEMSTRATA_MAX_BODY_BYTES)",
        code="request_too_large",
    )
