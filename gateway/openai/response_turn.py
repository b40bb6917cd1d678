"""The turn of a response request: what it records (`memory.write.responses`) beside the
reply, the response object as the client saw it and the request's input items, and the
upstream's usage read from that response (`usage`, counted as a chat completion's is).

A request that named its `conversation` (which is not sent upstream) is shown it on every
response object it gets, as OpenAI shows it, `"conversation": {"id": ...}`: the whole answer,
each stream event carrying the response, and the response as stored, which is read back.
"""

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx
from fastapi.responses import StreamingResponse
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.openai import translate
from gateway.openai.degraded import DEGRADED_HEADER
from gateway.openai.response_events import ResponseReply, payload_of, typed_event
from gateway.openai.streams import EventReader, parsed_json
from gateway.openai.turn import CONVERSATION_HEADER, Chunks, Reply, Turn
from gateway.state import State
from memory.write import responses as stored_responses

log = logging.getLogger(__name__)


# What an upstream answers for a path it does not serve (the Responses API, or one response).
@dataclass
class ResponseTurn(Turn):
    """A turn whose answer is a response: kept with its input items when it is recorded."""

    records_without_reply: ClassVar[bool] = True
    store: bool = True
    input_items: list[dict[str, Any]] = field(default_factory=list)
    response: dict[str, Any] | None = None
    streamed: ResponseReply | None = None
    degraded: bool = False
    """Forwarded without memory, the database being down (fail-open)."""
    background: bool = False
    """Asked for with `background: true` (and run in the foreground): the stored response
    says so, which is what lets a client cancel it."""
    conversation: str | None = None
    """The conversation the request's `conversation` field named (see the module docstring)."""

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        if not self.external_id:
            del headers[CONVERSATION_HEADER]
        if self.degraded:
            headers[DEGRADED_HEADER] = "1"
        return headers

    def answered(self) -> dict[str, Any] | None:
        """The response object the client was given, as far as it came."""
        body = self.streamed.response() if self.streamed is not None else self.response
        return self._with_conversation(body) if body is not None else None

    def _with_conversation(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.conversation is None:
            return response
        return {**response, "conversation": {"id": self.conversation}}

    def shown(self, content: bytes) -> bytes:
        if self.conversation is None:
            return content
        body = parsed_json(content)
        if not isinstance(body, dict) or body.get("object") != "response":
            return content
        return translate.dumps(self._with_conversation(body))

    def stream(
        self, state: State, response: httpx.Response, chunks: Chunks, reply: Reply
    ) -> StreamingResponse:
        if self.conversation is not None:
            chunks = self._shown_events(chunks)
        return super().stream(state, response, chunks, reply)

    async def _shown_events(self, chunks: Chunks) -> Chunks:
        reader = EventReader()
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if not isinstance(chunk, bytes):
                    yield chunk
                    continue
                shown = b""
                for event in reader.feed(chunk):
                    payload = payload_of(event)
                    if payload is not None and isinstance(payload.get("response"), dict):
                        payload["response"] = self._with_conversation(payload["response"])
                        shown += typed_event(payload)
                    else:
                        shown += event.raw
                if shown:
                    yield shown
        for event in reader.close():
            yield event.raw

    async def record(
        self, state: State, reply: Mapping[str, Any] | None, *, complete: bool
    ) -> None:
        if not self.store:
            return
        body = self.answered()
        if self.usage is None and body is not None:
            self.usage = translate.chat_usage(body.get("usage"))
        await super().record(state, reply, complete=complete)

    async def recorded(self, conn: AsyncConnection) -> None:
        body = self.answered()
        if body is None or not isinstance(body.get("id"), str):
            return
        if self.background:
            body = {**body, "background": True}
        await stored_responses.save(
            conn,
            tenant_id=self.tenant_id,
            conversation_id=self.conversation_id,
            response_id=body["id"],
            body=body,
            input_items=self.input_items,
        )
