"""How long the job queue keeps jobs that are done.

Done jobs serve only to look back (the admin API lists the newest ones); kept for ever they grew
the table by one row per turn of every conversation. `delete_done` deletes those finished more
than `older_than` seconds ago, in batches of `batch` rows, each in a transaction of its own, so
that no statement holds many locks or writes much WAL at once. Queued, running and dead jobs are
never deleted: a dead job waits for an operator (`memory.build.jobs.retry`).

Rows are found through the primary key, oldest first: done jobs finish roughly in id order, so
a batch reads few rows besides the ones it deletes, and no index on `finished_at` is needed.
Rows another deleter holds are skipped, so any number of workers may sweep at once.
"""

from datetime import timedelta
from typing import Final

from sqlalchemy import Interval, bindparam, delete, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from memory.build.jobs import DONE, status_sql, storage_errors
from memory.errors import InvalidInput
from memory.schema import jobs

BATCH: Final = 1000
"""Done jobs deleted per transaction."""

_EXPIRED = (
    select(jobs.c.id)
    .where(
        jobs.c.status == status_sql(DONE),
        jobs.c.finished_at < func.now() - bindparam("older_than", type_=Interval()),
    )
    .order_by(jobs.c.id)
    .limit(bindparam("batch"))
    .with_for_update(skip_locked=True)
)
_DELETE = delete(jobs).where(jobs.c.id.in_(_EXPIRED.scalar_subquery()))


async def delete_done(engine: AsyncEngine, *, older_than: float, batch: int = BATCH) -> int:
    """Delete the jobs done more than `older_than` seconds ago; how many were deleted."""
    if older_than <= 0:
        raise InvalidInput("older_than must be positive", param="older_than")
    if batch < 1:
        raise InvalidInput("batch must be at least 1", param="batch")
    deleted = 0
    while True:
        async with storage_errors("deleting old done jobs"), engine.begin() as conn:
            result = await conn.execute(
                _DELETE, {"older_than": timedelta(seconds=older_than), "batch": batch}
            )
        deleted += result.rowcount
        if result.rowcount < batch:
            return deleted
