"""The admin API's request and response bodies: one family per entity, named by role.

`…Public` is what an answer shows, `…Create` what a request sends. Times are ISO 8601 with a
time zone. A key's secret appears only in `KeyCreated`, the answer that creates it.
"""

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from memory.write.identity import CONVERSATION_ID_MAX, CONVERSATION_ID_PATTERN

# Not dots alone: `.` and `..` name folders in paths and URLs.
TENANT_PATTERN = r"^[A-Za-z0-9._-]*[A-Za-z0-9_-][A-Za-z0-9._-]*$"
TENANT_MAX = 64
CONVERSATION_PATTERN = CONVERSATION_ID_PATTERN
CONVERSATION_MAX = CONVERSATION_ID_MAX
# Text Postgres can hold: no NUL characters.
TEXT_PATTERN = r"^[^\x00]*$"
MAX_ID = 2**63 - 1
# Answers built straight from the store's records (`Model.model_validate(record)`).
FROM_RECORD = ConfigDict(from_attributes=True)


# -- tenants and keys ------------------------------------------------------------------------


class TenantCreate(BaseModel):
    name: str = Field(
        pattern=TENANT_PATTERN,
        max_length=TENANT_MAX,
        description="1-64 characters of A-Za-z0-9._-, not dots alone",
    )


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
    tokens_reused: int = Field(
        description="Prompt tokens sent that repeated the previous prompt's prefix"
    )
    tokens_cached: int = Field(
        description="Prompt tokens the upstream reported as cached (prompt_tokens_details)"
    )
    upstream_prompt_tokens: int = Field(description="Prompt tokens the upstream reported")
    upstream_completion_tokens: int = Field(description="Completion tokens the upstream reported")
    memory_reuse: float | None = Field(
        description="tokens_reused / tokens_sent: the share of the prompts that repeated the "
        "previous prompt's prefix (null before the first answered request)"
    )
    compactions: int = Field(description="Turns whose working context was compacted")
    created_at: datetime
    last_activity: datetime
    pending_jobs: dict[str, int] = Field(description="Jobs not done yet, by status")


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
    working_context: dict[str, int] | None = Field(
        description="The working context (null while the conversation fits its budget): "
        "version, compactions, verbatim_from, stable_messages, notes, tokens"
    )


class ConversationDeleted(BaseModel):
    conversation: str
    deleted: Literal[True] = True
    messages: int
    summaries: int
    jobs: int


_SYSTEM_PROMPT = (
    "A system prompt that a request sending only new messages replaced the conversation's "
    "with: kept, but never a turn of the history"
)


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
    escaped: bool = Field(
        default=False,
        description="Text Postgres cannot hold (NUL, unpaired surrogates) was stored escaped",
    )
    follows_seq: int = Field(
        description="The message this one follows in its branch (-1: the conversation's root); "
        "not the one just before it where a branch starts"
    )
    superseded_at: datetime | None = Field(
        description="When the message left the current branch (an edit or a regenerated "
        "answer branched off before it); null: it is on the current branch"
    )
    model: str | None = Field(
        description="The model whose reply the gateway recorded; null: the client sent it"
    )
    system_prompt: bool = Field(default=False, description=_SYSTEM_PROMPT)


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
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    follows_seq: int | None = Field(
        default=None,
        description="A message where a branch starts: the message it follows (-1: the root)",
    )
    superseded_at: datetime | None = Field(
        default=None, description="When a message left the current branch; null: it is on it"
    )
    system_prompt: bool = Field(default=False, description=_SYSTEM_PROMPT)
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


class NodePathPublic(BaseModel):
    conversation: str
    path: list[NodePublic] = Field(
        description="The summaries above the node, the root first, then the node"
    )


class BranchRunPublic(BaseModel):
    """Consecutive stored messages on one branch: `first_seq` follows `follows_seq` (-1: the
    root), each later one the one before it."""

    model_config = FROM_RECORD

    first_seq: int
    last_seq: int
    follows_seq: int
    superseded: bool


class HierarchyPublic(BaseModel):
    conversation: str
    levels: dict[str, int]
    nodes: list[NodePublic]
    branches: list[BranchRunPublic] = Field(
        description="The messages (level 0) as runs on one branch each, in seq order: one run "
        "when the conversation never branched"
    )


class TreePagePublic(BaseModel):
    """Consecutive siblings of the summary tree, in time order."""

    conversation: str
    parent: int | None = Field(description="Their parent; null: the roots")
    nodes: list[NodePublic]
    more_before: bool = Field(
        description="Earlier siblings exist: pass `before` = the first's span start"
    )
    more_after: bool = Field(
        description="Later siblings exist: pass `after` = the last's span start"
    )


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


class ContextPart(BaseModel):
    """A run of the prompt's messages of one kind."""

    label: Literal["system", "stable", "verbatim", "note", "new", "history", "memory"] = Field(
        description="system: the client's system prompt; stable: stable memory (summaries "
        "of what was compacted, milestones); verbatim: the turns since the compaction point "
        "(the recent turns, in a prompt rebuilt per query); note: this turn's recall note; "
        "new: the new message; history: a conversation that fits, as stored; memory: the "
        "memory message of a prompt rebuilt per query (`MEMSTRATA_CONTEXT_MODE=rebuild`)"
    )
    start: int = Field(description="Index of its first message in `messages`")
    messages: int
    tokens: int


class LegRankPublic(BaseModel):
    model_config = FROM_RECORD

    leg: str = Field(
        description="`full text`, `vector` or `passages`; `prepared`: the candidates prepared "
        "after the last reply (anticipatory recall), by similarity"
    )
    rank: int = Field(description="Its place in that leg's candidates, 1: the best")
    similarity: float | None = Field(description="Cosine similarity to the query (vector legs)")


class RecalledPublic(BaseModel):
    """Why a message the recall note (or the memory message) quotes was picked."""

    model_config = FROM_RECORD

    node_id: int
    level: int
    seq: int
    rank: int = Field(description="Its place among every candidate once fused, 1: the best")
    score: float
    legs: list[LegRankPublic] = Field(description="The retrieval legs that found it")
    exact: bool = Field(description="It holds a rare identifier of the query")
    standout: bool = Field(description="Its similarity stands far above the rest of its leg")
    lent: bool = Field(description="No leg found it: a neighbour lent it part of its score")
    pinned: bool = Field(description="A milestone, in every prompt whatever the query")


class ContextPublic(BaseModel):
    conversation: str
    tokens: int = Field(description="The prompt's tokens: its parts' and the reply priming")
    messages: list[dict[str, Any]]
    parts: list[ContextPart] = Field(description="The messages, in runs of one kind")
    reused_tokens: int = Field(description="Tokens that repeat the previous prompt's prefix")
    reuse: float = Field(description="reused_tokens / tokens")
    working_context: bool = Field(description="Whether it comes from the working context")
    compacted: bool = Field(description="Whether the working context would be compacted")
    prepared_recall: bool = Field(
        description="Whether the note would come from the candidates prepared after the last "
        "reply (anticipatory recall)"
    )
    recalled: list[RecalledPublic] = Field(
        description="Why each message the recall note (or, rebuilt per query, the memory "
        "message) quotes was picked, best rank first"
    )


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
    conversation: str | None = Field(default=None, description="The conversation's id, if any")
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
