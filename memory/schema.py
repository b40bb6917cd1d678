"""The tables of memstrata, as SQLAlchemy Core metadata; Alembic migrations create them.

One `nodes` table holds the whole hierarchy (SPEC §5): level 0 rows are messages, kept verbatim
forever; level 1 rows summarize segments of consecutive messages; level k+1 rows summarize runs
of level-k rows. Every node knows the span of message sequence numbers it covers and its parent,
so any summary can be expanded down to the messages under it. `jobs` is the durable queue of
background work. Tenants own everything, and every table that holds tenant data carries
`tenant_id` so that each query can be scoped without a join.
"""

from typing import Final

from pgvector.sqlalchemy import Vector
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TSVECTOR

EMBEDDING_DIM: Final = 384
"""Width of `nodes.embedding`; every embedder must produce vectors of this size."""

DEFAULT_TENANT: Final = "default"
"""The tenant that owns everything while `MEMSTRATA_AUTH=off`."""

OUTPUT_IDS: Final = "(jsonb_path_query_array(body, '$.output[*].id'))"
"""The ids of a stored response's output items, as `responses`' index on them reads them."""

metadata = MetaData()


def _created_at() -> Column[object]:
    return Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now())


tenants = Table(
    "tenants",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("name", Text, nullable=False, unique=True),
    _created_at(),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("name", Text, nullable=False, server_default=""),
    Column("prefix", Text, nullable=False),
    Column("key_hash", Text, nullable=False, unique=True),
    _created_at(),
    Column("revoked_at", DateTime(timezone=True)),
    Index("ix_api_keys_tenant", "tenant_id"),
)

conversations = Table(
    "conversations",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("external_id", Text, nullable=False),
    Column("user_id", Text),
    # Chain hash and seq of the current branch's last message (`memory.write.identity`): an
    # incoming history that contains the hash extends the branch (head_seq: migration 0009).
    Column("head_hash", Text),
    Column("head_seq", Integer),
    Column("next_seq", Integer, nullable=False, server_default="0"),
    Column("token_count", BigInteger, nullable=False, server_default="0"),
    # Answered chat requests, the prompt tokens sent upstream for them, and the tokens their
    # whole histories would have cost (migration 0002).
    Column("requests", Integer, nullable=False, server_default="0"),
    Column("tokens_sent", BigInteger, nullable=False, server_default="0"),
    Column("tokens_full", BigInteger, nullable=False, server_default="0"),
    # `chains.content_hash` of the newest stored system or developer message (migration 0005).
    Column("system_hash", Text),
    # What the upstream reported for those requests (summed over hidden tool rounds), the prompt
    # tokens that repeated the previous prompt's prefix, and that prompt's fingerprint
    # (`memory.recall.reuse`; migration 0010).
    Column("usage_prompt_tokens", BigInteger, nullable=False, server_default="0"),
    Column("usage_cached_tokens", BigInteger, nullable=False, server_default="0"),
    Column("usage_completion_tokens", BigInteger, nullable=False, server_default="0"),
    Column("tokens_reused", BigInteger, nullable=False, server_default="0"),
    Column("prompt_fingerprint", JSONB),
    _created_at(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("tenant_id", "external_id", name="uq_conversations_tenant_external"),
    Index("ix_conversations_head", "tenant_id", "head_hash"),
    Index("ix_conversations_recent", "tenant_id", "updated_at"),
    Index("ix_conversations_tenant_id", "tenant_id", "id"),
)

nodes = Table(
    "nodes",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column(
        "conversation_id",
        BigInteger,
        ForeignKey("conversations.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("level", SmallInteger, nullable=False),
    # Level 0: the message's sequence number. Level k: the node's ordinal among level-k nodes.
    Column("seq", Integer, nullable=False),
    Column("span_start", Integer, nullable=False),
    Column("span_end", Integer, nullable=False),
    Column("parent_id", BigInteger, ForeignKey("nodes.id", ondelete="SET NULL")),
    # Messages: the OpenAI message as received, split into the fields we query on.
    Column("role", Text),
    Column("name", Text),
    Column("content", JSONB),
    Column("tool_calls", JSONB),
    Column("tool_call_id", Text),
    Column("chain_hash", Text),
    # Messages (migration 0009): when the message left the conversation's current branch (an
    # edit or a regenerated answer branched off before it; NULL: it is on the branch); the seq
    # of the message it follows when that is not the one stored just before it (-1: the
    # root); the request that brought it (`retries.RequestKey`), for telling retries.
    Column("superseded_at", DateTime(timezone=True)),
    Column("follows_seq", Integer),
    Column("request_key", Text),
    # Plain text of the node (message text, or a summary's narrative): what is searched.
    Column("text", Text, nullable=False, server_default=""),
    Column("facts", JSONB),
    Column("method", Text),
    # Summaries: the model that wrote them; messages: the model whose reply the gateway
    # recorded (NULL for what the client sent).
    Column("model", Text),
    Column("token_count", Integer, nullable=False, server_default="0"),
    # Stored in the row (storage MAIN, migration 0014): out of line, as pgvector stores it by
    # default once a row passes ~2 kB, each distance computed cost a TOAST lookup.
    Column("embedding", Vector(EMBEDDING_DIM)),
    # Filled by a row trigger from the text's first 100,000 characters (migration 0019):
    # Postgres refuses a tsvector over 1 MB, which a long text of distinct words makes.
    Column("tsv", TSVECTOR),
    Column("importance", Float, nullable=False, server_default="0"),
    Column("pinned", Boolean, nullable=False, server_default=text("false")),
    # 'complete', or 'incomplete' for a reply whose upstream stream was cut.
    Column("status", Text, nullable=False, server_default="complete"),
    # True when text Postgres cannot hold (NUL, unpaired surrogates) was stored escaped.
    Column("escaped", Boolean, nullable=False, server_default=text("false")),
    # Messages (migration 0017): a system prompt a request sending only new messages led with,
    # in place of the conversation's (`memory.write.system_prompts`): kept, never a turn.
    Column("system_prompt", Boolean, nullable=False, server_default=text("false")),
    Column("meta", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _created_at(),
    UniqueConstraint("conversation_id", "level", "seq", name="uq_nodes_conversation_level_seq"),
    Index("ix_nodes_tenant_level", "tenant_id", "level"),
    Index("ix_nodes_parent", "parent_id"),
    # Full text within conversations (`btree_gin`, migration 0011): a word's nodes of the
    # searched conversations only, where an index on `tsv` alone yields every tenant's. Its
    # pending list is kept small (migration 0012): every lookup reads all of it.
    Index(
        "ix_nodes_conversation_tsv",
        "conversation_id",
        "tsv",
        postgresql_using="gin",
        postgresql_with={"gin_pending_list_limit": 128},
    ),
    Index(
        "ix_nodes_embedding",
        "embedding",
        postgresql_using="hnsw",
        postgresql_ops={"embedding": "vector_cosine_ops"},
    ),
    # The pinned milestones the prompt builder reads on every rebuilt prompt (a few per
    # thousand messages: without it that read scans the table).
    Index(
        "ix_nodes_pinned",
        "conversation_id",
        "seq",
        postgresql_where=text("pinned AND level = 0"),
    ),
    # A conversation's replaced system prompts (migration 0017), which a turn without its own
    # looks up: a few entries, where the conversation's index would read every message.
    Index(
        "ix_nodes_system_prompts",
        "conversation_id",
        "seq",
        postgresql_where=text("system_prompt AND level = 0"),
    ),
    # Finding where an incoming history leaves a stored one, and the request of a retry.
    Index("ix_nodes_chain", "tenant_id", "chain_hash", postgresql_where=text("level = 0")),
    # The same within one conversation (migration 0013): the opening system prompt's hash is
    # every conversation's that opens with it, so the tenant's index reads one entry per such
    # conversation.
    Index(
        "ix_nodes_conversation_chain",
        "conversation_id",
        "chain_hash",
        postgresql_where=text("level = 0"),
    ),
    Index(
        "ix_nodes_request",
        "conversation_id",
        "request_key",
        postgresql_where=text("request_key IS NOT NULL"),
    ),
    Index(
        "ix_nodes_unembedded",
        "conversation_id",
        "id",
        postgresql_where=text("embedding IS NULL"),
    ),
    # Statistics kept fresh (migration 0013): a conversation that grew since the last analyze
    # is taken for a few rows, and its lookups scan all of it. Rows of up to ~4 kB stored whole
    # (migration 0014): a message's row with its vector passes the default ~2 kB.
    postgresql_with={
        "autovacuum_analyze_scale_factor": 0.01,
        "autovacuum_analyze_threshold": 2000,
        "toast_tuple_target": 4080,
    },
)

passages = Table(
    "passages",
    metadata,
    # A message's sentences, embedded on their own (`memory.build.passages`): one sentence of a long
    # message is found by meaning where the whole message's vector, an average, is not. Read by
    # node id only (retrieval scores the passages of messages it already holds), so no vector
    # index: one took 45% of the background build's database time.
    Column("node_id", BigInteger, ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True),
    Column("ordinal", SmallInteger, primary_key=True),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("embedding", Vector(EMBEDDING_DIM), nullable=False),
)

lexemes = Table(
    "lexemes",
    metadata,
    # How many messages of a conversation hold a full-text lexeme (migration 0011): the
    # full-text leg of retrieval reads only the nodes of a query's rarer words and scores its
    # common ones on what those found. Kept by the database: a statement-level trigger on
    # `nodes` counts every inserted message that retrieval may return (not system prompts).
    Column(
        "conversation_id",
        BigInteger,
        ForeignKey("conversations.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("lexeme", Text, primary_key=True),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    Column("messages", Integer, nullable=False),
)

responses = Table(
    "responses",
    metadata,
    # A Responses API answer (`memory.write.responses`): the conversation it continued, where it
    # ended (the seq of its last stored message, the conversation's head hash after it), the
    # response object as the client saw it and the input items of its request (migration 0007).
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True),
    Column("response_id", Text, primary_key=True),
    Column(
        "conversation_id",
        BigInteger,
        ForeignKey("conversations.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("last_seq", Integer, nullable=False),
    Column("head_hash", Text),
    Column("body", JSONB, nullable=False),
    Column("input_items", JSONB, nullable=False),
    _created_at(),
    Index("ix_responses_conversation", "conversation_id"),
    # The ids of each response's output items, for the `item_reference`s that resend them
    # (`memory.write.responses.output_items`, migration 0018; `btree_gin` for the tenant).
    Index(
        "ix_responses_output_ids",
        "tenant_id",
        text(OUTPUT_IDS),
        postgresql_using="gin",
    ),
)

upstream_objects = Table(
    "upstream_objects",
    metadata,
    # An object the upstream keeps (a file, a batch, a vector store, ...) and the tenant that
    # made it through the gateway: with authentication on, only that tenant reaches it
    # (`gateway.openai.tenancy`, migration 0016). Upstream ids are unique, so one owner each.
    Column("object_id", Text, primary_key=True),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    _created_at(),
    Index("ix_upstream_objects_tenant", "tenant_id"),
)

working_contexts = Table(
    "working_contexts",
    metadata,
    # The stable part of the last prompt sent for a conversation that no longer fits its budget
    # (`memory.recall.working_context`; migration 0010): every `serve` process renders the same
    # prefix from it. Updated under the conversation's row lock.
    Column(
        "conversation_id",
        BigInteger,
        ForeignKey("conversations.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
    # Bumped whenever the prefix is rebuilt (a compaction, a branch); `compactions` counts those
    # that compacted.
    Column("version", Integer, nullable=False, server_default="1"),
    Column("compactions", Integer, nullable=False, server_default="0"),
    # The model and prompt budget of the last turn, the tokens of its context (stable memory,
    # verbatim turns and kept notes) and of the client's system prompt.
    Column("model", Text, nullable=False),
    Column("budget", Integer, nullable=False),
    Column("tokens", Integer, nullable=False, server_default="0"),
    Column("system_tokens", Integer, nullable=False, server_default="0"),
    # Stable-memory messages: [{"text", "start", "end", "tokens"}], one per compaction since the
    # last consolidation, each summarizing messages start..end-1.
    Column("stable", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    # Messages from `verbatim_from` on are sent verbatim; large tool results before
    # `mask_before` as one-line placeholders.
    Column("verbatim_from", Integer, nullable=False),
    Column("mask_before", Integer, nullable=False),
    # Recall notes kept since the last compaction: [{"before", "text", "ids"}].
    Column("notes", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    # The conversation's next_seq when the context was last advanced.
    Column("upto", Integer, nullable=False),
    # A compaction prepared in the background for `version`.
    Column("prepared", JSONB),
    # Recall prepared after the reply at seq `recall_after`: the exchange's vector and the
    # candidates retrieved for it (`memory.recall.anticipation`).
    Column("recall_after", Integer),
    Column("recall_vector", Vector(EMBEDDING_DIM)),
    Column("recall_ids", ARRAY(BigInteger)),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("tenant_id", BigInteger, ForeignKey("tenants.id", ondelete="CASCADE")),
    Column("conversation_id", BigInteger, ForeignKey("conversations.id", ondelete="CASCADE")),
    Column("kind", Text, nullable=False),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # At most one queued job per key: enqueueing the same work twice is a no-op.
    Column("dedupe_key", Text),
    # queued → running → done, or back to queued with a later run_after, or dead.
    Column("status", Text, nullable=False, server_default="queued"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("max_attempts", Integer, nullable=False, server_default="5"),
    Column("run_after", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("locked_by", Text),
    Column("lease_until", DateTime(timezone=True)),
    Column("last_error", Text),
    _created_at(),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("finished_at", DateTime(timezone=True)),
    # When the job's last attempt ended on an unavailable upstream (`memory.build.upstream`,
    # migration 0020); NULL if none has.
    Column("upstream_failed_at", DateTime(timezone=True)),
    Index(
        "uq_jobs_queued_dedupe",
        "dedupe_key",
        unique=True,
        postgresql_where=text("status = 'queued'"),
    ),
    Index("ix_jobs_claim", "run_after", "id", postgresql_where=text("status = 'queued'")),
    Index("ix_jobs_running", "conversation_id", postgresql_where=text("status = 'running'")),
    Index(
        "ix_jobs_queued_conversation",
        "conversation_id",
        "id",
        postgresql_where=text("status = 'queued'"),
    ),
    Index("ix_jobs_status", "status"),
)

upstream_answers = Table(
    "upstream_answers",
    metadata,
    # The last time a worker saw the upstream answer a request of `endpoint` (`chat`,
    # `embeddings`): evidence, for every worker, that a job it fails is failed by itself
    # (`memory.build.upstream`, migration 0020).
    Column("endpoint", Text, primary_key=True),
    Column("answered_at", DateTime(timezone=True), nullable=False),
)
