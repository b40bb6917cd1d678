"""What every retrieval leg searches, and how a leg's rows become its candidates.

* `SCOPE` is the SQL condition on `nodes n` of every leg (`memory.recall.retrieval`'s full
  text, `memory.recall.nearest`'s vectors): the tenant's nodes in the searched conversations,
  never system or developer messages, at the levels asked for, on the current branch unless
  `abandoned`, without the nodes of one conversation from a seq on (what the prompt holds
  verbatim). `scope_params` binds it.
* each leg returns at least `CANDIDATES` candidates, when that many match;
* a leg's statement returns one row of arrays, a column each (`ARRAYS`), and `rows_of` zips
  them back into its rows (conversation_id, level, seq, span_end, name, created_at, exact,
  similarity, ...); `candidates_of` turns those into `memory.recall.fusion.Candidates`, in their
  order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from memory.recall.fusion import Candidates, Place

__all__ = [
    "ARRAYS",
    "CANDIDATES",
    "SCOPE",
    "candidates_of",
    "rows_of",
    "scope_params",
    "zipped",
]

CANDIDATES: Final = 100
"""Candidates each leg returns at least, before fusion."""

SCOPE = """
    n.tenant_id = :tenant_id
    AND n.conversation_id = ANY(:conversation_ids)
    AND (n.level > 0 OR n.role IS NULL OR n.role NOT IN ('system', 'developer'))
    AND (CAST(:levels AS smallint[]) IS NULL OR n.level = ANY(CAST(:levels AS smallint[])))
    AND (CAST(:abandoned AS boolean) OR n.superseded_at IS NULL)
    AND (CAST(:exclude_conversation AS bigint) IS NULL
         OR n.conversation_id <> CAST(:exclude_conversation AS bigint)
         OR n.span_start < CAST(:exclude_from AS integer))
"""


def scope_params(
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    levels: Sequence[int] | None,
    exclude_from: tuple[int, int] | None,
    abandoned: bool,
) -> dict[str, Any]:
    """The parameters of `SCOPE`."""
    return {
        "tenant_id": tenant_id,
        "abandoned": abandoned,
        "conversation_ids": list(conversation_ids),
        "levels": list(levels) if levels is not None else None,
        "exclude_conversation": exclude_from[0] if exclude_from else None,
        "exclude_from": exclude_from[1] if exclude_from else None,
    }


ARRAYS: Final = """
    array_agg(conversation_id{order}), array_agg(level{order}), array_agg(seq{order}),
    array_agg(span_end{order}), array_agg(name{order}), array_agg(created_at{order}),
    array_agg(exact{order}), array_agg(similarity{order})"""
"""The select list of a leg's one row: its candidates' columns as arrays, in the order `{order}`
gives (" ORDER BY ...", or "" for the order of the rows read). Hundreds of candidates a leg came
back a row each, and decoding them (the driver's and SQLAlchemy's work per row, unpacking each)
took 1.2-1.6 ms of CPU a leg more than one row of arrays does (400 candidates, 10,000 messages;
the same candidates)."""


def rows_of(result: Any) -> list[tuple[Any, ...]]:
    """The rows of a statement that returns one row of arrays, a column each (a leg's `ARRAYS`
    and any columns after, or `memory.recall.retrieval.load`'s hits)."""
    return zipped(result.one())


def zipped(columns: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Rows from `columns`, arrays of one length each (`rows_of`)."""
    # No rows: every array_agg is NULL.
    return [] if columns[0] is None else list(zip(*columns, strict=True))


def candidates_of(rows: Any) -> Candidates:
    """A leg's candidates from rows of (conversation_id, level, seq, span_end, name, created_at,
    exact, similarity), best first."""
    # By position: named access to a row's columns costs more than the rest of this loop.
    return Candidates(
        [
            Place(
                key=(conversation_id, level, seq),
                span_end=span_end,
                name=name,
                exact=bool(exact),
                similarity=None if similarity is None else float(similarity),
                created_at=created_at,
            )
            for (
                conversation_id,
                level,
                seq,
                span_end,
                name,
                created_at,
                exact,
                similarity,
                *_,
            ) in rows
        ]
    )
