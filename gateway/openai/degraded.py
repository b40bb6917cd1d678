"""Serving chat requests while the database is down (`MEMSTRATA_FAIL_OPEN`).

With fail-open on, a chat request whose messages cannot be stored, or whose prompt cannot be
assembled, because Postgres is unreachable goes upstream exactly as the client sent it; the
answer (stream or not, error or not) is relayed as usual with `X-Memstrata-Degraded: 1`. Storing
and assembling share one transaction (`gateway.openai.chat`), so such a request stores nothing,
neither its messages nor its reply: it is answered as if memstrata were not there. (A database
that fails later, while the upstream answers, is the recorded turn's affair:
`gateway.openai.turn` retries its reply.)

The response carries `X-Memstrata-Conversation` when the client named its conversation. With
fail-open off the `StorageUnavailable` is raised again, and the client gets 503 in OpenAI's
shape.
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
    """A turn forwarded without memory; nothing of it is recorded."""

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
        return None


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
) -> Response:
    """Forward the client's own `body` unchanged if fail-open is on; else raise `cause`."""
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
    )
    turn.overhead = time.perf_counter() - started
    return await relay.forward(
        state, turn, client_headers=client_headers, query=query, body=body, stream=stream
    )
