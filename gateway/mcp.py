"""The memory tools over MCP (SPEC §7): streamable HTTP at `/mcp`, with the official `mcp` SDK.

Six tools: `memory_expand`, `memory_search`, `memory_browse`, `memory_find` and `memory_related`
(the ones the tool loop offers models, `memory.recall.tools`, same meaning and results) and
`memory_stats`. Each
takes the conversation to read as its `conversation` argument (the external id, as in
`X-Memstrata-Conversation`) and reads only that conversation. A conversation or node of another
tenant behaves exactly as a missing one; a bad argument, an unknown conversation or node and a
pattern that runs too long come back as tool errors (`isError`), never as protocol failures.

Tenant: `/mcp` is an ordinary route of the app whose `TenantDep` decides the tenant as for
`/v1` (with `MEMSTRATA_AUTH=on`, the gateway key in `Authorization: Bearer msk-…`; a missing or
revoked key gets 401 before any MCP processing). The tenant travels in the ASGI scope of the
HTTP request behind each call (`ServerRequestContext.request`); it is decided per request, not
per session.

The server is stateless (every POST is served on its own, with a JSON response): any number of
gateway processes can serve `/mcp` behind one address. `McpEndpoint.running()` must be entered in
the app's lifespan (it runs the SDK's session manager).
"""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import mcp_types as types
from fastapi import APIRouter
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.deps import TenantDep, get_state
from gateway.state import State
from memory import tiers
from memory.db import transaction
from memory.errors import InvalidInput, MemstrataError
from memory.recall import tools
from memory.write import conversations, identity, store

PATH: Final = "/mcp"
_TENANT: Final = "memstrata.tenant_id"
_CONVERSATION: Final = {
    "type": "string",
    "description": "The conversation to read: its id, as in the X-Memstrata-Conversation header.",
}
_INSTRUCTIONS: Final = (
    "memstrata keeps every message of a conversation verbatim and summarizes older history in "
    "levels. Every tool reads one conversation, named by its id. Node ids are shown as [#id]."
)


def tool_list() -> list[types.Tool]:
    """The six tools, each taking `conversation` before its own arguments."""
    listed = []
    for definition in tools.definitions():
        function = definition["function"]
        schema = function["parameters"]
        listed.append(
            _tool(
                function["name"],
                function["description"],
                properties=schema["properties"],
                required=schema["required"],
            )
        )
    listed.append(
        _tool(
            "memory_stats",
            "What a conversation holds: messages, tokens, nodes and tokens per memory level, "
            "and background work still pending.",
            properties={},
            required=[],
        )
    )
    return listed


def _tool(
    name: str, description: str, *, properties: dict[str, Any], required: list[str]
) -> types.Tool:
    return types.Tool(
        name=name,
        description=description,
        input_schema={
            "type": "object",
            "properties": {"conversation": _CONVERSATION, **properties},
            "required": ["conversation", *required],
            "additionalProperties": False,
        },
        annotations=types.ToolAnnotations(read_only_hint=True, idempotent_hint=True),
    )


class McpEndpoint:
    """The `/mcp` route and the MCP server behind it (one per app: its manager runs once)."""

    def __init__(self) -> None:
        self.server: Server[Any] = Server(
            "memstrata",
            version="0.1.0",
            instructions=_INSTRUCTIONS,
            on_list_tools=_list_tools,
            on_call_tool=_call_tool,
        )
        self.manager = StreamableHTTPSessionManager(
            app=self.server,
            json_response=True,
            stateless=True,
            # Hosts are not restricted: /mcp is served wherever /v1 is, under the same auth.
            security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        self.router = APIRouter(tags=["mcp"])
        manager = self.manager

        # Stateless: no stream of server-initiated messages to GET, no session to DELETE (405).
        @self.router.post(PATH, include_in_schema=False)
        async def mcp_endpoint(tenant_id: TenantDep) -> Response:
            return _Delegate(manager, tenant_id)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The SDK's session manager, running for the duration of the block.

        It runs in a task of its own: its task group must be left by the task that entered
        it, and a lifespan may be entered and left by different tasks (test fixtures do)."""
        started = asyncio.Event()
        stop = asyncio.Event()

        async def hold() -> None:
            async with self.manager.run():
                started.set()
                await stop.wait()

        task = asyncio.create_task(hold(), name="mcp-session-manager")
        waiting = asyncio.create_task(started.wait())
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():
            task.result()  # it failed to start: raise why
        try:
            yield
        finally:
            stop.set()
            await task


class _Delegate(Response):
    """Hands the request, its tenant added to the scope, to the SDK's transport."""

    def __init__(self, manager: StreamableHTTPSessionManager, tenant_id: int) -> None:
        super().__init__()
        self._manager = manager
        self._tenant_id = tenant_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._manager.handle_request({**scope, _TENANT: self._tenant_id}, receive, send)


async def _list_tools(
    ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    return types.ListToolsResult(tools=tool_list())


async def _call_tool(
    ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
) -> types.CallToolResult:
    request = ctx.request
    if not isinstance(request, Request) or _TENANT not in request.scope:
        return _error("memstrata's tools are served over HTTP at /mcp only")
    state = await get_state(request)
    tenant_id: int = request.scope[_TENANT]
    arguments = dict(params.arguments or {})
    try:
        conversation = arguments.pop("conversation", None)
        if not isinstance(conversation, str):
            raise InvalidInput("conversation is required: the id of the conversation to read")
        identity.validate_conversation_id(conversation)
        if params.name == "memory_stats":
            stats = await _stats(state, tenant_id, conversation)
            return types.CallToolResult(
                content=[types.TextContent(text=json.dumps(stats))], structured_content=stats
            )
        async with transaction(state.engine) as conn:
            ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
            text = await tools.call(
                conn,
                tools.Scope(
                    tenant_id=tenant_id,
                    conversation_id=ref.id,
                    abandoned=state.settings.recall_abandoned_branches == "on",
                ),
                name=params.name,
                arguments=arguments,
                embedder=state.embedder,
                limits=tools.Limits(
                    regex_timeout=state.settings.regex_timeout,
                    result_chars=state.settings.tool_result_chars,
                ),
            )
        state.accesses.add(tenant_id, tiers.ids_in(text))
    except MemstrataError as exc:
        return _error(str(exc))
    return types.CallToolResult(content=[types.TextContent(text=text)])


async def _stats(state: State, tenant_id: int, conversation: str) -> dict[str, Any]:
    async with transaction(state.engine) as conn:
        found = await conversations.stats(conn, tenant_id=tenant_id, external_id=conversation)
    summary = found.conversation
    return {
        "conversation": summary.external_id,
        "user": summary.user,
        "messages": summary.messages,
        "tokens": summary.token_count,
        "levels": {str(level): count for level, count in sorted(found.levels.items())},
        "level_tokens": {str(level): n for level, n in sorted(found.level_tokens.items())},
        "pending_jobs": found.pending_jobs,
        "tiers": found.tiers,
        "created_at": summary.created_at.isoformat(),
        "updated_at": summary.updated_at.isoformat(),
    }


def _error(message: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)
