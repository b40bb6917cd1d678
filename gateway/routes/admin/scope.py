"""What an admin request acts on: the tenant (`?tenant=NAME`, the default tenant when omitted)
and validated path parameters. An unknown tenant is 404, like any missing thing."""

from typing import Annotated, Any

from fastapi import Depends, Path, Query

from gateway.deps import EngineDep, StateDep
from gateway.routes.admin.models import (
    CONVERSATION_MAX,
    CONVERSATION_PATTERN,
    MAX_ID,
    TENANT_MAX,
    TENANT_PATTERN,
)
from memory.db import transaction
from memory.write import tenants

TenantQuery = Annotated[
    str | None,
    Query(
        pattern=TENANT_PATTERN,
        max_length=TENANT_MAX,
        description="The tenant to act within (its name); the default tenant when omitted",
        openapi_examples={"default": {"summary": "The default tenant", "value": "default"}},
    ),
]
TenantPath = Annotated[
    str,
    Path(
        pattern=TENANT_PATTERN,
        max_length=TENANT_MAX,
        description="The tenant's name",
        openapi_examples={"default": {"summary": "The default tenant", "value": "default"}},
    ),
]
ConversationPath = Annotated[
    str,
    Path(
        pattern=CONVERSATION_PATTERN,
        max_length=CONVERSATION_MAX,
        description="The conversation's id (1-128 characters of A-Za-z0-9._:-, not dots alone)",
        openapi_examples={"chat": {"summary": "A conversation id", "value": "chat-42"}},
    ),
]


def id_path(what: str) -> Any:
    """A path parameter holding a database id."""
    return Path(
        ge=1,
        le=MAX_ID,
        description=f"The {what}'s id",
        openapi_examples={"first": {"summary": f"A {what} id", "value": 1}},
    )


async def scoped_tenant(state: StateDep, engine: EngineDep, tenant: TenantQuery = None) -> int:
    """The id of the tenant named by `?tenant=`, or of the default tenant."""
    if tenant is None:
        return state.default_tenant_id
    async with transaction(engine) as conn:
        return await tenants.tenant_id(conn, name=tenant)


ScopeDep = Annotated[int, Depends(scoped_tenant)]
"""The tenant an admin request acts within."""
