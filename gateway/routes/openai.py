"""The OpenAI-compatible surface: chat completions and responses with memory; every other
`/v1` path relayed to the upstream unchanged (`gateway.openai.passthrough`), each tenant reaching
only its own objects there while authentication is on (`gateway.openai.tenancy`)."""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from gateway.bodies import read_json
from gateway.deps import StateDep, TenantDep, UpstreamDep, get_tenant_id
from gateway.errors import GatewayError
from gateway.openai import chat, passthrough, response_objects, responses, tenancy

router = APIRouter(prefix="/v1", tags=["openai"])

# A gateway key is needed while auth is on, also for what is only relayed.
_KEYED = [Depends(get_tenant_id)]


@router.post("/chat/completions", summary="Chat completion with memory")
async def chat_completions(request: Request, state: StateDep, tenant_id: TenantDep) -> Response:
    return await chat.complete(request, state, tenant_id=tenant_id)


@router.post("/responses", summary="A response (the Responses API) with memory")
async def create_response(request: Request, state: StateDep, tenant_id: TenantDep) -> Response:
    return await responses.create(request, state, tenant_id=tenant_id)


@router.get("/responses/{response_id}", summary="A stored response, as the client saw it")
async def get_response(response_id: str, state: StateDep, tenant_id: TenantDep) -> dict[str, Any]:
    return await response_objects.retrieve(state, tenant_id=tenant_id, response_id=response_id)


@router.post("/responses/{response_id}/cancel", summary="Cancel a response: it is finished")
async def cancel_response(
    response_id: str, state: StateDep, tenant_id: TenantDep
) -> dict[str, Any]:
    return await response_objects.cancel(state, tenant_id=tenant_id, response_id=response_id)


@router.delete("/responses/{response_id}", summary="Delete a stored response, here and upstream")
async def delete_response(
    request: Request, response_id: str, state: StateDep, tenant_id: TenantDep
) -> Any:
    return await response_objects.delete(
        request, state, tenant_id=tenant_id, response_id=response_id
    )


@router.get("/responses/{response_id}/input_items", summary="The input items of a stored response")
async def get_input_items(
    response_id: str,
    state: StateDep,
    tenant_id: TenantDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict[str, Any]:
    return await response_objects.input_items(
        state, tenant_id=tenant_id, response_id=response_id, limit=limit, order=order, after=after
    )


@router.get("/models", summary="Models of the upstream, relayed", dependencies=_KEYED)
async def models(request: Request, upstream: UpstreamDep) -> Response:
    return await passthrough.relay(request, upstream, "/models")


@router.post("/embeddings", summary="Embeddings of the upstream, relayed", dependencies=_KEYED)
async def embeddings(request: Request, state: StateDep, upstream: UpstreamDep) -> Response:
    body = await read_json(request, max_bytes=state.settings.max_body_bytes)
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object", code="invalid_value")
    return await passthrough.relay(request, upstream, "/embeddings", json=body)


async def relayed(path: str, request: Request, state: StateDep, tenant_id: TenantDep) -> Response:
    return await tenancy.relay(request, state, tenant_id=tenant_id, path=path)


# One route per method, so that each has its own operation in the OpenAPI document.
for _method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
    router.add_api_route(
        "/{path:path}",
        relayed,
        methods=[_method],
        operation_id=f"relay_{_method.lower()}",
        summary="Any other path of the upstream, relayed unchanged (no memory)",
        dependencies=_KEYED,
    )
