"""Which tenant made each of the upstream's objects (files, batches, vector stores, ...).

`adopt` records objects a tenant created (the first owner stays: an id already owned is never
handed to another tenant); `owned` says which of some ids a tenant owns. Ids no tenant made
through the gateway belong to none. Every function takes the caller's connection and
keyword-only arguments.
"""

from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.schema import upstream_objects


async def adopt(conn: AsyncConnection, *, tenant_id: int, object_ids: Collection[str]) -> None:
    """Record `object_ids` as `tenant_id`'s, except those another tenant owns already."""
    if not object_ids:
        return
    await conn.execute(
        insert(upstream_objects)
        .values([{"object_id": i, "tenant_id": tenant_id} for i in sorted(set(object_ids))])
        .on_conflict_do_nothing(index_elements=["object_id"])
    )


async def owned(conn: AsyncConnection, *, tenant_id: int, object_ids: Collection[str]) -> set[str]:
    """Those of `object_ids` that `tenant_id` owns."""
    if not object_ids:
        return set()
    rows = await conn.execute(
        select(upstream_objects.c.object_id).where(
            upstream_objects.c.tenant_id == tenant_id,
            upstream_objects.c.object_id.in_(sorted(set(object_ids))),
        )
    )
    return {row.object_id for row in rows}
