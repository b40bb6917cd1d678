"""Dependencies of the routes, as `Annotated` aliases over the app's lifespan state.

Every dependency is `async def`, even where it awaits nothing: FastAPI runs a plain `def`
dependency in a worker thread, a thread hop on every request for a field lookup.

`State` (`gateway.state`) is everything the app holds for its lifetime. `TenantDep` is the tenant a
client request acts for and `require_admin` guards the admin API; both are decided in
`gateway.auth`.
"""

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway import auth
from gateway.state import State
from gateway.upstream import Upstream


async def get_state(request: Request) -> State:
    state: State = request.state.memstrata
    return state


async def get_engine(state: Annotated[State, Depends(get_state)]) -> AsyncEngine:
    return state.engine


async def get_upstream(state: Annotated[State, Depends(get_state)]) -> Upstream:
    return state.upstream


# Declared for the OpenAPI document (and /docs' "Authorize" button); `gateway.auth` reads the
# header itself.
_client_key = HTTPBearer(
    scheme_name="GatewayKey",
    description="A gateway key `msk-…` with MEMSTRATA_AUTH=on; else your upstream key, if any",
    auto_error=False,
)
_admin_token = HTTPBearer(
    scheme_name="AdminToken",
    description="MEMSTRATA_ADMIN_TOKEN (none needed from loopback while it is unset)",
    auto_error=False,
)


async def get_tenant_id(
    request: Request,
    state: Annotated[State, Depends(get_state)],
    _: Annotated[HTTPAuthorizationCredentials | None, Security(_client_key)],
) -> int:
    """The tenant of this request: the default one while authentication is off, else the
    tenant of the gateway key presented."""
    return await auth.tenant_from_headers(state, request.headers)


async def require_admin(
    request: Request,
    state: Annotated[State, Depends(get_state)],
    _: Annotated[HTTPAuthorizationCredentials | None, Security(_admin_token)],
) -> None:
    """Admin routes need the admin token, or come from loopback while none is set."""
    auth.check_admin(state, request)


StateDep = Annotated[State, Depends(get_state)]
EngineDep = Annotated[AsyncEngine, Depends(get_engine)]
UpstreamDep = Annotated[Upstream, Depends(get_upstream)]
TenantDep = Annotated[int, Depends(get_tenant_id)]
