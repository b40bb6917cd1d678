"""The admin API: what memstrata stores, for operators (loopback clients only for now)."""

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from pydantic import BaseModel

from gateway.deps import EngineDep, TenantDep, require_admin
from gateway.schemas import ImportRequest
from memory import hierarchy, identity, jobs, store
from memory.db import transaction

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)])


class MessagePublic(BaseModel):
    """A stored message with its place in the conversation."""

    node_id: int
    seq: int
    role: str
    content: Any
    name: str | None
    tool_calls: list[dict[str, Any]] | None
    tool_call_id: str | None
    status: str
    token_count: int
    created_at: datetime


class MessagesPublic(BaseModel):
    conversation: str
    messages: list[MessagePublic]


class ImportResult(BaseModel):
    conversation: str
    imported: int
    skipped: int
    first_seq: int


class NodePublic(BaseModel):
    """A node of the hierarchy: a message (level 0) or a summary with its children."""

    id: int
    level: int
    seq: int
    span: tuple[int, int]
    parent_id: int | None
    children: list[int]
    role: str | None
    text: str
    content: Any = None
    facts: dict[str, list[str]] | None
    method: str | None
    model: str | None
    token_count: int
    importance: float
    pinned: bool
    status: str
    embedded: bool
    created_at: datetime
    meta: dict[str, Any]


class HierarchyPublic(BaseModel):
    conversation: str
    levels: dict[str, int]
    nodes: list[NodePublic]


class JobPublic(BaseModel):
    id: int
    kind: str
    status: str
    attempts: int
    max_attempts: int
    conversation_id: int | None
    last_error: str | None
    run_after: datetime
    created_at: datetime
    updated_at: datetime


class JobsPublic(BaseModel):
    depth: dict[str, int]
    jobs: list[JobPublic]


@router.get("/conversations/{conversation}/messages", summary="Stored messages, in order")
async def conversation_messages(
    conversation: str, engine: EngineDep, tenant_id: TenantDep
) -> MessagesPublic:
    identity.validate_conversation_id(conversation)
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
        records = await store.list_messages(conn, tenant_id=tenant_id, conversation_id=ref.id)
    return MessagesPublic(
        conversation=conversation,
        messages=[
            MessagePublic(
                node_id=record.node_id,
                seq=record.seq,
                role=record.role,
                content=record.content,
                name=record.name,
                tool_calls=record.tool_calls,
                tool_call_id=record.tool_call_id,
                status=record.status,
                token_count=record.token_count,
                created_at=record.created_at,
            )
            for record in records
        ],
    )


@router.post(
    "/conversations/{conversation}/messages", summary="Bulk-import messages", status_code=201
)
async def import_messages(
    conversation: str, body: ImportRequest, engine: EngineDep, tenant_id: TenantDep
) -> ImportResult:
    """Append OpenAI-format messages (each with an optional `created_at`) and queue their
    processing. Messages the conversation already holds, as a resent prefix, are skipped."""
    identity.validate_conversation_id(conversation)
    messages = [m.model_dump(exclude={"created_at"}, exclude_none=True) for m in body.messages]
    async with transaction(engine) as conn:
        stored = await store.ingest(
            conn,
            tenant_id=tenant_id,
            external_id=conversation,
            user=body.user,
            messages=messages,
            model=body.model,
            created_at=[m.created_at for m in body.messages],
        )
        await hierarchy.enqueue(conn, tenant_id=tenant_id, conversation_id=stored.conversation.id)
    return ImportResult(
        conversation=conversation,
        imported=len(stored.node_ids),
        skipped=len(messages) - len(stored.node_ids),
        first_seq=stored.first_seq,
    )


@router.get("/conversations/{conversation}/hierarchy", summary="The summary tree")
async def conversation_hierarchy(
    conversation: str, engine: EngineDep, tenant_id: TenantDep
) -> HierarchyPublic:
    """Node counts per level, and every summary with its span, children and method."""
    identity.validate_conversation_id(conversation)
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
        counts = await store.level_counts(conn, tenant_id=tenant_id, conversation_id=ref.id)
        summaries = await store.list_nodes(conn, tenant_id=tenant_id, conversation_id=ref.id)
    return HierarchyPublic(
        conversation=conversation,
        levels={str(level): count for level, count in counts.items()},
        nodes=[_node(record) for record in summaries],
    )


@router.get("/nodes/{node_id}", summary="One node")
async def node(node_id: int, engine: EngineDep, tenant_id: TenantDep) -> NodePublic:
    async with transaction(engine) as conn:
        record = await store.get_node(conn, tenant_id=tenant_id, node_id=node_id)
    return _node(record)


@router.get("/jobs", summary="Background jobs: queue depth, failures, dead letters")
async def list_jobs(
    engine: EngineDep,
    tenant_id: TenantDep,
    status: Annotated[str | None, Query(pattern="^(queued|running|done|dead)$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JobsPublic:
    async with transaction(engine) as conn:
        depth = await jobs.depth(conn, tenant_id=tenant_id)
        records = await jobs.list_jobs(conn, status=status, tenant_id=tenant_id, limit=limit)
    return JobsPublic(
        depth=depth,
        jobs=[
            JobPublic(
                id=job.id,
                kind=job.kind,
                status=job.status,
                attempts=job.attempts,
                max_attempts=job.max_attempts,
                conversation_id=job.conversation_id,
                last_error=job.last_error,
                run_after=job.run_after,
                created_at=job.created_at,
                updated_at=job.updated_at,
            )
            for job in records
        ],
    )


def _node(record: store.NodeRecord) -> NodePublic:
    return NodePublic(
        id=record.id,
        level=record.level,
        seq=record.seq,
        span=(record.span_start, record.span_end),
        parent_id=record.parent_id,
        children=record.children,
        role=record.role,
        text=record.text,
        content=record.content,
        facts=record.facts,
        method=record.method,
        model=record.model,
        token_count=record.token_count,
        importance=record.importance,
        pinned=record.pinned,
        status=record.status,
        embedded=record.embedded,
        created_at=record.created_at,
        meta=record.meta,
    )
