"""Forwarding a chat completion upstream and relaying the answer to the client.

The upstream answer is relayed unchanged: an error keeps its status, body and `Retry-After`; a
stream is passed on event by event as it arrives (never half an event: a stream cut inside one
ends with a well-formed error event) while a `StreamedReply` rebuilds the message beside it.
The reply is recorded by the turn (`gateway.openai.turn`): a stream's when it ends, before the
client is sent `[DONE]`, marked incomplete if the stream was cut, even when the client has
gone. When the memory tools are offered (`gateway.openai.toolloop.offer`), the
request goes through the tool loop instead, with the same guarantees. The answer's `usage` is
kept on the turn; a stream's usage chunk, when the gateway asked for it and the client did not
(`Turn.hide_usage`), is kept from the client (the other chunks then carry `"usage": null`).
"""

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import httpx
from fastapi.responses import Response

from gateway.errors import GatewayError
from gateway.openai import toolloop
from gateway.openai.replies import StreamedReply, from_completion
from gateway.openai.streams import Event, EventReader, interrupted, parsed_json, usage_of
from gateway.openai.turn import REPLY_COMPLETE, Chunks, Turn
from gateway.state import State


async def forward(
    state: State,
    turn: Turn,
    *,
    client_headers: Mapping[str, str],
    query: str,
    body: dict[str, Any],
    stream: bool,
) -> Response:
    """Send `body` upstream (with the client's `query` string) and answer the client with what
    comes back."""
    offer = toolloop.offer(state.settings, turn, body)
    if offer is not None:
        loop = toolloop.ToolLoop(
            state, turn, client_headers=client_headers, query=query, body=body, offer=offer
        )
        return await (loop.stream() if stream else loop.complete())
    upstream = state.upstream
    try:
        response = await upstream.open(
            "POST",
            "/chat/completions",
            headers=upstream.headers_for(client_headers),
            json=body,
            query=query,
            stream=stream,
        )
        if stream and response.is_success:
            reply = StreamedReply()
            return turn.stream(state, response, _relay(response, reply, turn), reply)
        content = await upstream.read(response)
    except GatewayError as exc:
        exc.headers.update(turn.headers())
        raise
    completion = parsed_json(content)
    if isinstance(completion, dict) and isinstance(completion.get("usage"), dict):
        turn.usage = completion["usage"]
    return await turn.answer(state, content, response, from_completion(completion))


async def _relay(response: httpx.Response, reply: StreamedReply, turn: Turn) -> Chunks:
    """Pass the upstream stream on as it comes, event by event, feeding `reply`; the reply is
    complete just before the chunk that ends the stream. With `turn.hide_usage`, its usage
    chunk is held back."""
    complete = False
    # Whole events only: were a stream cut inside one, its first half would have been sent
    # already and the error event glued to it, a line no client can parse.
    events = EventReader()
    try:
        async for data in response.aiter_bytes():
            chunk = b"".join(_shown(events.feed(data), turn))
            reply.feed(chunk)
            if reply.done and not complete:
                complete = True
                turn.usage = turn.usage or reply.usage
                yield REPLY_COMPLETE
            if chunk:
                yield chunk
        if rest := b"".join(_shown(events.close(), turn)):
            reply.feed(rest)
            yield rest
    except httpx.HTTPError as exc:
        yield interrupted(type(exc).__name__, conversation=turn.external_id)
    finally:
        await response.aclose()


def _shown(events: Iterable[Event], turn: Turn) -> Iterator[bytes]:
    """The events' bytes, a usage-only chunk's kept on the turn instead with `hide_usage`."""
    for event in events:
        usage = usage_of(event) if turn.hide_usage else None
        if usage is None:
            yield event.raw
        else:
            turn.usage = usage
