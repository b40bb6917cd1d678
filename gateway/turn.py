"""One request's turn: what the gateway established about it, and how its reply is recorded.

A `Turn` is made once the client's messages are stored; the assembly step fills in the prompt
it built, the relay calls `record` when the upstream's reply is complete (or cut), and every
response of the turn carries `headers()`.
"""

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.deps import State
from memory.build import tree
from memory.db import transaction
from memory.errors import MemstrataError
from memory.write import store

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "X-Memstrata-Conversation"


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

    async def record(
        self, state: State, reply: Mapping[str, Any] | None, *, complete: bool
    ) -> None:
        """Store the assistant's reply after the conversation, queue its processing, and
        count the request's tokens (the conversation's statistics and the metrics)."""
        if reply is None:
            return
        began = time.perf_counter()
        try:
            async with transaction(state.engine) as conn:
                await store.append(
                    conn,
                    tenant_id=self.tenant_id,
                    conversation_id=self.conversation_id,
                    messages=[reply],
                    model=self.model,
                    status="complete" if complete else "incomplete",
                    request_tokens=(self.context_tokens or 0, self.full_tokens or 0),
                )
                await tree.enqueue(
                    conn, tenant_id=self.tenant_id, conversation_id=self.conversation_id
                )
            state.metrics.observe_tokens(sent=self.context_tokens or 0, full=self.full_tokens or 0)
        except MemstrataError:
            # The client already has its answer; losing the stored copy is logged loudly.
            log.exception("could not store the reply", extra={"conversation": self.external_id})
        finally:
            self.overhead += time.perf_counter() - began
