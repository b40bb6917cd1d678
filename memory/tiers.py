"""Lifecycle tiers (SPEC §5, MemOS): hot, warm and cold, from how often each node is used.

Shared by the read path, which counts accesses and reads tiers, and the background, which
sweeps them.

* An **access** is a node placed in a prompt sent upstream, or returned by a memory tool (the
  tool loop's or MCP's, `memory_search` included). A dry run counts none.
* Each node counts its accesses (`node_access`: all time, and `recent`, those of the current
  `WINDOW`) and keeps its last access time. **Promotion is lazy**, in the statement that counts
  an access: **hot** at `HOT_ACCESSES` accesses within the window, **warm** at one, a window
  older than `WINDOW` restarting at this access. A node never accessed has no row: **cold**.
* **Demotion** is the sweeper's (`sweep`, a job of its own, `memory.build.sweeper`): hot →
  warm after `HOT_IDLE` without an access, warm → cold after `WINDOW` without one.
* Nothing is ever deleted or hidden by a tier: tiers rank (`HOT_BOOST`) and order the search
  at scale (`memory.recall.retrieval`), nothing more.

Counting stays off the request's critical path: `Accesses` is an in-process buffer the request
adds node ids to (no I/O), flushed by the caller in the background (`record`: one batched
upsert per flush). A crash loses what was not flushed yet: accesses are a ranking hint, not
memory.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = [
    "HOT_ACCESSES",
    "HOT_BOOST",
    "HOT_IDLE",
    "TIERS",
    "WINDOW",
    "Accesses",
    "hot_among",
    "ids_in",
    "record",
    "sweep",
    "tier_counts",
]

TIERS: Final = ("hot", "warm", "cold")
HOT_ACCESSES: Final = 3
"""Accesses within `WINDOW` that make a node hot (one makes it warm)."""
WINDOW: Final = timedelta(days=7)
"""How far back accesses count; a warm node unused this long is cold again."""
HOT_IDLE: Final = timedelta(hours=1)
"""A hot node unused this long is warm again."""
HOT_BOOST: Final = 1.1
"""Multiplier of a hot node's fused score: a tie-break among near equals, never more."""

_TAG = re.compile(r"\[#(\d+)\]")

# One statement per flush. Ids of another tenant, or of no node, insert nothing (the join);
# the window restarts at an access that comes after it closed; the tier follows the count.
_RECORD = text(
    """
INSERT INTO node_access AS a (node_id, tenant_id, conversation_id, accesses, recent,
                              window_start, last_access, tier)
SELECT n.id, n.tenant_id, n.conversation_id, u.times, u.times, now(), now(),
       CASE WHEN u.times >= :hot THEN 'hot' ELSE 'warm' END
FROM unnest(CAST(:ids AS bigint[]), CAST(:times AS integer[])) AS u(id, times)
JOIN nodes n ON n.id = u.id AND n.tenant_id = :tenant_id
ON CONFLICT (node_id) DO UPDATE SET
    accesses = a.accesses + excluded.accesses,
    recent = CASE WHEN a.window_start < now() - CAST(:window AS interval)
                  THEN excluded.recent ELSE a.recent + excluded.recent END,
    window_start = CASE WHEN a.window_start < now() - CAST(:window AS interval)
                        THEN now() ELSE a.window_start END,
    last_access = now(),
    tier = CASE WHEN (CASE WHEN a.window_start < now() - CAST(:window AS interval)
                           THEN excluded.recent ELSE a.recent + excluded.recent END) >= :hot
                THEN 'hot' ELSE 'warm' END
"""
)
_SWEEP = text(
    """
WITH demoted AS (
    UPDATE node_access SET
        tier = CASE WHEN last_access < now() - CAST(:window AS interval) THEN 'cold'
                    ELSE 'warm' END,
        recent = CASE WHEN last_access < now() - CAST(:window AS interval) THEN 0 ELSE recent END
    WHERE tier <> 'cold'
      AND (last_access < now() - CAST(:window AS interval)
           OR (tier = 'hot' AND last_access < now() - CAST(:idle AS interval)))
    RETURNING tier
)
SELECT tier, count(*) FROM demoted GROUP BY tier
"""
)


def ids_in(result: str) -> list[int]:
    """The node ids a memory tool's result shows (every node it returns is tagged `[#id]`)."""
    return [int(found) for found in _TAG.findall(result)]


class Accesses:
    """Node ids accessed per tenant, not yet recorded (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: dict[int, Counter[int]] = {}

    def add(self, tenant_id: int, node_ids: Iterable[int]) -> None:
        """Count one access of each of `node_ids` (no I/O)."""
        ids = list(node_ids)
        if ids:
            self._pending.setdefault(tenant_id, Counter()).update(ids)

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._pending.values())

    def take(self) -> dict[int, Counter[int]]:
        """Everything pending, which is then empty."""
        pending, self._pending = self._pending, {}
        return pending


async def record(conn: AsyncConnection, *, tenant_id: int, accessed: Counter[int]) -> None:
    """Count `accessed` (node id → times) for nodes of `tenant_id`, promoting them lazily."""
    if not accessed:
        return
    await conn.execute(
        _RECORD,
        {
            "tenant_id": tenant_id,
            "ids": list(accessed),
            "times": list(accessed.values()),
            "hot": HOT_ACCESSES,
            "window": WINDOW,
        },
    )


async def sweep(
    conn: AsyncConnection, *, window: timedelta = WINDOW, idle: timedelta = HOT_IDLE
) -> dict[str, int]:
    """Demote every tenant's nodes unused for too long (hot → warm after `idle`, warm → cold
    after `window`); how many went to each tier."""
    rows = await conn.execute(_SWEEP, {"window": window, "idle": idle})
    return {str(tier): int(count) for tier, count in rows}


async def hot_among(conn: AsyncConnection, *, tenant_id: int, node_ids: Sequence[int]) -> set[int]:
    """The hot nodes among `node_ids`."""
    if not node_ids:
        return set()
    rows = await conn.scalars(
        text(
            "SELECT node_id FROM node_access WHERE tenant_id = :tenant_id "
            "AND node_id = ANY(:ids) AND tier = 'hot'"
        ),
        {"tenant_id": tenant_id, "ids": list(node_ids)},
    )
    return {int(node) for node in rows}


async def tier_counts(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int
) -> dict[str, int]:
    """Nodes of a conversation per tier (every tier present; cold: never accessed, or swept)."""
    total = await conn.scalar(
        text("SELECT count(*) FROM nodes WHERE tenant_id = :t AND conversation_id = :c"),
        {"t": tenant_id, "c": conversation_id},
    )
    rows = await conn.execute(
        text(
            "SELECT tier, count(*) FROM node_access WHERE tenant_id = :t AND conversation_id = :c "
            "AND tier <> 'cold' GROUP BY tier"
        ),
        {"t": tenant_id, "c": conversation_id},
    )
    counts = dict.fromkeys(TIERS, 0) | {str(tier): int(n) for tier, n in rows}
    counts["cold"] = int(total or 0) - counts["hot"] - counts["warm"]
    return counts
