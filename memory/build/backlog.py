"""The job queue as operators see it (`memory.build.jobs` runs it): how many jobs are in each
status, and the newest jobs themselves.

Both read in the caller's transaction, scoped to one tenant when given one, and change nothing:
reviving a dead job is a transition of the queue (`jobs.retry`).
"""

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.build.jobs import DONE, STATUSES
from memory.errors import InvalidInput
from memory.schema import jobs

__all__ = ["JobRecord", "depth", "list_jobs"]


@dataclass(frozen=True)
class JobRecord:
    """A job as the admin API shows it."""

    id: int
    kind: str
    status: str
    tenant_id: int | None
    conversation_id: int | None
    attempts: int
    max_attempts: int
    last_error: str | None
    run_after: datetime
    created_at: datetime
    updated_at: datetime


def _of_tenant(tenant_id: int | None) -> list[ColumnElement[bool]]:
    return [] if tenant_id is None else [jobs.c.tenant_id == tenant_id]


async def depth(conn: AsyncConnection, *, tenant_id: int | None = None) -> dict[str, int]:
    """How many jobs are in each status, and `failures`: failed at least once and not done."""
    failing = and_(jobs.c.last_error.is_not(None), jobs.c.status != DONE)
    rows = await conn.execute(
        select(jobs.c.status, func.count(), func.count().filter(failing))
        .where(*_of_tenant(tenant_id))
        .group_by(jobs.c.status)
    )
    counts = dict.fromkeys(STATUSES, 0)
    counts["failures"] = 0
    for status, count, failures in rows:
        counts[status] = counts.get(status, 0) + int(count)
        counts["failures"] += int(failures)
    return counts


async def list_jobs(
    conn: AsyncConnection,
    *,
    status: str | None,
    tenant_id: int | None,
    limit: int = 100,
    conversation_id: int | None = None,
) -> list[JobRecord]:
    """The newest jobs, of `status`, `tenant_id` and `conversation_id` if given."""
    if status is not None and status not in STATUSES:
        raise InvalidInput(f"status must be one of {', '.join(STATUSES)}", param="status")
    if not 1 <= limit <= 1000:
        raise InvalidInput("limit must be between 1 and 1000", param="limit")
    query = (
        select(
            jobs.c.id,
            jobs.c.kind,
            jobs.c.status,
            jobs.c.tenant_id,
            jobs.c.conversation_id,
            jobs.c.attempts,
            jobs.c.max_attempts,
            jobs.c.last_error,
            jobs.c.run_after,
            jobs.c.created_at,
            jobs.c.updated_at,
        )
        .where(*_of_tenant(tenant_id))
        .order_by(jobs.c.id.desc())
        .limit(limit)
    )
    if status is not None:
        query = query.where(jobs.c.status == status)
    if conversation_id is not None:
        query = query.where(jobs.c.conversation_id == conversation_id)
    return [
        JobRecord(
            id=row.id,
            kind=row.kind,
            status=row.status,
            tenant_id=row.tenant_id,
            conversation_id=row.conversation_id,
            attempts=row.attempts,
            max_attempts=row.max_attempts,
            last_error=row.last_error,
            run_after=row.run_after,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )
        for row in await conn.execute(query)
    ]
