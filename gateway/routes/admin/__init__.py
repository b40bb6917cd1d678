"""The admin API (`/admin`): tenants and keys, conversations, search, jobs.

Every route needs the admin token, or a loopback client while none is set (`gateway.auth`).
Routes that read or change a tenant's data act within one tenant, named by `?tenant=` (the
default tenant when omitted); anything of another tenant is 404, never 403. Bodies are JSON:
any other `Content-Type` is 415, as on the OpenAI surface (`gateway.bodies`).
"""

from fastapi import APIRouter, Depends

from gateway.bodies import json_only
from gateway.deps import require_admin
from gateway.routes.admin import conversations, operations, tenants

router = APIRouter(
    prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin), Depends(json_only)]
)
router.include_router(tenants.router)
router.include_router(conversations.router)
router.include_router(operations.router)
