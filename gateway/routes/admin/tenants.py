"""Admin routes of tenants and their gateway keys.

A key's secret is in the answer that creates it and nowhere else; listings show its prefix.
Revoking a key (or deleting a tenant) refuses it from the next request on. A key id of another
tenant is 404.
"""

from typing import Annotated

from fastapi import APIRouter

from gateway.deps import EngineDep, StateDep
from gateway.routes.admin.models import (
    KeyCreate,
    KeyCreated,
    KeyList,
    KeyPublic,
    TenantCreate,
    TenantDeleted,
    TenantList,
    TenantPublic,
)
from gateway.routes.admin.scope import TenantPath, id_path
from memory.db import transaction
from memory.write import tenants

router = APIRouter()


def _key(record: tenants.KeyRecord, tenant: str) -> KeyPublic:
    return KeyPublic(
        id=record.id,
        tenant=tenant,
        name=record.name,
        prefix=record.prefix,
        created_at=record.created_at,
        revoked_at=record.revoked_at,
    )


@router.post("/tenants", summary="Create a tenant", status_code=201)
async def create_tenant(body: TenantCreate, engine: EngineDep) -> TenantPublic:
    """A new, empty tenant (409 if the name is taken)."""
    async with transaction(engine) as conn:
        return TenantPublic.model_validate(await tenants.create_tenant(conn, name=body.name))


@router.get("/tenants", summary="List tenants")
async def list_tenants(engine: EngineDep) -> TenantList:
    async with transaction(engine) as conn:
        return TenantList(
            data=[
                TenantPublic.model_validate(record) for record in await tenants.list_tenants(conn)
            ]
        )


@router.get("/tenants/{tenant}", summary="One tenant")
async def get_tenant(tenant: TenantPath, engine: EngineDep) -> TenantPublic:
    async with transaction(engine) as conn:
        return TenantPublic.model_validate(await tenants.get_tenant(conn, name=tenant))


@router.delete("/tenants/{tenant}", summary="Delete a tenant and everything it owns")
async def delete_tenant(tenant: TenantPath, state: StateDep, engine: EngineDep) -> TenantDeleted:
    """Its keys, conversations, messages, summaries and jobs are deleted; the default tenant
    cannot be (409)."""
    async with transaction(engine) as conn:
        tenant_id = await tenants.tenant_id(conn, name=tenant)
        await tenants.delete_tenant(conn, name=tenant)
    state.key_grace.forget_tenant(tenant_id)
    return TenantDeleted(name=tenant)


@router.post("/tenants/{tenant}/keys", summary="Create a gateway key", status_code=201)
async def create_key(
    tenant: TenantPath, engine: EngineDep, body: KeyCreate | None = None
) -> KeyCreated:
    """A new `msk-…` key for the tenant: the answer holds the key, shown this once."""
    async with transaction(engine) as conn:
        tenant_id = await tenants.tenant_id(conn, name=tenant)
        created = await tenants.create_key(
            conn, tenant_id=tenant_id, name=body.name if body is not None else ""
        )
    return KeyCreated(**_key(created.record, tenant).model_dump(), key=created.secret)


@router.get("/tenants/{tenant}/keys", summary="List a tenant's keys")
async def list_keys(tenant: TenantPath, engine: EngineDep) -> KeyList:
    """Every key of the tenant, revoked ones included, by prefix (never the key)."""
    async with transaction(engine) as conn:
        tenant_id = await tenants.tenant_id(conn, name=tenant)
        records = await tenants.list_keys(conn, tenant_id=tenant_id)
    return KeyList(data=[_key(record, tenant) for record in records])


@router.delete("/tenants/{tenant}/keys/{key_id}", summary="Revoke a gateway key")
async def revoke_key(
    tenant: TenantPath,
    key_id: Annotated[int, id_path("key")],
    state: StateDep,
    engine: EngineDep,
) -> KeyPublic:
    """The key is refused from the next request on; revoking it again changes nothing."""
    async with transaction(engine) as conn:
        tenant_id = await tenants.tenant_id(conn, name=tenant)
        record = await tenants.revoke_key(conn, tenant_id=tenant_id, key_id=key_id)
    state.key_grace.forget_tenant(tenant_id)
    return _key(record, tenant)
