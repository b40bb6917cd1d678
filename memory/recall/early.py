"""The new message's query vector, started while the turn is being stored, or before.

Embedding the query is the longest single step of a turn served from memory, and it needs only
the new messages' text. `Early(embedder)` is an `Embedder` for one request:

* `start(text)` begins embedding `text` at once, in a task of its own; the gateway calls it as
  soon as identifying the conversation says where the request's new messages start, with the
  query the read path will ask for (`memory.recall.assemble.query_ahead`: none when the
  conversation still fits its budget), so the embedding runs while the turn is stored and its
  working context read. For a conversation this process last found past its budget
  (`PastBudget`) it is called before that, as the request arrives, with a guess
  (`memory.recall.assemble.query_guess`); identifying then starts the query it finds instead
  when the guess was wrong (the guess's work is cancelled), and keeps the guess's when right;
* `embed([text])` for the text started awaits that work instead of embedding it again; any
  other call goes to the wrapped embedder, so a guess that turns out wrong costs the work, never
  the result;
* `close()` cancels the work when nobody awaited it (a refused turn, a conversation that fit
  after all) and consumes its failure, if any.

It stores nothing. The request path's `embed` stage (`memory.stages`) is then the time the read
path waited for the vector, after what the store step hid of it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from memory.embeddings import Embedder

__all__ = ["Early", "PastBudget"]

KEPT: Final = 16_384
"""Most conversations a `PastBudget` remembers (the least recently seen are forgotten)."""


class Early:
    """An `Embedder` that serves the one query started ahead (see the module docstring)."""

    def __init__(self, embedder: Embedder) -> None:
        self.name = embedder.name
        self.dim = embedder.dim
        self._embedder = embedder
        self._text: str | None = None
        self._task: asyncio.Task[list[list[float]]] | None = None

    @property
    def started(self) -> str | None:
        """The text being (or already) embedded ahead, if any."""
        return self._text

    def start(self, text: str) -> None:
        """Begin embedding `text`, in place of any other text started before (a guess that was
        wrong: its work is cancelled); nothing for the text already started. An empty text
        starts nothing and cancels a guess."""
        if text == self._text:
            return
        self.close()
        self._text, self._task = None, None
        if text:
            self._text = text
            self._task = asyncio.ensure_future(self._embedder.embed([text]))

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        task = self._task
        if task is not None and list(texts) == [self._text]:
            # Shielded: a reader that gives up (a query embedded again without a name) does
            # not cancel the work for another; `close` does.
            return await asyncio.shield(task)
        return await self._embedder.embed(texts)

    def close(self) -> None:
        """Cancel the work started if it is still running; consume its failure if it failed."""
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # retrieved: a failure nobody awaited is not logged as lost


class PastBudget:
    """The conversations named by the client (tenant, external id) that this process last found
    past their budget: a request to one of them starts its query's guess as it arrives
    (`Early`). Conversations only grow, so a guess is rarely wasted; one that fits is never
    guessed for until it has been seen past its budget."""

    def __init__(self, kept: int = KEPT) -> None:
        self._kept = kept
        self._seen: OrderedDict[tuple[int, str], bool] = OrderedDict()

    def holds(self, tenant_id: int, external_id: str) -> bool:
        """Whether the conversation was past its budget when last seen."""
        return self._seen.get((tenant_id, external_id), False)

    def saw(self, tenant_id: int, external_id: str, *, past: bool) -> None:
        """Remember whether the conversation is past its budget."""
        key = (tenant_id, external_id)
        self._seen[key] = past
        self._seen.move_to_end(key)
        if len(self._seen) > self._kept:
            self._seen.popitem(last=False)
