"""What the app holds for its lifetime: one `State`, built in the lifespan (`gateway.app`).

A leaf: it imports the types it holds and nothing that reads a request, so that `deps`, `auth`
and the OpenAI surface can all depend on it without depending on each other.
"""

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.key_grace import KeyGrace
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.upstream import Upstream
from memory.embeddings import Embedder
from memory.recall.early import PastBudget


@dataclass
class State:
    """The settings, the database engine, the upstream clients and the query embedder, with
    this process's metrics, recently verified keys and the conversations it found past their
    budget."""

    settings: Settings
    engine: AsyncEngine
    upstream: Upstream
    embedder: Embedder
    default_tenant_id: int
    metrics: Metrics = field(default_factory=Metrics)
    key_grace: KeyGrace = field(default_factory=lambda: KeyGrace(seconds=0))
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    past_budget: PastBudget = field(default_factory=PastBudget)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` after the response, held until it ends or the app stops (`close`)."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def close(self) -> None:
        """Cancel what `spawn` started and still runs, and wait for it to end."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
