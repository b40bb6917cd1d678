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
leaves, with what arrived, marked incomplete. An answer that refuses the request as invalid
(`REFUSED`) takes the turn's messages off the current branch instead (`withdraw`). Every
response of the turn carries `headers()`.

A reply that cannot be stored because the database is down is not given up: once the client
has its answer, this process tries again, backing off, for `RECORD_RETRY_SECONDS`; a reply
still unstored then, or when the process stops, is logged as lost from memory.
"""

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.metrics import Metrics
from gateway.state import State
from gateway.upstream import relayed_headers
from memory.db import transaction
from memory.errors import StorageUnavailable
from memory.recall import working_context
from memory.recall.assemble import Assembled
from memory.write import appends, refusals, replies, store

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "X-Memstrata-Conversation"
RECORD_RETRY_SECONDS = 120.0
# The upstream's answers that refuse the request itself as invalid (a content part, an image,
# a prompt too long for the model), which it would refuse again with every later prompt that
# repeats the turn. Not 404 (an unknown model: the turn is sound), nor 408, 409 or 429
# (try again), nor 401 or 403 (the key).
REFUSED = frozenset({400, 413, 422})
# Headers a relayed stream sets itself, in place of the upstream's.
_STREAM_HEADERS = frozenset({"cache-control", "x-accel-buffering"})


class Mark(enum.Enum):
    """What a stream's producer yields besides bytes."""

    REPLY_COMPLETE = "reply complete"
    """The reply is whole: record it before anything after this is sent."""


REPLY_COMPLETE = Mark.REPLY_COMPLETE

Chunks = AsyncGenerator[bytes | Mark, None]


class Reply(Protocol):
    """A reply rebuilt from a stream as it is relayed (`gateway.openai.replies.StreamedReply`,
    `gateway.openai.response_events.ResponseReply`)."""

    @property
    def complete(self) -> bool:
        """Whether the stream reached its end."""

    def message(self) -> dict[str, Any] | None:
        """The assistant message so far, or None."""


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
    # Whether the memory tools may be offered: the budget kept room for their definitions.
    memory_tools: bool = True
    # Where the reply goes, as the write path said when it stored the turn.
    reply_to: store.ReplyTo | None = None
    # The seq of the first message the turn stored (None: it stored none, a retry), from
    # which its messages leave the current branch if the upstream refuses it (`withdraw`).
    stored_from: int | None = None
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
        the client is shown) recorded first when the answer is a success (`shown` as the
        client is shown it), the turn withdrawn when it refuses the request."""
        if response.is_success:
            await self.record(state, reply, complete=True)
            content = self.shown(content)
        elif response.status_code in REFUSED:
            await self.withdraw(state)
        return Response(
            content,
            status_code=response.status_code,
            headers={**relayed_headers(response), **self.headers()},
        )

    def shown(self, content: bytes) -> bytes:
        """A successful whole answer as the client is shown it: the upstream's, as it came."""
        return content

    def stream(
        self, state: State, response: httpx.Response, chunks: Chunks, reply: Reply
    ) -> StreamingResponse:
        """A stream relayed as `chunks` come; `reply` is what they add up to (see the module
        docstring for when it is recorded)."""
        return StreamingResponse(
            self._recording(state, chunks, reply),
            status_code=response.status_code,
            headers={
                # The upstream's own `cache-control` would go out beside the gateway's (the
                # names differ in case): one header, the gateway's.
                **{
                    name: value
                    for name, value in relayed_headers(response).items()
                    if name.lower() not in _STREAM_HEADERS
                },
                **self.headers(),
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
            media_type="text/event-stream",
        )

    async def _recording(
        self, state: State, chunks: Chunks, reply: Reply
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
        and count the request's tokens (the conversation's statistics and the metrics); then,
        in the same transaction, what a subclass keeps beside it (`recorded`)."""
        if reply is None and not self.records_without_reply:
            return
        began = time.perf_counter()
        try:
            await self.store_reply(state, reply, complete=complete)
        except StorageUnavailable:
            held = None if reply is None else dict(reply)
            state.spawn(_record_when_back(state, self, held, complete=complete))
        except Exception:
            # Whatever failed, the client gets (or has) its answer: the stored copy's loss is
            # logged loudly rather than turned into an error the client would see instead.
            log.exception("could not store the reply", extra={"conversation": self.external_id})
        finally:
            spent = time.perf_counter() - began
            self.overhead += spent
            state.metrics.observe_stages({"record": spent})

    async def withdraw(self, state: State) -> None:
        """Take the messages the turn stored off the current branch, the upstream having
        refused the request (`memory.write.refusals`), with the working context that holds
        them; logged, never raised, if it cannot be done: the client has its answer."""
        if self.stored_from is None or self.reply_to is None:
            return
        extra = {"conversation": self.external_id}
        try:
            async with transaction(state.engine) as conn:
                withdrawn = await refusals.withdraw(
                    conn,
                    tenant_id=self.tenant_id,
                    conversation_id=self.conversation_id,
                    first_seq=self.stored_from,
                    head=self.reply_to,
                )
                if withdrawn:
                    await self._forget_context(conn, branched_at=self.stored_from)
        except Exception:
            log.exception("could not withdraw a turn the upstream refused", extra=extra)
            return
        if withdrawn:
            log.info("the upstream refused the turn: its messages left the branch", extra=extra)

    async def _forget_context(self, conn: AsyncConnection, *, branched_at: int) -> None:
        """Drop the working context if it holds messages that left the branch from seq
        `branched_at` on (`working_context.forget`)."""
        await working_context.forget(
            conn,
            tenant_id=self.tenant_id,
            conversation_id=self.conversation_id,
            branched_at=branched_at,
        )

    # A turn whose answer is worth keeping even without a reply message (a response object).
    records_without_reply: ClassVar[bool] = False

    async def recorded(self, conn: AsyncConnection) -> None:
        """What a kind of turn keeps beside its reply, in the transaction that stored it."""

    async def store_reply(
        self, state: State, reply: Mapping[str, Any] | None, *, complete: bool
    ) -> None:
        """`record`'s work, raising what went wrong (`StorageUnavailable` while the database
        is down): the reply, then what the turn keeps beside it, in one transaction."""
        stats = self.stats()
        async with transaction(state.engine) as conn:
            if reply is not None:
                replaced = await replies.record(
                    conn,
                    tenant_id=self.tenant_id,
                    conversation_id=self.conversation_id,
                    reply=reply,
                    model=self.model,
                    status="complete" if complete else "incomplete",
                    request=stats,
                    reply_to=self.reply_to,
                )
                if replaced is not None:  # a retry's answer took the first's place
                    await self._forget_context(conn, branched_at=replaced)
            await self.recorded(conn)
        if reply is not None:
            state.metrics.observe_request(stats)

    def stats(self) -> appends.RequestStats:
        """What the request cost, as the conversation's statistics count it."""
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return appends.RequestStats(
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


async def _record_when_back(
    state: State, turn: Turn, reply: dict[str, Any] | None, *, complete: bool
) -> None:
    deadline = time.monotonic() + RECORD_RETRY_SECONDS
    delay = 0.25
    extra = {"conversation": turn.external_id}
    while True:
        try:
            await turn.store_reply(state, reply, complete=complete)
        except StorageUnavailable:
            if time.monotonic() + delay > deadline:
                log.error("a reply is lost from memory: the database stayed down", extra=extra)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
        except Exception:
            log.exception("a reply could not be stored", extra=extra)
            return
        else:
            log.info("stored a reply once the database was back", extra=extra)
            return
