"""Admin routes of conversations: list, statistics, messages, bulk import, the summary tree
(whole, or a page of one node's children), one node, export, deletion, forced compaction and a
dry run of the context with its parts and why each quoted message was picked.

Everything acts within one tenant (`?tenant=`, see `scope`); a conversation or node of another
tenant is 404, exactly like one that does not exist.
"""

import base64
import binascii
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from gateway.deps import EngineDep, StateDep
from gateway.errors import GatewayError
from gateway.openai import chat
from gateway.routes.admin.models import (
    MAX_ID,
    TEXT_PATTERN,
    BranchRunPublic,
    CompactQueued,
    ContextPart,
    ContextPublic,
    ContextRequest,
    ConversationDeleted,
    ConversationList,
    ConversationPublic,
    ConversationStats,
    HierarchyPublic,
    ImportResult,
    MessagePublic,
    MessagesPublic,
    NodePathPublic,
    NodePublic,
    RecalledPublic,
    TreePagePublic,
)
from gateway.routes.admin.scope import ConversationPath, ScopeDep, id_path
from gateway.schemas import ImportRequest
from memory.build import tree
from memory.db import transaction
from memory.errors import NotFound
from memory.write import branches, conversations, identity, store, tree_nodes, tree_pages

router = APIRouter()

JSONL = "application/x-ndjson"


def _public(summary: conversations.ConversationSummary) -> dict[str, Any]:
    return {
        "conversation": summary.external_id,
        "user": summary.user,
        "messages": summary.messages,
        "tokens_stored": summary.token_count,
        "requests": summary.requests,
        "tokens_sent": summary.tokens_sent,
        "tokens_full": summary.tokens_full,
        "tokens_reused": summary.tokens_reused,
        "tokens_cached": summary.usage_cached_tokens,
        "upstream_prompt_tokens": summary.usage_prompt_tokens,
        "upstream_completion_tokens": summary.usage_completion_tokens,
        "memory_reuse": summary.memory_reuse,
        "compactions": summary.compactions,
        "created_at": summary.created_at,
        "last_activity": summary.updated_at,
    }


def _cursor(before: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"before": before}).encode()).decode()


def _before(cursor: str) -> int:
    try:
        before = json.loads(base64.urlsafe_b64decode(cursor.encode()))["before"]
    except (ValueError, TypeError, KeyError, binascii.Error) as exc:
        raise GatewayError(400, "cursor is not one this API gave", param="cursor") from exc
    if not isinstance(before, int) or not 1 <= before <= 2**63 - 1:
        raise GatewayError(400, "cursor is not one this API gave", param="cursor")
    return before


def _aware(moment: datetime | None) -> datetime | None:
    """Times without a zone are UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


@router.get("/conversations", summary="List conversations, newest first")
async def list_conversations(
    engine: EngineDep,
    tenant_id: ScopeDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=200, description="`next_cursor` of the previous page")
    ] = None,
    user: Annotated[
        str | None,
        Query(max_length=1000, pattern=TEXT_PATTERN, description="Only this OpenAI `user`"),
    ] = None,
    prefix: Annotated[
        str | None,
        Query(max_length=128, pattern=TEXT_PATTERN, description="Only ids starting with this"),
    ] = None,
    active_after: Annotated[
        datetime | None, Query(description="Only conversations active at or after this time")
    ] = None,
    active_before: Annotated[
        datetime | None, Query(description="Only conversations last active before this time")
    ] = None,
) -> ConversationList:
    """Pages of `limit`: pass `next_cursor` as `cursor` for the next one."""
    async with transaction(engine) as conn:
        page = await conversations.list_conversations(
            conn,
            tenant_id=tenant_id,
            limit=limit,
            before=_before(cursor) if cursor is not None else None,
            user=user,
            prefix=prefix,
            updated_after=_aware(active_after),
            updated_before=_aware(active_before),
        )
        pending = await conversations.pending_jobs(
            conn, tenant_id=tenant_id, ids=[item.id for item in page.items]
        )
    return ConversationList(
        data=[
            ConversationPublic(**_public(item), pending_jobs=pending.get(item.id, {}))
            for item in page.items
        ],
        has_more=page.next_before is not None,
        next_cursor=_cursor(page.next_before) if page.next_before is not None else None,
    )


@router.get("/conversations/{conversation}", summary="A conversation's statistics")
async def conversation_stats(
    conversation: ConversationPath, engine: EngineDep, tenant_id: ScopeDep
) -> ConversationStats:
    """Messages, nodes and tokens per level, tokens stored vs sent, compression ratio, last
    activity and pending jobs."""
    async with transaction(engine) as conn:
        found = await conversations.stats(conn, tenant_id=tenant_id, external_id=conversation)
    return ConversationStats(
        **_public(found.conversation),
        levels={str(level): count for level, count in found.levels.items()},
        level_tokens={str(level): count for level, count in found.level_tokens.items()},
        compression_ratio=found.compression_ratio,
        pending_jobs=found.pending_jobs,
        working_context=found.working_context,
    )


@router.delete("/conversations/{conversation}", summary="Delete a conversation and all of it")
async def delete_conversation(
    conversation: ConversationPath, engine: EngineDep, tenant_id: ScopeDep
) -> ConversationDeleted:
    """Its messages, summaries, embeddings and jobs are deleted; nothing can be recovered."""
    async with transaction(engine) as conn:
        deleted = await conversations.delete_conversation(
            conn, tenant_id=tenant_id, external_id=conversation
        )
    return ConversationDeleted(
        conversation=conversation,
        messages=deleted.messages,
        summaries=deleted.summaries,
        jobs=deleted.jobs,
    )


@router.get("/conversations/{conversation}/messages", summary="Stored messages, in order")
async def conversation_messages(
    conversation: ConversationPath,
    engine: EngineDep,
    tenant_id: ScopeDep,
    after_seq: Annotated[int, Query(ge=-1, le=2**31 - 1)] = -1,
    limit: Annotated[int | None, Query(ge=1, le=100_000)] = None,
) -> MessagesPublic:
    """Messages with `seq` above `after_seq`, at most `limit` (default: all)."""
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
        records = await store.list_messages(
            conn, tenant_id=tenant_id, conversation_id=ref.id, after_seq=after_seq, limit=limit
        )
    return MessagesPublic(
        conversation=conversation,
        messages=[MessagePublic.model_validate(record) for record in records],
    )


@router.post(
    "/conversations/{conversation}/messages", summary="Bulk-import messages", status_code=201
)
async def import_messages(
    conversation: ConversationPath, body: ImportRequest, engine: EngineDep, tenant_id: ScopeDep
) -> ImportResult:
    """Append OpenAI-format messages (each with an optional `created_at`); the write path
    queues their processing. Messages the conversation already holds, as a resent prefix, are
    skipped."""
    if body.user is not None and "\x00" in body.user:
        raise GatewayError(400, "user must not contain NUL characters", param="user")
    # A replaced system prompt's mark (`system_prompt`) is not the message's: such a message
    # is stored as a turn here, where the history is placed as a chat request's is.
    messages = [
        m.model_dump(exclude={"created_at", "system_prompt"}, exclude_none=True)
        for m in body.messages
    ]
    async with transaction(engine) as conn:
        found = await identity.identify(
            conn, tenant_id=tenant_id, external_id=conversation, user=body.user, messages=messages
        )
        stored = await store.store_new(
            conn,
            tenant_id=tenant_id,
            found=found,
            messages=messages,
            model=body.model,
            created_at=[_aware(m.created_at) for m in body.messages],
        )
    return ImportResult(
        conversation=conversation,
        imported=len(stored.node_ids),
        skipped=len(messages) - len(stored.node_ids),
        first_seq=stored.first_seq,
    )


@router.get(
    "/conversations/{conversation}/export",
    summary="Export as JSONL",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {JSONL: {"schema": {"type": "string"}}},
            "description": "One OpenAI message per line, with `created_at`: the bulk "
            "import's format",
        }
    },
)
async def export_conversation(
    conversation: ConversationPath, engine: EngineDep, tenant_id: ScopeDep
) -> StreamingResponse:
    """Every message, one JSON object per line, streamed; re-importable as is."""
    lines = conversations.export_messages(engine, tenant_id=tenant_id, external_id=conversation)
    # Fail before the answer starts if the conversation does not exist.
    first = await anext(lines, None)

    async def body() -> AsyncIterator[bytes]:
        if first is None:
            return
        yield _jsonl(first)
        async for line in lines:
            yield _jsonl(line)

    return StreamingResponse(
        body(),
        media_type=JSONL,
        headers={"Content-Disposition": f'attachment; filename="{conversation}.jsonl"'},
    )


def _jsonl(message: dict[str, Any]) -> bytes:
    return (json.dumps(message, ensure_ascii=False) + "\n").encode()


@router.get("/conversations/{conversation}/hierarchy", summary="The summary tree")
async def conversation_hierarchy(
    conversation: ConversationPath, engine: EngineDep, tenant_id: ScopeDep
) -> HierarchyPublic:
    """Node counts per level, every summary with its span, children and method, and how the
    messages branch."""
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
        counts = await tree_nodes.level_counts(conn, tenant_id=tenant_id, conversation_id=ref.id)
        summaries = await tree_nodes.list_nodes(conn, tenant_id=tenant_id, conversation_id=ref.id)
        runs = await branches.runs(conn, tenant_id=tenant_id, conversation_id=ref.id)
    return HierarchyPublic(
        conversation=conversation,
        levels={str(level): count for level, count in counts.items()},
        nodes=[node_public(record, conversation) for record in summaries],
        branches=[BranchRunPublic.model_validate(run) for run in runs],
    )


@router.get("/conversations/{conversation}/tree", summary="One page of the summary tree")
async def conversation_tree(
    conversation: ConversationPath,
    engine: EngineDep,
    tenant_id: ScopeDep,
    parent: Annotated[
        int | None,
        Query(ge=1, le=MAX_ID, description="The summary whose children to list; none: the roots"),
    ] = None,
    after: Annotated[
        int | None,
        Query(ge=-1, le=2**31 - 1, description="Only nodes covering messages after this seq"),
    ] = None,
    before: Annotated[
        int | None,
        Query(ge=0, le=2**31 - 1, description="The nodes just before message seq `before`"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> TreePagePublic:
    """The nodes directly under `parent` (the roots without it: what no summary covers yet), in
    time order, `limit` at a time: the tree is read one level of one node at a time, so a page
    costs the same at 10 or 100,000 messages."""
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
        if parent is not None:
            above = await tree_nodes.get_node(conn, tenant_id=tenant_id, node_id=parent)
            if above.conversation_id != ref.id:
                raise NotFound(f"node {parent} is not in conversation {conversation!r}")
        page = await tree_pages.tree_page(
            conn,
            tenant_id=tenant_id,
            conversation_id=ref.id,
            parent_id=parent,
            after_span=after,
            before_span=before,
            limit=limit,
        )
    return TreePagePublic(
        conversation=conversation,
        parent=parent,
        nodes=[node_public(record, conversation) for record in page.nodes],
        more_before=page.more_before,
        more_after=page.more_after,
    )


@router.post(
    "/conversations/{conversation}/compact",
    summary="Compact now",
    status_code=202,
)
async def compact(
    conversation: ConversationPath, engine: EngineDep, tenant_id: ScopeDep
) -> CompactQueued:
    """Queue a build that also closes the open segment, so everything stored gets summarized."""
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
        await tree.enqueue(conn, tenant_id=tenant_id, conversation_id=ref.id, final=True)
    return CompactQueued(conversation=conversation)


@router.post("/conversations/{conversation}/context", summary="Dry-run the context")
async def context_dry_run(
    conversation: ConversationPath, body: ContextRequest, state: StateDep, tenant_id: ScopeDep
) -> ContextPublic:
    """The prompt the gateway would send upstream if the conversation received `query` now as
    its next user message (the working context, the recall note, the question), its tokens,
    each part labelled with its tokens, how much of it repeats the last prompt sent, and why
    each message the recall note quotes was picked (its rank once fused, and its rank in each
    retrieval leg); nothing is stored or sent."""
    assembled = await chat.dry_run(
        state,
        tenant_id=tenant_id,
        external_id=conversation,
        query=body.query,
        budget=body.budget,
        model=body.model,
    )
    parts: list[ContextPart] = []
    for index, (label, count) in enumerate(zip(assembled.labels, assembled.counts, strict=True)):
        if parts and parts[-1].label == label:
            parts[-1].messages += 1
            parts[-1].tokens += count
        else:
            parts.append(ContextPart(label=label, start=index, messages=1, tokens=count))
    return ContextPublic(
        conversation=conversation,
        tokens=assembled.tokens,
        messages=assembled.messages,
        parts=parts,
        reused_tokens=assembled.reused,
        reuse=assembled.reuse,
        working_context=assembled.context_version is not None,
        compacted=assembled.compacted,
        prepared_recall=assembled.prepared_recall,
        recalled=[RecalledPublic.model_validate(why) for why in assembled.why],
    )


@router.get("/nodes/{node_id}", summary="One node")
async def node(
    node_id: Annotated[int, id_path("node")], engine: EngineDep, tenant_id: ScopeDep
) -> NodePublic:
    """A message or a summary, with its parent and children."""
    async with transaction(engine) as conn:
        record = await tree_nodes.get_node(conn, tenant_id=tenant_id, node_id=node_id)
        external_id = await store.external_id(
            conn, tenant_id=tenant_id, conversation_id=record.conversation_id
        )
    return node_public(record, external_id)


@router.get("/nodes/{node_id}/path", summary="A node and the summaries above it")
async def node_path(
    node_id: Annotated[int, id_path("node")], engine: EngineDep, tenant_id: ScopeDep
) -> NodePathPublic:
    """The node's place in its conversation's tree: the summaries above it, the root first,
    then the node."""
    async with transaction(engine) as conn:
        path = await tree_pages.node_path(conn, tenant_id=tenant_id, node_id=node_id)
        external_id = await store.external_id(
            conn, tenant_id=tenant_id, conversation_id=path[0].conversation_id
        )
    return NodePathPublic(
        conversation=external_id, path=[node_public(record, external_id) for record in path]
    )


def node_public(record: tree_nodes.NodeRecord, conversation: str) -> NodePublic:
    return NodePublic(
        id=record.id,
        conversation=conversation,
        level=record.level,
        seq=record.seq,
        span=(record.span_start, record.span_end),
        parent_id=record.parent_id,
        children=record.children,
        role=record.role,
        text=record.text,
        content=record.content,
        name=record.name,
        tool_calls=record.tool_calls,
        tool_call_id=record.tool_call_id,
        follows_seq=record.follows_seq,
        superseded_at=record.superseded_at,
        system_prompt=record.system_prompt,
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
