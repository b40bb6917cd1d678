"""The OpenAI-compatible surface: chat completions with memory; models and embeddings relayed."""

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.bodies import read_json
from gateway.deps import StateDep, TenantDep, UpstreamDep, get_tenant_id
from gateway.openai import chat
from gateway.upstream import relayed_headers

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/chat/completions", summary="Chat completion with memory")
async def chat_completions(request: Request, state: StateDep, tenant_id: TenantDep) -> Response:
    return await chat.complete(request, state, tenant_id=tenant_id)


@router.get(
    "/models",
    summary="Models of the upstream, relayed",
    dependencies=[Depends(get_tenant_id)],  # a gateway key is needed while auth is on
)
async def models(request: Request, upstream: UpstreamDep) -> Response:
    return await _relay(request, upstream, "GET", "/models", body=None)


@router.post(
    "/embeddings",
    summary="Embeddings of the upstream, relayed",
    dependencies=[Depends(get_tenant_id)],  # a gateway key is needed while auth is on
)
async def embeddings(request: Request, state: StateDep, upstream: UpstreamDep) -> Response:
    body = await read_json(request, max_bytes=state.settings.max_body_bytes)
    return await _relay(request, upstream, "POST", "/embeddings", body=body)


async def _relay(
    request: Request, upstream: UpstreamDep, method: str, path: str, *, body: object
) -> Response:
    response = await upstream.open(
        method, path, headers=upstream.headers_for(request.headers), json=body
    )
    content = await upstream.read(response)
    return Response(content, status_code=response.status_code, headers=relayed_headers(response))
