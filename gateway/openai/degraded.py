"""Serving chat requests while the database is down (`MEMSTRATA_FAIL_OPEN`).

With fail-open on, a chat request whose messages cannot be stored, or whose prompt cannot be
assembled, because Postgres is unreachable goes upstream exactly as the client sent it; the
answer (stream or not, error or not) is relayed as usual with `X-Memstrata-Degraded: 1`. What is
stored depends on when the database failed:

* before the client's messages were stored: nothing of the request is (it is answered as if
  memstrata were not there);
* after they were stored (the prompt could not be assembled): the reply is stored too, once the
  database is back, as any turn's (`gateway.openai.turn`).

The response carries `X-Memstrata-Conversation` when the client named its conversation or its
messages were stored. With fail-open off the `StorageUnavailable` is raised again, and the
client gets 503 in OpenAI's shape.
"""

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from gateway.openai import relay
from gateway.openai.turn import CONVERSATION_HEADER, Turn
from gateway.state import State
from memory.errors import StorageUnavailable

log = logging.getLogger(__name__)

DEGRADED_HEADER = "X-Memstrata-Degraded"


@dataclass
class DegradedTurn(Turn):
    """A turn forwarded without memory; it records its reply only for a `stored` turn."""

    stored: Turn | None = None
    """The turn whose messages were stored before the database failed."""

    def headers(self) -> dict[str, str]:
        headers = {
            DEGRADED_HEADER: "1",
            "X-Memstrata-Overhead-Ms": f"{self.overhead * 1000:.2f}",
        }
        if self.external_id:
            headers[CONVERSATION_HEADER] = self.external_id
        return headers

    async def record(
        self, state: State, reply: Mapping[str, Any] | None, *, complete: bool
    ) -> None:
        if self.stored is not None:
            await self.stored.record(state, reply, complete=complete)


async def forward(
    state: State,
    cause: StorageUnavailable,
    *,
    client_headers: Mapping[str, str],
    query: str,
    body: dict[str, Any],
    tenant_id: int,
    external_id: str | None,
    model: str,
    stream: bool,
    started: float,
    stored: Turn | None = None,
) -> Response:
    """Forward the client's own `body` unchanged if fail-open is on; else raise `cause`.
    `stored`: the turn, when the client's messages were stored before the database failed."""
    if state.settings.fail_open != "on":
        raise cause
    log.warning("database unavailable, forwarding without memory: %s", cause)
    state.metrics.degraded.inc()
    turn = DegradedTurn(
        tenant_id=tenant_id,
        conversation_id=0,
        external_id=external_id or "",
        model=model,
        started=started,
        stored=stored,
    )
    turn.overhead = time.perf_counter() - started
    return await relay.forward(
        state, turn, client_headers=client_headers, query=query, body=body, stream=stream
    )
