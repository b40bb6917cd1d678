"""A response request's way upstream and back (`gateway.openai.responses` takes it there).

The request goes as a Responses request when the upstream serves the API: the client's own body
when the prompt is its input unchanged, else with the assembled prompt as `input` (and no
`previous_response_id`: the upstream gets the history itself). Otherwise it is translated to a
chat completion and the answer back to a response object or Responses events. Whether the
upstream serves it is `MEMSTRATA_UPSTREAM_RESPONSES`: `on`, `off`, or `auto`: on for OpenAI's own
API, else learnt from the first request: an answer of 404, 405 or 501 (other than an unknown
model's) means it does not, remembered by the process. A first request that could not be
translated (built-in tools) learns it before anything is stored (`probe`), from a request the
upstream must refuse (`{}`: 400 if it serves the API), so that it is refused unstored. Upstream
error answers are relayed with their status and body, as on the chat path.

When the memory tools are offered (`gateway.openai.toolloop.offer`, as on the chat path), the
model may read memory before it answers, either way upstream: forwarded, in rounds of Responses
requests (`gateway.openai.response_tools`); translated, in the chat path's rounds
(`gateway.openai.toolloop`), whose answer is translated as any other.
"""

import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import Request
from fastapi.responses import Response

from gateway.errors import GatewayError
from gateway.openai import toolloop, translate
from gateway.openai.response_events import ChatEvents, ResponseReply
from gateway.openai.response_tools import ResponseToolLoop
from gateway.openai.response_turn import ResponseTurn
from gateway.openai.streams import EventReader, interrupted, parsed_json
from gateway.openai.turn import REPLY_COMPLETE, Chunks, Mark
from gateway.settings import Settings
from gateway.state import State
from gateway.upstream import Upstream

log = logging.getLogger(__name__)

# What an upstream answers for a path it does not serve (the Responses API, or one response).
NOT_SERVED = (404, 405, 501)
_OPENAI_HOST = "api.openai.com"


def serves_responses(settings: Settings) -> bool | None:
    """What is known, at start, of whether the upstream serves the Responses API."""
    if settings.upstream_responses != "auto":
        return settings.upstream_responses == "on"
    return True if urlsplit(settings.upstream_url).hostname == _OPENAI_HOST else None


async def probe(state: State, client_headers: Mapping[str, str]) -> None:
    """Learn whether the upstream serves the Responses API from a request it must refuse
    (no model, no input): it answers 400 if it serves it, else 404, 405 or 501. A failure to
    reach it teaches nothing (the request then learns as any other)."""
    upstream = state.upstream
    try:
        response = await upstream.open(
            "POST", "/responses", headers=upstream.headers_for(client_headers), json={}
        )
        status = response.status_code
        await upstream.read(response)
    except GatewayError:
        return
    _learnt(upstream, served=status not in NOT_SERVED)


def _learnt(upstream: Upstream, *, served: bool) -> None:
    if not served:
        log.info("the upstream does not serve the Responses API: translating to chat completions")
    upstream.serves_responses = served


class Forward:
    """One response request's way upstream, and its answer's way back."""

    def __init__(
        self,
        state: State,
        turn: ResponseTurn,
        *,
        request: Request,
        body: dict[str, Any],
        stream: bool,
    ) -> None:
        self._state = state
        self._turn = turn
        self._upstream = state.upstream
        self._client_headers = request.headers
        self._headers = state.upstream.headers_for(request.headers)
        self._query = request.url.query
        self._body = body
        self._stream = stream

    async def send(self, prompt: list[dict[str, Any]], *, as_sent: bool) -> Response:
        """Send `prompt` (`as_sent`: the client's own input, unchanged) upstream."""
        if self._upstream.serves_responses is not False:
            body = self._body if as_sent else self._responses_body(prompt)
            loop = self._loop(body, prompt)
            response = await self._open("/responses", body if loop is None else loop.request())
            if self._upstream.serves_responses is None:
                answer = await self._learn(response)
                if answer is not None:
                    return answer
            if self._upstream.serves_responses:
                return await self._relay(response, loop)
        return await self._translated(prompt)

    def _loop(self, body: dict[str, Any], prompt: list[dict[str, Any]]) -> ResponseToolLoop | None:
        """The memory-tool rounds of a request forwarded as Responses, if the tools are
        offered."""
        offer = toolloop.offer(self._state.settings, self._turn, body)
        if offer is None:
            return None
        return ResponseToolLoop(
            self._state,
            self._turn,
            body=body,
            prompt=prompt,
            offer=offer,
            open=functools.partial(self._open, "/responses"),
            read=self._read,
        )

    async def _learn(self, response: httpx.Response) -> Response | None:
        """Learn whether the upstream serves the Responses API from its first answer; the
        answer to relay when it had to be read to tell (an unknown model's 404), else None."""
        if response.status_code not in NOT_SERVED:
            _learnt(self._upstream, served=True)
            return None
        content = await self._read(response)
        error = parsed_json(content)
        code = error.get("error", {}).get("code") if isinstance(error, dict) else None
        if isinstance(code, str) and code == "model_not_found":
            _learnt(self._upstream, served=True)
            return await self._turn.answer(self._state, content, response)
        _learnt(self._upstream, served=False)
        return None

    def _responses_body(self, prompt: list[dict[str, Any]]) -> dict[str, Any]:
        instructions = self._body.get("instructions")
        if instructions and prompt and prompt[0] == translate.instructions_message(instructions):
            prompt = prompt[1:]
        body = {**self._body, "input": translate.input_items(prompt)}
        body.pop("previous_response_id", None)
        return body

    async def _open(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return await self._upstream.open(
                "POST",
                path,
                headers=self._headers,
                json=body,
                query=self._query,
                stream=self._stream,
            )
        except GatewayError as exc:
            exc.headers.update(self._turn.headers())
            raise

    async def _read(self, response: httpx.Response) -> bytes:
        try:
            return await self._upstream.read(response)
        except GatewayError as exc:
            exc.headers.update(self._turn.headers())
            raise

    async def _relay(self, response: httpx.Response, loop: ResponseToolLoop | None) -> Response:
        """The upstream's Responses answer, relayed as it is (after the memory-tool rounds)."""
        if self._stream and response.is_success:
            streamed = self._turn.streamed = ResponseReply()
            if loop is None:
                chunks = self._passed(response, streamed)
            else:
                chunks = loop.rounds(response, streamed)
            return self._turn.stream(self._state, response, chunks, streamed)
        if loop is not None and response.is_success:
            content, response, answer = await loop.whole(response)
        else:
            content = await self._read(response)
            answer = parsed_json(content)
        reply = None
        if response.is_success and isinstance(answer, dict):
            self._turn.response = answer
            reply = translate.reply_message(answer.get("output"))
        return await self._turn.answer(self._state, content, response, reply)

    async def _passed(self, response: httpx.Response, reply: ResponseReply) -> Chunks:
        reader = EventReader()
        try:
            async for data in response.aiter_bytes():
                for event in reader.feed(data):
                    final = reply.ends(event)
                    reply.feed(event.raw)
                    if final:
                        yield REPLY_COMPLETE
                    yield event.raw
            for event in reader.close():
                reply.feed(event.raw)
                yield event.raw
        except httpx.HTTPError as exc:
            yield self._interrupted(type(exc).__name__)
        finally:
            await response.aclose()

    async def _translated(self, prompt: list[dict[str, Any]]) -> Response:
        """The request as a chat completion (with the chat path's memory-tool rounds, when the
        tools are offered); its answer as a response."""
        body = translate.chat_request(self._body, prompt)
        offer = toolloop.offer(self._state.settings, self._turn, body)
        loop = None
        if offer is not None:
            loop = toolloop.ToolLoop(
                self._state,
                self._turn,
                client_headers=self._client_headers,
                query=self._query,
                body=body,
                offer=offer,
            )
        response_id = translate.new_id("resp")
        if self._stream:
            if loop is None:
                response = await self._open("/chat/completions", body)
                source: AsyncIterator[bytes | Mark] = response.aiter_bytes()
            else:
                opened = await loop.open_stream()
                if isinstance(opened, Response):  # the first round failed: relayed
                    return opened
                response, source, _ = opened
            if response.is_success:
                streamed = self._turn.streamed = ResponseReply()
                skeleton = translate.response_skeleton(
                    self._body, response_id=response_id, model=str(self._body.get("model"))
                )
                chunks = self._converted(response, source, ChatEvents(skeleton), streamed)
                return self._turn.stream(self._state, response, chunks, streamed)
            content = await self._read(response)
        elif loop is None:
            response = await self._open("/chat/completions", body)
            content = await self._read(response)
        else:
            content, response, _ = await loop.whole()
        converted = translate.response_object(
            parsed_json(content), self._body, response_id=response_id
        )
        if not response.is_success or converted is None:
            return await self._turn.answer(self._state, content, response)
        self._turn.response = converted
        reply = translate.reply_message(converted["output"])
        return await self._turn.answer(self._state, translate.dumps(converted), response, reply)

    async def _converted(
        self,
        response: httpx.Response,
        source: AsyncIterator[bytes | Mark],
        events: ChatEvents,
        reply: ResponseReply,
    ) -> Chunks:
        """The chat stream `source` (of `response`, or of the memory-tool rounds that began
        with it) as Responses events."""

        def sent(data: bytes) -> bytes:
            reply.feed(data)
            return data

        reader = EventReader()
        try:
            yield sent(events.start())
            async for data in source:
                if not isinstance(data, bytes):  # the rounds' own mark: this one's comes later
                    continue
                for event in reader.feed(data):
                    if out := events.event(event):
                        yield sent(out)
            for event in reader.close():
                if out := events.event(event):
                    yield sent(out)
            if events.failed:
                # Not a completed response: no final event, and the reply is recorded (by the
                # turn, as the stream ends) as incomplete.
                return
            if not events.finished:  # cut short, though without a transport error
                yield sent(self._interrupted("the stream ended early"))
                return
            final = events.finish()
            reply.feed(final)
            yield REPLY_COMPLETE
            yield final
        except httpx.HTTPError as exc:
            yield sent(self._interrupted(type(exc).__name__))
        finally:
            if isinstance(source, AsyncGenerator):
                await source.aclose()
            await response.aclose()

    def _interrupted(self, cause: str) -> bytes:
        return interrupted(cause, conversation=self._turn.external_id)
