"""The admin API's request and response bodies: one family per entity, named by role.

`…Public` is what an answer shows, `…Create` what a request sends. Times are ISO 8601 with a
time zone. A key's secret appears only in `KeyCreated`, the answer that creates it.
"""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TENANT_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
CONVERSATION_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
# Text Postgres can hold: no NUL characters.
TEXT_PATTERN = r"^[^\x00]*$"
MAX_ID = 2**63 - 1
# Answers built straight from the store's records (`Model.model_validate(record)`).
FROM_RECORD = ConfigDict(from_attributes=True)


# -- tenants and keys ------------------------------------------------------------------------


class TenantCreate(BaseModel):
    name: str = Field(pattern=TENANT_PATTERN, description="1-64 characters of A-Za-z0-9._-")


class TenantPublic(BaseModel):
    model_config = FROM_RECORD

    id: int
    name: str
    created_at: datetime
    conversations: int
    active_keys: int


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantPublic]


class TenantDeleted(BaseModel):
    name: str
    deleted: Literal[True] = True


class KeyCreate(BaseModel):
    name: str = Field(default="", max_length=200, pattern=TEXT_PATTERN)


class KeyPublic(BaseModel):
    """A gateway key as listed: its prefix, never the key."""

    id: int
    tenant: str
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


class KeyCreated(KeyPublic):
    key: str = Field(description="The key itself (`msk-…`): shown this once, stored as a hash")


class KeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[KeyPublic]


# -- conversations ---------------------------------------------------------------------------


class ConversationPublic(BaseModel):
    """A conversation in a listing."""

    conversation: str
    user: str | None
    messages: int
    tokens_stored: int = Field(description="Tokens of every stored message, verbatim")
    requests: int = Field(description="Chat requests answered")
    tokens_sent: int = Field(description="Prompt tokens sent upstream for those requests")
    tokens_full: int = Field(description="Tokens their whole histories would have cost")
    created_at: datetime
    last_activity: datetime


class ConversationList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ConversationPublic]
    has_more: bool
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page")


class ConversationStats(ConversationPublic):
    """A conversation's statistics."""

    levels: dict[str, int] = Field(description="Nodes per level (0: messages)")
    level_tokens: dict[str, int] = Field(description="Tokens per level")
    compression_ratio: float | None = Field(
        description="tokens_full / tokens_sent (null before the first answered request)"
    )
    pending_jobs: dict[str, int] = Field(description="Jobs not done yet, by status")
    tiers: dict[str, int] = Field(
        description="Nodes per lifecycle tier: hot (3+ accesses in 7 days), warm (1+), cold"
    )


class ConversationDeleted(BaseModel):
    conversation: str
    deleted: Literal[True] = True
    messages: int
    summaries: int
    jobs: int


class MessagePublic(BaseModel):
    """A stored message with its place in the conversation."""

    model_config = FROM_RECORD

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
    conversation: str
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


class CompactQueued(BaseModel):
    conversation: str
    queued: Literal[True] = Field(
        default=True, description="A compaction is queued (one queued before counts)"
    )


class ContextRequest(BaseModel):
    """A dry run: what the gateway would send upstream if the conversation received `query`."""

    query: str = Field(min_length=1, max_length=100_000, pattern=TEXT_PATTERN)
    budget: int | None = Field(default=None, ge=1, le=10_000_000)
    model: str = Field(default="gpt-4o", min_length=1, max_length=200, pattern=TEXT_PATTERN)


class ContextPublic(BaseModel):
    conversation: str
    tokens: int
    messages: list[dict[str, Any]]
    route: str | None = Field(
        description="The route retrieval took: flat, sequential, graph (relational, with the "
        "concept graph's leg) or relational (no concept of the question in the graph); null "
        "when the history fits and is sent as it is"
    )


class ConceptPublic(BaseModel):
    """A concept of the graph (`memory.recall.graph`)."""

    model_config = FROM_RECORD

    id: int
    name: str
    scope: str = Field(
        description="`user:NAME` (the conversation's OpenAI user) or `conversation:ID`"
    )
    frequency: int = Field(description="Segments it was found in")
    schematic: bool = Field(description="A core concept: frequency 5 or more")
    mentions: int = Field(default=0, description="Nodes of the conversation that mention it")


class EdgePublic(BaseModel):
    model_config = FROM_RECORD

    source: int
    target: int
    kind: Literal["co_occurs", "precedes"]
    weight: int


class GraphPublic(BaseModel):
    """The concepts a conversation mentions, the edges between them, its graph's version."""

    conversation: str
    scope: str
    version: int = Field(description="Raised by every consolidation (one per closed segment)")
    concepts: list[ConceptPublic]
    edges: list[EdgePublic]


class ConceptList(BaseModel):
    object: Literal["list"] = "list"
    query: str
    data: list[ConceptPublic]


# -- search and jobs -------------------------------------------------------------------------


class HitPublic(BaseModel):
    node_id: int
    conversation: str
    level: int
    seq: int
    span: tuple[int, int]
    role: str | None
    text: str
    score: float
    created_at: datetime


class SearchResults(BaseModel):
    object: Literal["list"] = "list"
    query: str
    data: list[HitPublic]


class JobPublic(BaseModel):
    model_config = FROM_RECORD

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
    depth: dict[str, int] = Field(description="Jobs per status, and `failures`")
    jobs: list[JobPublic]


class JobRetried(BaseModel):
    id: int
    queued: bool = Field(
        description="False if the job is running or done, or the same work is already queued"
    )
