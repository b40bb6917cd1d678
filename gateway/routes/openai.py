"""The OpenAI-compatible surface: chat completions and responses with memory; every other
`/v1` path relayed to the upstream unchanged (`gateway.openai.passthrough`)."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.deps import StateDep, TenantDep, UpstreamDep, get_tenant_id, read_json
from gateway.errors import GatewayError
from gateway.openai import chat, passthrough

router = APIRouter(prefix="/v1", tags=["openai"])

# A gateway key is needed while auth is on, also for what is only relayed.
_KEYED = [Depends(get_tenant_id)]


@router.post("/chat/completions", summary="Chat completion with memory")
async def chat_completions(request: Request, state: StateDep, tenant_id: TenantDep) -> Response:
    return await chat.complete(request, state, tenant_id=tenant_id)


@router.get("/models", summary="Models of the upstream, relayed", dependencies=_KEYED)
async def models(request: Request, upstream: UpstreamDep) -> Response:
    return await passthrough.relay(request, upstream, "/models")


@router.post("/embeddings", summary="Embeddings of the upstream, relayed", dependencies=_KEYED)
async def embeddings(request: Request, state: StateDep, upstream: UpstreamDep) -> Response:
    body = await read_json(request, max_bytes=state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
    return await passthrough.relay(request, upstream, "/embeddings", json=body)


@router.api_route(
    "/{path:path}",
    methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
    summary="Any other path of the upstream, relayed unchanged (no memory)",
    dependencies=_KEYED,
)
async def relayed(path: str, request: Request, upstream: UpstreamDep) -> Response:
    return await passthrough.relay(request, upstream, f"/{path}")
