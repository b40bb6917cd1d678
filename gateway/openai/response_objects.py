"""The stored responses of the Responses API: `GET /v1/responses/{id}`, its `input_items`,
`POST /v1/responses/{id}/cancel` and `DELETE /v1/responses/{id}`.

Each is scoped by the tenant: another tenant's response answers as an unknown one (404). A
response is read back as the client saw it, from what the gateway stored
(`memory.write.responses`), never from the upstream. Deleting one deletes the gateway's record,
so that it can no longer be read back nor continued (`previous_response_id`: 404), and the
upstream's copy, which an upstream serving the Responses API keeps unless the request said
`store: false`: the `DELETE` is relayed first, and an upstream that answers anything but success
or "not found" (it never had it: a translated response, an id the gateway made) has its answer
relayed with nothing deleted. The messages the response stored stay in the conversation's
memory, as every message does; deleting the conversation (the admin API) removes them.

A response is finished by the time its client has its id (a `background` request runs in the
foreground: `gateway.openai.responses`), so a cancel answers it as it is, as cancelling a
finished background response does, and goes nowhere upstream, which holds nothing in progress
for it.
"""

from typing import Any
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response

from gateway.errors import GatewayError
from gateway.openai import passthrough
from gateway.openai.response_upstream import NOT_SERVED
from gateway.state import State
from memory.db import transaction
from memory.write import responses as stored_responses


async def retrieve(state: State, *, tenant_id: int, response_id: str) -> dict[str, Any]:
    """`GET /v1/responses/{id}`: the response as the client saw it."""
    async with transaction(state.engine) as conn:
        found = await stored_responses.find(conn, tenant_id=tenant_id, response_id=response_id)
    return found.body


async def cancel(state: State, *, tenant_id: int, response_id: str) -> dict[str, Any]:
    """`POST /v1/responses/{id}/cancel`: the response, already finished, as it is; 400 for
    one not asked for in the background, which OpenAI never lets a client cancel."""
    found = await retrieve(state, tenant_id=tenant_id, response_id=response_id)
    if found.get("background") is not True:
        raise GatewayError(400, "Only responses created with background=true can be cancelled.")
    return found


async def input_items(
    state: State,
    *,
    tenant_id: int,
    response_id: str,
    limit: int,
    order: str,
    after: str | None,
) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: a page of the request's input items."""
    async with transaction(state.engine) as conn:
        found = await stored_responses.find(conn, tenant_id=tenant_id, response_id=response_id)
    items = found.input_items if order == "asc" else found.input_items[::-1]
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise GatewayError(404, f"No item with id '{after}' found.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


async def delete(
    request: Request, state: State, *, tenant_id: int, response_id: str
) -> dict[str, Any] | Response:
    """`DELETE /v1/responses/{id}`: the response deleted upstream, then here."""
    async with transaction(state.engine) as conn:
        await stored_responses.find(conn, tenant_id=tenant_id, response_id=response_id)
    upstream = state.upstream
    if upstream.serves_responses is not False:
        answer = await upstream.open(
            "DELETE",
            f"/responses/{quote(response_id, safe='')}",
            headers=upstream.headers_for(request.headers),
            stream=True,
            observed_as="/responses/{id}",
        )
        if not answer.is_success and answer.status_code not in NOT_SERVED:
            return passthrough.answer(answer)
        await upstream.read(answer)
    async with transaction(state.engine) as conn:
        await stored_responses.delete(conn, tenant_id=tenant_id, response_id=response_id)
    return {"id": response_id, "object": "response", "deleted": True}
