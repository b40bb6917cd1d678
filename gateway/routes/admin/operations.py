"""Admin routes across a tenant's conversations: search, and the background jobs (queue depth,
failures, dead letters, each job with the conversation it works on, retrying one)."""

import logging
from typing import Annotated

from fastapi import APIRouter, Query

from gateway.deps import EngineDep, StateDep
from gateway.routes.admin.models import (
    CONVERSATION_MAX,
    CONVERSATION_PATTERN,
    TEXT_PATTERN,
    HitPublic,
    JobPublic,
    JobRetried,
    JobsPublic,
    SearchResults,
)
from gateway.routes.admin.scope import ScopeDep, id_path
from memory.build import backlog, jobs
from memory.db import spare, transaction
from memory.errors import ProviderError
from memory.recall import retrieval
from memory.recall.tools import MAX_QUERY_CHARS
from memory.write import conversations, store

log = logging.getLogger(__name__)
router = APIRouter()

SEARCH_SCOPE = 1000
"""Without `conversation`, search covers the tenant's most recently active conversations."""


@router.get("/search", summary="Search a tenant's memory")
async def search(
    state: StateDep,
    tenant_id: ScopeDep,
    q: Annotated[str, Query(min_length=1, max_length=MAX_QUERY_CHARS, pattern=TEXT_PATTERN)],
    conversation: Annotated[
        str | None,
        Query(
            pattern=CONVERSATION_PATTERN,
            max_length=CONVERSATION_MAX,
            description="Only this conversation",
        ),
    ] = None,
    level: Annotated[
        list[int] | None, Query(description="Only these levels (0: messages); repeatable")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> SearchResults:
    """Hybrid search (vector + full text) over messages and summaries, best first: in one
    conversation, or in the tenant's 1,000 most recently active ones; messages of abandoned
    branches included."""
    levels = [value for value in level or [] if 0 <= value <= 32767] or None
    if level and levels is None:
        return SearchResults(query=q, data=[])
    try:
        [vector] = await state.embedder.embed([q])
    except ProviderError:
        log.warning("query embedding failed; searching by full text only")
        vector = None
    async with transaction(state.engine) as conn:
        names = await conversations.recent(
            conn, tenant_id=tenant_id, external_id=conversation, limit=SEARCH_SCOPE
        )
        async with spare(conn) as aside:
            hits = await retrieval.search(
                conn,
                tenant_id=tenant_id,
                conversation_ids=list(names),
                query=q,
                query_vector=vector,
                limit=limit,
                levels=levels,
                abandoned=True,  # an operator sees every branch
                aside=aside,
            )
    return SearchResults(
        query=q,
        data=[
            HitPublic(
                node_id=hit.node_id,
                conversation=names[hit.conversation_id],
                level=hit.level,
                seq=hit.seq,
                span=(hit.span_start, hit.span_end),
                role=hit.role,
                text=hit.text,
                score=hit.score,
                created_at=hit.created_at,
            )
            for hit in hits
            if hit.conversation_id in names
        ],
    )


@router.get("/jobs", summary="Background jobs: queue depth, failures, dead letters")
async def list_jobs(
    engine: EngineDep,
    tenant_id: ScopeDep,
    status: Annotated[str | None, Query(pattern="^(queued|running|done|dead)$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    conversation: Annotated[
        str | None, Query(pattern=CONVERSATION_PATTERN, description="Only this conversation's")
    ] = None,
) -> JobsPublic:
    """The tenant's queue depth by status, how many jobs are failing, and the newest jobs
    (only one conversation's with `conversation`; the depth stays the tenant's)."""
    async with transaction(engine) as conn:
        conversation_id = None
        if conversation is not None:
            ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=conversation)
            conversation_id = ref.id
        depth = await backlog.depth(conn, tenant_id=tenant_id)
        records = await backlog.list_jobs(
            conn,
            status=status,
            tenant_id=tenant_id,
            limit=limit,
            conversation_id=conversation_id,
        )
        names = await conversations.external_ids(
            conn,
            tenant_id=tenant_id,
            ids={job.conversation_id for job in records if job.conversation_id is not None},
        )
    listed = [JobPublic.model_validate(job) for job in records]
    for job in listed:
        if job.conversation_id is not None:
            job.conversation = names.get(job.conversation_id)
    return JobsPublic(depth=depth, jobs=listed)


@router.post("/jobs/{job_id}/retry", summary="Retry a job now")
async def retry_job(
    job_id: Annotated[int, id_path("job")], engine: EngineDep, tenant_id: ScopeDep
) -> JobRetried:
    """Queue a dead (or backing-off) job to run now with its attempts reset."""
    async with transaction(engine) as conn:
        queued = await jobs.retry(conn, job_id=job_id, tenant_id=tenant_id)
    return JobRetried(id=job_id, queued=queued)
