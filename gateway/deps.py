"""Dependencies of the routes, as `Annotated` aliases over the app's lifespan state."""

import ipaddress
import json
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import GatewayError
from gateway.settings import Settings
from gateway.upstream import Upstream
from memory.embeddings import Embedder


@dataclass
class State:
    """What the app holds for its lifetime (built in the lifespan, see `gateway.app`)."""

    settings: Settings
    engine: AsyncEngine
    upstream: Upstream
    embedder: Embedder
    default_tenant_id: int


def get_state(request: Request) -> State:
    state: State = request.state.memstrata
    return state


def get_settings(state: Annotated[State, Depends(get_state)]) -> Settings:
    return state.settings


def get_engine(state: Annotated[State, Depends(get_state)]) -> AsyncEngine:
    return state.engine


def get_upstream(state: Annotated[State, Depends(get_state)]) -> Upstream:
    return state.upstream


def get_tenant_id(state: Annotated[State, Depends(get_state)]) -> int:
    """The tenant of this request (one default tenant while authentication is off)."""
    return state.default_tenant_id


def require_admin(request: Request) -> None:
    """Admin routes answer loopback clients only (until admin tokens exist)."""
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise GatewayError(
            403,
            "the admin API answers loopback clients only",
            type="permission_error",
            code="admin_forbidden",
        )


StateDep = Annotated[State, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
EngineDep = Annotated[AsyncEngine, Depends(get_engine)]
UpstreamDep = Annotated[Upstream, Depends(get_upstream)]
TenantDep = Annotated[int, Depends(get_tenant_id)]


async def read_json(request: Request, *, max_bytes: int) -> Any:
    """The request's JSON body, refusing bodies over `max_bytes` before reading them whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    try:
        return json.loads(body, parse_constant=_no_constant)
    except ValueError as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc


def _no_constant(name: str) -> Any:
    """NaN and ±Infinity are not JSON (RFC 8259); Python's parser would accept them."""
    raise ValueError(f"{name} is not a JSON value")


def _too_large(max_bytes: int) -> GatewayError:
    return GatewayError(
        413,
        f"the body is larger than {max_bytes} bytes (MEMSTRATA_MAX_BODY_BYTES)",
        code="request_too_large",
    )
