"""One request's turn: what the gateway established about it, and the one place its reply is
recorded.

A `Turn` is made once the client's messages are stored; `sent` takes the figures of the prompt
the read path assembled, and the forwarding path sets the upstream's `usage` (summed over hidden
tool rounds) once it has it. The answer reaches the client through the turn: `answer` for a whole
(non-stream) answer, `stream` for a stream, whose producer yields `REPLY_COMPLETE` once the reply
is whole. Either way the reply is recorded exactly once (`record`: stored after the
conversation, with its build queued by the write path, and the request's tokens counted, with
what the upstream reported and how much of the prompt repeated the previous one's prefix): a
stream's reply before the client is sent its last bytes (a client that sends its next turn as
soon as it has the answer must find the reply stored), or, if the stream is cut or the client
leaves, with what arrived, marked incomplete. Every response of the turn carries `headers()`.
"""

import contextlib
import enum
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from gateway.metrics import Metrics
from gateway.openai.replies import StreamedReply
from gateway.state import State
from gateway.upstream import relayed_headers
from memory.db import transaction
from memory.errors import MemstrataError
from memory.recall.assemble import Assembled
from memory.write import store

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "X-Memstrata-Conversation"


class Mark(enum.Enum):
    """What a stream's producer yields besides bytes."""

    REPLY_COMPLETE = "reply complete"
    """The reply is whole: record it before anything after this is sent."""


REPLY_COMPLETE = Mark.REPLY_COMPLETE

Chunks = AsyncGenerator[bytes | Mark, None]


@dataclass
class Turn:
    """What one request has established before going upstream."""

    tenant_id: int
    conversation_id: int
    external_id: str
    model: str
    started: float = field(default_factory=time.perf_counter)
    # Seconds spent in the gateway itself (not waiting for the upstream).
    overhead: float = 0.0
    # Tokens of the prompt sent upstream, and of the whole history it stands for.
    context_tokens: int | None = None
    full_tokens: int | None = None
    # True when the prompt was rebuilt from memory rather than forwarded as the client sent it.
    rebuilt: bool = False
    # The prompt's tokens that repeat the previous prompt's prefix, and its fingerprint.
    reused: int = 0
    fingerprint: list[Any] | None = None
    # Whether the prompt came from the conversation's working context.
    from_context: bool = False
    # The upstream's `usage` for the request (summed over hidden tool rounds), and whether the
    # gateway asked a stream for it on its own (the client is then not shown it).
    usage: dict[str, Any] | None = None
    hide_usage: bool = False

    def sent(self, assembled: Assembled, metrics: Metrics | None = None) -> None:
        """Take the figures of the prompt about to go upstream; the gateway's own time ends."""
        self.context_tokens = assembled.tokens
        self.full_tokens = assembled.full_tokens
        self.rebuilt = assembled.rebuilt
        self.reused = assembled.reused
        self.fingerprint = assembled.fingerprint
        self.from_context = assembled.context_version is not None
        if assembled.compacted and metrics is not None:
            metrics.compactions.inc()
        self.overhead = time.perf_counter() - self.started

    def headers(self) -> dict[str, str]:
        headers = {
            CONVERSATION_HEADER: self.external_id,
            "X-Memstrata-Overhead-Ms": f"{self.overhead * 1000:.2f}",
        }
        if self.context_tokens is not None:
            headers["X-Memstrata-Context-Tokens"] = str(self.context_tokens)
        if self.full_tokens is not None:
            headers["X-Memstrata-Full-Tokens"] = str(self.full_tokens)
        return headers

    async def answer(
        self,
        state: State,
        content: bytes,
        response: httpx.Response,
        reply: Mapping[str, Any] | None = None,
    ) -> Response:
        """A whole answer relayed with the upstream's status and headers; `reply` (the message
        the client is shown) recorded first when the answer is a success."""
        if response.is_success:
            await self.record(state, reply, complete=True)
        return Response(
            content,
            status_code=response.status_code,
            headers={**relayed_headers(response), **self.headers()},
        )

    def stream(
        self, state: State, response: httpx.Response, chunks: Chunks, reply: StreamedReply
    ) -> StreamingResponse:
        """A stream relayed as `chunks` come; `reply` is what they add up to (see the module
        docstring for when it is recorded)."""
        return StreamingResponse(
            self._recording(state, chunks, reply),
            status_code=response.status_code,
            headers={
                **relayed_headers(response),
                **self.headers(),
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
            media_type="text/event-stream",
        )

    async def _recording(
        self, state: State, chunks: Chunks, reply: StreamedReply
    ) -> AsyncGenerator[bytes, None]:
        recorded = False
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if chunk is REPLY_COMPLETE:
                        recorded = True
                        with anyio.CancelScope(shield=True):
                            await self.record(state, reply.message(), complete=reply.complete)
                    elif isinstance(chunk, bytes):
                        yield chunk
        finally:
            # The client may be gone (cancelled scope): storing the reply must still happen.
            if not recorded:
                with anyio.CancelScope(shield=True):
                    await self.record(state, reply.message(), complete=reply.complete)

    async def record(
        self, state: State, reply: Mapping[str, Any] | None, *, complete: bool
    ) -> None:
        """Store the assistant's reply after the conversation (the write path queues its build)
        and count the request's tokens (the conversation's statistics and the metrics)."""
        if reply is None:
            return
        began = time.perf_counter()
        stats = self.stats()
        try:
            async with transaction(state.engine) as conn:
                await store.append(
                    conn,
                    tenant_id=self.tenant_id,
                    conversation_id=self.conversation_id,
                    messages=[reply],
                    model=self.model,
                    status="complete" if complete else "incomplete",
                    request=stats,
                )
            state.metrics.observe_request(stats)
        except MemstrataError:
            # The client already has its answer; losing the stored copy is logged loudly.
            log.exception("could not store the reply", extra={"conversation": self.external_id})
        finally:
            self.overhead += time.perf_counter() - began

    def stats(self) -> store.RequestStats:
        """What the request cost, as the conversation's statistics count it."""
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return store.RequestStats(
            sent=self.context_tokens or 0,
            full=self.full_tokens or 0,
            reused=self.reused,
            upstream_prompt=_count(usage.get("prompt_tokens")),
            upstream_cached=_count(cached),
            upstream_completion=_count(usage.get("completion_tokens")),
            fingerprint=self.fingerprint,
            prepare_context=self.from_context,
        )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
