"""A real, scriptable OpenAI-compatible upstream server for end-to-end tests and benchmarks.

Run it with ``python -m devkit.upstream_server --host 127.0.0.1 --port P
[--chunk-delay S] [--latency S] [--max-recorded N] [--no-responses]`` (uvicorn, log level
warning, no access log), or build the ASGI app with :func:`create_upstream_app`.
``devkit/upstream.py`` runs it as a subprocess for the tests and the benchmarks.

OpenAI surface (every request under ``/v1`` is recorded and consumes one scripted behaviour):

* ``POST /v1/chat/completions`` -- default answer: assistant content ``"echo: " + <text of
  the last user message>`` (``""`` when there is none), ``model`` echoed, ``id`` ``chatcmpl-...``,
  ``object``, ``created``, ``choices[0].finish_reason`` (``"stop"``) and ``usage`` (word counts;
  ``prompt_tokens_details.cached_tokens``: the tokens of the longest run of leading messages an
  earlier prompt began with, byte for byte, as a provider's prompt cache would bill them).
  With ``"stream": true``: ``text/event-stream``, one ``chat.completion.chunk`` per word (the
  first one carries ``delta.role``), then a chunk with an empty delta and the finish_reason,
  then, if ``stream_options.include_usage``, a chunk with ``choices: []`` and ``usage`` (all
  earlier chunks then carry ``"usage": null``), then ``data: [DONE]``. Chunks are written as
  produced, ``chunk_delay`` seconds apart. Tool calls (only when the request has non-empty
  ``tools`` and the behaviour has ``tool_calls``): non-stream ``message.tool_calls`` with
  ``content: null`` and finish_reason ``"tool_calls"``; stream: per call, a first delta with
  ``index``, ``id``, ``type`` and ``function.name`` + ``arguments: ""``, then deltas carrying
  argument fragments.
* ``POST /v1/responses`` -- the Responses API (``devkit/upstream_responses.py``), and ``GET``
  / ``DELETE /v1/responses/{id}`` of the responses it keeps, unless ``--no-responses``: then
  each answers 404 as an unknown path does (an upstream without it).
* ``GET /v1/models`` -- a list of a few models; ``GET /v1/models/{id}`` -- one of them (404
  for another id).
* ``POST /v1/audio/speech`` -- ``audio/mpeg`` bytes (``input`` encoded, in 8 pieces,
  ``chunk_delay`` apart): a stream that is not server-sent events.
* ``POST /v1/embeddings`` -- deterministic unit vectors seeded by the SHA-256 of each input,
  dimension ``dimensions`` or 384, ``encoding_format`` ``float`` or ``base64`` (float32
  little-endian, which the official SDK requests by default), with ``index`` and ``usage``.
* ``/v1/files`` and ``/v1/batches`` -- one account's files and batches
  (``devkit/upstream_files.py``).
* Any other ``/v1`` path answers 404 in OpenAI's error shape. Errors are always
  ``{"error": {"message", "type", "param", "code"}}``.

Control plane (never recorded, never consumes behaviours):

* ``POST /_control/script`` -- body: a JSON list of behaviours (or one behaviour object),
  appended to a FIFO queue. Answers ``{"queued": <queue length>}``.
* ``GET /_control/script`` -- ``{"queue": [...], "default": {...}}``.
* ``POST /_control/default`` -- body: one behaviour object, the persistent default; ``{}``
  resets it.
* ``GET /_control/requests[?path=/v1/...]`` -- the recorded requests, oldest first.
* ``DELETE /_control/requests`` -- clears the recorded requests, the queue and the default.

Behaviours (what a scripted answer can be, and how the queue is consumed) are described in
``devkit/upstream_script.py``.

Each recorded request is ``{"method", "path", "query", "headers" (lowercased names),
"body" (parsed JSON or null), "raw_body" (only when the body is not JSON), "received_at"
(``time.time()``), "peer" (the client's ``host:port``: requests over one connection share it),
"behaviour" (the behaviour applied), "request_id" (the ``x-request-id`` answered)}``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from devkit.upstream_files import files_routes
from devkit.upstream_responses import responses_routes
from devkit.upstream_script import (
    DEFAULT_EMBEDDING_DIMENSIONS,
    Behaviour,
    BehaviourError,
    UpstreamState,
    content_text,
    embedding_vector,
    error_body,
    last_user_text,
    split_words,
    validate_behaviour,
    word_count,
)

JSON = Any

SYSTEM_FINGERPRINT: Final = "fp_memstrata_upstream"
MODELS: Final = ("gpt-4o-mini", "gpt-4o", "text-embedding-3-small")
_ABORT_SCOPE_KEY: Final = "memstrata.abort_connection"
_ARGUMENT_FRAGMENT_CHARS: Final = 8

AbortConnection = Callable[[], Awaitable[None]]


class ConnectionCutError(Exception):
    """Raised inside the app to cut the connection when the transport is not reachable."""


def _error_response(
    message: str,
    *,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(message, status=status, param=param, code=code), status, headers=headers
    )


class _UpstreamApp(Starlette):
    """Starlette app that exposes a way to cut the TCP connection to its handlers.

    The server (uvicorn) passes its per-request cycle's bound ``send``; its ``transport`` is
    what lets a handler close the socket with no (or an incomplete) response.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if transport is not None:

                async def abort() -> None:
                    transport.close()
                    # Wait for the server to notice, so it neither logs an error nor
                    # writes a 500 after the handler returns.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(2.0):
                            while (await receive())["type"] != "http.disconnect":
                                pass

                scope[_ABORT_SCOPE_KEY] = abort
        await super().__call__(scope, receive, send)


async def _abort_connection(request: Request) -> None:
    abort: AbortConnection | None = request.scope.get(_ABORT_SCOPE_KEY)
    if abort is None:
        raise ConnectionCutError("scripted connection cut")
    await abort()


def create_upstream_app(
    *,
    chunk_delay: float = 0.0,
    latency: float = 0.0,
    max_recorded: int = 100_000,
    responses: bool = True,
) -> Starlette:
    """Build the fake upstream ASGI app.

    ``chunk_delay``: seconds between stream chunks; ``latency``: seconds slept before every
    ``/v1`` answer; ``max_recorded``: how many requests are kept (oldest dropped first);
    ``responses``: whether ``POST /v1/responses`` is served.
    """
    state = UpstreamState(chunk_delay=chunk_delay, latency=latency, max_recorded=max_recorded)

    async def record(request: Request, match_text: Callable[[JSON], str]) -> tuple[JSON, Behaviour]:
        raw = await request.body()
        entry: dict[str, Any] = {
            "method": request.method,
            "path": request.url.path,
            "query": request.url.query,
            "headers": {},
            "body": None,
            "received_at": time.time(),
            "peer": f"{request.client.host}:{request.client.port}" if request.client else None,
        }
        for name, value in request.headers.items():
            key = name.lower()
            entry["headers"][key] = (
                f"{entry['headers'][key]}, {value}" if key in entry["headers"] else value
            )
        body: JSON = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                entry["raw_body"] = raw.decode("utf-8", "replace")
        entry["body"] = body
        behaviour = state.next_behaviour(request.url.path, match_text(body))
        entry["behaviour"] = behaviour
        entry["request_id"] = f"req_{uuid.uuid4().hex}"
        state.requests.append(entry)
        request.state.request_id = entry["request_id"]
        wait = state.latency + float(behaviour.get("delay", 0.0))
        if wait > 0:
            await asyncio.sleep(wait)
        return body, behaviour

    def headers_for(request: Request, behaviour: Behaviour) -> dict[str, str]:
        return {"x-request-id": request.state.request_id, **behaviour.get("headers", {})}

    def scripted_response(request: Request, behaviour: Behaviour) -> Response | None:
        """The scripted error/raw answer, or ``None`` to go on with the normal answer."""
        headers = headers_for(request, behaviour)
        status = behaviour.get("status")
        if "sse" in behaviour:
            events = "".join(f"data: {item}\n\n" for item in behaviour["sse"])
            return Response(events, 200, headers=headers, media_type="text/event-stream")
        if "body" in behaviour or (status is not None and status >= 400):
            status = status if status is not None else 200
            body = behaviour.get("body", error_body(f"Scripted error {status}", status=status))
            if isinstance(body, str):
                return PlainTextResponse(body, status, headers=headers)
            return JSONResponse(body, status, headers=headers)
        return None

    def json_response(request: Request, behaviour: Behaviour, payload: JSON) -> JSONResponse:
        return JSONResponse(
            payload, behaviour.get("status", 200), headers=headers_for(request, behaviour)
        )

    async def chat_completions(request: Request) -> Response:
        body, behaviour = await record(
            request, lambda b: last_user_text(b) if isinstance(b, dict) else ""
        )
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        stream = isinstance(body, dict) and bool(body.get("stream"))
        if "cut_after" in behaviour and not stream:
            await _abort_connection(request)
            return Response(status_code=500)  # never reaches the client
        headers = headers_for(request, behaviour)
        if not isinstance(body, dict):
            return _error_response(
                "We could not parse the JSON body of your request.", headers=headers
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return _error_response(
                "you must provide a model parameter", param="model", headers=headers
            )
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error_response(
                "'messages' must be a non-empty array",
                param="messages",
                code="invalid_type",
                headers=headers,
            )

        reply: str = behaviour.get("reply", "echo: " + last_user_text(body))
        tool_calls: list[dict[str, str]] = []
        if behaviour.get("tool_calls") and body.get("tools"):
            for call in behaviour["tool_calls"]:
                arguments = call.get("arguments", {})
                tool_calls.append(
                    {
                        "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                        "name": call["name"],
                        "arguments": arguments
                        if isinstance(arguments, str)
                        else json.dumps(arguments),
                    }
                )
        content: str | None = behaviour.get("reply") if tool_calls else reply
        finish_reason: str = behaviour.get("finish_reason", "tool_calls" if tool_calls else "stop")
        counted = [m for m in messages if isinstance(m, dict)]
        counts = [word_count(content_text(m.get("content"))) + 3 for m in counted]
        prompt_tokens = sum(counts)
        cached_tokens = state.cached_tokens(counted, counts)
        completion_tokens = word_count(content or "") + sum(
            word_count(c["arguments"]) + 1 for c in tool_calls
        )
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:29]}"
        created = int(time.time())

        if not stream:
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": c["arguments"]},
                    }
                    for c in tool_calls
                ]
            return json_response(
                request,
                behaviour,
                {
                    "id": completion_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                    "choices": [
                        {
                            "index": 0,
                            "message": message,
                            "logprobs": None,
                            "finish_reason": finish_reason,
                        }
                    ],
                    "usage": usage,
                },
            )

        stream_options = body.get("stream_options")
        include_usage = isinstance(stream_options, dict) and bool(
            stream_options.get("include_usage")
        )

        def chunk(
            delta: dict[str, Any], finish: str | None = None, *, choices: bool = True
        ) -> bytes:
            payload: dict[str, Any] = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
                if choices
                else [],
            }
            if include_usage:
                payload["usage"] = None if choices else usage
            return f"data: {json.dumps(payload)}\n\n".encode()

        deltas: list[dict[str, Any]] = []
        if content is not None:
            deltas.extend({"content": piece} for piece in split_words(content))
        for index, call in enumerate(tool_calls):
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["name"], "arguments": ""},
                        }
                    ]
                }
            )
            args = call["arguments"]
            for start in range(0, len(args), _ARGUMENT_FRAGMENT_CHARS):
                fragment = args[start : start + _ARGUMENT_FRAGMENT_CHARS]
                deltas.append(
                    {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
                )
        # ``deltas`` is never empty: there is content (maybe "") or at least one tool call.
        deltas[0] = {"role": "assistant", "content": None, **deltas[0], "refusal": None}

        delay = float(behaviour.get("chunk_delay", state.chunk_delay))
        cut_after: int | None = behaviour.get("cut_after")

        async def events() -> AsyncIterator[bytes]:
            for number, delta in enumerate(deltas):
                if cut_after is not None and number >= cut_after:
                    break
                if number and delay:
                    await asyncio.sleep(delay)
                yield chunk(delta)
            if cut_after is not None:
                await _abort_connection(request)
                return
            if delay:
                await asyncio.sleep(delay)
            yield chunk({}, finish_reason)
            if include_usage:
                yield chunk({}, choices=False)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(
            events(),
            behaviour.get("status", 200),
            headers={"cache-control": "no-cache", **headers_for(request, behaviour)},
            media_type="text/event-stream",
        )

    def embedding_inputs(body: JSON) -> list[str] | None:
        if not isinstance(body, dict):
            return None
        raw = body.get("input")
        if isinstance(raw, str):
            return [raw]
        if isinstance(raw, list) and raw:
            if all(isinstance(item, int) for item in raw):
                return [json.dumps(raw)]
            if all(isinstance(item, str | list) for item in raw):
                return [item if isinstance(item, str) else json.dumps(item) for item in raw]
        return None

    async def embeddings(request: Request) -> Response:
        body, behaviour = await record(request, lambda b: "\n".join(embedding_inputs(b) or []))
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        if "cut_after" in behaviour:
            await _abort_connection(request)
            return Response(status_code=500)
        headers = headers_for(request, behaviour)
        inputs = embedding_inputs(body)
        if inputs is None or not isinstance(body, dict):
            return _error_response(
                "'input' must be a non-empty string or array",
                param="input",
                code="invalid_type",
                headers=headers,
            )
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return _error_response(
                "you must provide a model parameter", param="model", headers=headers
            )
        dimensions = body.get("dimensions", DEFAULT_EMBEDDING_DIMENSIONS)
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
            return _error_response(
                "'dimensions' must be a positive integer", param="dimensions", headers=headers
            )
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            return _error_response(
                "'encoding_format' must be 'float' or 'base64'",
                param="encoding_format",
                headers=headers,
            )
        data: list[dict[str, Any]] = []
        for index, text in enumerate(inputs):
            vector = embedding_vector(text, dimensions)
            encoded: list[float] | str = (
                vector
                if encoding == "float"
                else base64.b64encode(struct.pack(f"<{dimensions}f", *vector)).decode()
            )
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        tokens = sum(max(1, word_count(text)) for text in inputs)
        return json_response(
            request,
            behaviour,
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    async def models(request: Request) -> Response:
        _, behaviour = await record(request, lambda _b: "")
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        if "cut_after" in behaviour:
            await _abort_connection(request)
            return Response(status_code=500)
        return json_response(
            request,
            behaviour,
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 1_700_000_000, "owned_by": "system"}
                    for name in MODELS
                ],
            },
        )

    async def model(request: Request) -> Response:
        _, behaviour = await record(request, lambda _b: "")
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        name = request.path_params["model"]
        if name not in MODELS:
            return _error_response(
                f"The model '{name}' does not exist",
                status=404,
                code="model_not_found",
                headers=headers_for(request, behaviour),
            )
        listed = {"id": name, "object": "model", "created": 1_700_000_000, "owned_by": "system"}
        return json_response(request, behaviour, listed)

    async def speech(request: Request) -> Response:
        body, behaviour = await record(
            request, lambda b: str(b.get("input", "")) if isinstance(b, dict) else ""
        )
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        audio = str(body.get("input", "") if isinstance(body, dict) else "").encode()
        delay = float(behaviour.get("chunk_delay", state.chunk_delay))

        async def pieces() -> AsyncIterator[bytes]:
            step = max(1, -(-len(audio) // 8))
            for start in range(0, len(audio), step):
                if start and delay:
                    await asyncio.sleep(delay)
                yield audio[start : start + step]

        return StreamingResponse(
            pieces(), headers=headers_for(request, behaviour), media_type="audio/mpeg"
        )

    async def unknown_v1(request: Request) -> Response:
        _, behaviour = await record(request, lambda _b: "")
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        return _error_response(
            f"Invalid URL ({request.method} {request.url.path})",
            status=404,
            headers=headers_for(request, behaviour),
        )

    async def control_script(request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse({"queue": list(state.queue), "default": state.default})
        try:
            raw = await request.json()
            items = raw if isinstance(raw, list) else [raw]
            behaviours = [validate_behaviour(item) for item in items]
        except (ValueError, BehaviourError) as exc:
            return _error_response(str(exc))
        state.queue.extend(behaviours)
        return JSONResponse({"queued": len(state.queue)})

    async def control_default(request: Request) -> Response:
        try:
            state.default = validate_behaviour(await request.json())
        except (ValueError, BehaviourError) as exc:
            return _error_response(str(exc))
        return JSONResponse({"default": state.default})

    async def control_requests(request: Request) -> Response:
        if request.method == "DELETE":
            state.reset()
            return JSONResponse({"cleared": True})
        path = request.query_params.get("path")
        return JSONResponse([r for r in state.requests if path is None or r["path"] == path])

    app = _UpstreamApp(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            *(
                responses_routes(
                    record=record,
                    scripted_response=scripted_response,
                    headers_for=headers_for,
                    abort=_abort_connection,
                    chunk_delay=lambda: state.chunk_delay,
                    cached_tokens=state.cached_tokens,
                )
                if responses
                else []
            ),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model}", model, methods=["GET"]),
            Route("/v1/audio/speech", speech, methods=["POST"]),
            *files_routes(lambda request: record(request, lambda _b: "")),
            Route(
                "/v1/{rest:path}",
                unknown_v1,
                methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
            ),
            Route("/_control/script", control_script, methods=["GET", "POST"]),
            Route("/_control/default", control_default, methods=["POST"]),
            Route("/_control/requests", control_requests, methods=["GET", "DELETE"]),
        ]
    )
    app.state.upstream = state
    return app


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point: serve the fake upstream with uvicorn."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--chunk-delay", type=float, default=0.0)
    parser.add_argument("--latency", type=float, default=0.0)
    parser.add_argument("--max-recorded", type=int, default=100_000)
    parser.add_argument("--no-responses", action="store_true", help="no /v1/responses")
    args = parser.parse_args(argv)
    app = create_upstream_app(
        chunk_delay=args.chunk_delay,
        latency=args.latency,
        max_recorded=args.max_recorded,
        responses=not args.no_responses,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )


if __name__ == "__main__":
    main()
