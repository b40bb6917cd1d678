"""The fake upstream's ``POST /v1/responses`` (``devkit/upstream_server.py`` serves it unless
started with ``--no-responses``, when it answers 404 like any unknown path).

Default answer: one assistant message item whose text is ``"echo: " + <text of the last user message
of the input>`` (``input`` a string, or items: the last item of role ``user``), with ``id``
``resp_...``, ``object`` ``"response"``, ``status`` ``"completed"``, the request's ``model``,
``instructions``, ``tools`` and ``previous_response_id`` echoed, and ``usage`` (word counts;
``input_tokens_details.cached_tokens``: the tokens of the longest run of leading input items,
``instructions`` first, that an earlier prompt began with, byte for byte, as on
``/v1/chat/completions``). Scripted ``reply`` replaces the text; scripted ``tool_calls`` (only when
the request has ``tools``) become ``function_call`` items (after the message item when ``reply`` is
also scripted). With ``"stream": true``: ``text/event-stream`` of OpenAI's events, each with
``event:`` and its ``sequence_number``: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` … ``response.output_item.done`` (text: one
``response.output_text.delta`` per word; calls: ``response.function_call_arguments.delta``
fragments), then ``response.completed``; ``chunk_delay`` apart; ``cut_after`` closes the connection
after that many deltas. A ``previous_response_id`` is answered 404 ("Previous response … not
found"): this upstream continues nothing, so a gateway must send the history itself. A response made
without ``"store": false`` is kept, as OpenAI keeps it, for ``GET`` and ``DELETE
/v1/responses/{id}`` (an unknown id: 404). ``"background": true`` (not streamed) is answered
``queued`` with no output, the finished response kept for ``GET``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from devkit.upstream_script import Behaviour, content_text, error_body, split_words, word_count

Record = Callable[[Request, Callable[[Any], str]], Awaitable[tuple[Any, Behaviour]]]
Scripted = Callable[[Request, Behaviour], Response | None]
Headers = Callable[[Request, Behaviour], dict[str, str]]
Abort = Callable[[Request], Awaitable[None]]
Cached = Callable[[list[Any], list[int]], int]

_ARGUMENT_FRAGMENT_CHARS = 8


def last_user_input(body: Any) -> str:
    """Text of the last user message of a Responses request's ``input``."""
    if not isinstance(body, dict):
        return ""
    raw = body.get("input")
    if isinstance(raw, str):
        return raw
    for item in reversed(raw if isinstance(raw, list) else []):
        if isinstance(item, dict) and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, list):
                return content_text(
                    [{"text": p.get("text")} for p in content if isinstance(p, dict)]
                )
            return content_text(content)
    return ""


def responses_routes(
    *,
    record: Record,
    scripted_response: Scripted,
    headers_for: Headers,
    abort: Abort,
    chunk_delay: Callable[[], float],
    cached_tokens: Cached,
) -> list[Route]:
    """``POST /v1/responses`` and its kept responses' ``GET`` and ``DELETE``, built on the
    server's own helpers."""
    kept: dict[str, dict[str, Any]] = {}

    async def responses(request: Request) -> Response:
        body, behaviour = await record(request, last_user_input)
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        headers = headers_for(request, behaviour)
        stream = isinstance(body, dict) and bool(body.get("stream"))
        if "cut_after" in behaviour and not stream:
            await abort(request)
            return Response(status_code=500)
        problem = _problem(body)
        if problem is not None:
            status, message, param = problem
            return JSONResponse(
                error_body(message, status=status, param=param), status, headers=headers
            )
        assert isinstance(body, dict)
        response = _response(body, behaviour, cached_tokens)
        if body.get("store") is not False:
            kept[response["id"]] = response
        if body.get("background") is True and not stream:
            # Queued, as OpenAI answers it at once; kept finished, for polling.
            queued = {**response, "status": "queued", "output": [], "usage": None}
            return JSONResponse({**queued, "background": True}, headers=headers)
        if not stream:
            return JSONResponse(response, behaviour.get("status", 200), headers=headers)
        delay = float(behaviour.get("chunk_delay", chunk_delay()))
        events = _events(response, cut_after=behaviour.get("cut_after"), delay=delay)

        async def produce() -> AsyncIterator[bytes]:
            async for event in events:
                if event is None:
                    await abort(request)
                    return
                yield event

        return StreamingResponse(
            produce(),
            behaviour.get("status", 200),
            headers={"cache-control": "no-cache", **headers},
            media_type="text/event-stream",
        )

    async def one(request: Request) -> Response:
        _, behaviour = await record(request, lambda _body: "")
        if (scripted := scripted_response(request, behaviour)) is not None:
            return scripted
        response_id = request.path_params["response_id"]
        if response_id not in kept:
            message = f"Response with id '{response_id}' not found."
            return JSONResponse(error_body(message, status=404), 404)
        if request.method == "GET":
            return JSONResponse(kept[response_id])
        del kept[response_id]
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return [
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", one, methods=["GET", "DELETE"]),
    ]


def _problem(body: Any) -> tuple[int, str, str | None] | None:
    if not isinstance(body, dict):
        return 400, "We could not parse the JSON body of your request.", None
    if not isinstance(body.get("model"), str) or not body["model"]:
        return 400, "you must provide a model parameter", "model"
    if not isinstance(body.get("input"), str | list):
        return 400, "'input' must be a string or an array of items", "input"
    previous = body.get("previous_response_id")
    if previous is not None:
        return 404, f"Previous response with id '{previous}' not found.", "previous_response_id"
    return None


def _response(body: dict[str, Any], behaviour: Behaviour, cached_tokens: Cached) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    calls = behaviour.get("tool_calls") if body.get("tools") else None
    text = behaviour.get("reply", "echo: " + last_user_input(body))
    if not calls or "reply" in behaviour:
        output.append(
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    for call in calls or []:
        arguments = call.get("arguments", {})
        output.append(
            {
                "id": f"fc_{uuid.uuid4().hex}",
                "type": "function_call",
                "status": "completed",
                "call_id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                "name": call["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
            }
        )
    prompt = _prompt_items(body)
    counts = [word_count(_item_text(item)) + 3 for item in prompt]
    words = sum(counts)
    produced = sum(
        word_count(item["content"][0]["text"]) if item["type"] == "message" else 1
        for item in output
    )
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "model": body["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "store": body.get("store", True),
        "temperature": body.get("temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "top_p": body.get("top_p", 1.0),
        "usage": {
            "input_tokens": words,
            "input_tokens_details": {"cached_tokens": cached_tokens(prompt, counts)},
            "output_tokens": produced,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": words + produced,
        },
    }


def _prompt_items(body: dict[str, Any]) -> list[Any]:
    """What a provider's cache would see of a request: its instructions, then its input."""
    raw = body["input"]
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
    if body.get("instructions"):
        items.insert(0, {"role": "system", "content": body["instructions"]})
    return items


def _item_text(item: Any) -> str:
    if not isinstance(item, dict):
        return ""
    if "content" in item:
        return content_text(item["content"])
    value = item.get("output", item.get("arguments"))
    return value if isinstance(value, str) else ""


async def _events(
    response: dict[str, Any], *, cut_after: int | None, delay: float
) -> AsyncIterator[bytes | None]:
    """The stream of ``response``; None where the connection must be cut."""
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        payload = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    started = {**copy.deepcopy(response), "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    deltas = 0
    for index, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            empty = {**item, "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.output_item.added", output_index=index, item=empty)
            yield event("response.content_part.added", **where, content_index=0, part=part)
            pieces = split_words(text)
            kind, extra = "response.output_text.delta", {"content_index": 0}
        else:
            yield event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            arguments = item["arguments"]
            pieces = [
                arguments[start : start + _ARGUMENT_FRAGMENT_CHARS]
                for start in range(0, len(arguments), _ARGUMENT_FRAGMENT_CHARS)
            ]
            kind, extra = "response.function_call_arguments.delta", {}
        for piece in pieces:
            if cut_after is not None and deltas >= cut_after:
                yield None
                return
            if delay:
                await asyncio.sleep(delay)
            deltas += 1
            yield event(kind, **where, **extra, delta=piece)
        if item["type"] == "message":
            yield event("response.output_text.done", **where, content_index=0, text=text)
            yield event(
                "response.content_part.done", **where, content_index=0, part=item["content"][0]
            )
        else:
            yield event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            )
        yield event("response.output_item.done", output_index=index, item=item)
    if cut_after is not None:
        yield None
        return
    yield event("response.completed", response=response)
