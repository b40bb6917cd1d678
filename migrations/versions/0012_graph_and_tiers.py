"""The concept graph and the lifecycle tiers.

Concepts (`memory.build.graph`) are extracted when a segment closes and merged by meaning within
a tenant and scope (`memory.concepts.scope_key`: the conversation's OpenAI `user`, else the
conversation); edges link concepts that co-occur in a segment and topics that follow each
other; mentions link concepts to the messages and summaries that name them; a graph's version
counts its consolidations. `node_access` counts each node's accesses for its tier
(`memory.tiers`): a row only for nodes ever accessed, so that counting never rewrites `nodes`
(whose vector index would take a new entry for every row version). Graphs of conversations
summarized before this revision start empty and grow with their next segments.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-25 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from pgvector.sqlalchemy import Vector

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DIM = 384  # memory.schema.EMBEDDING_DIM when this revision was written


def _reference(name: str, table: str, *, primary_key: bool = False) -> sa.Column[int]:
    return sa.Column(
        name,
        sa.BigInteger(),
        sa.ForeignKey(f"{table}.id", ondelete="CASCADE"),
        nullable=False,
        primary_key=primary_key,
    )


def _tenant() -> sa.Column[int]:
    return _reference("tenant_id", "tenants")


def _now(name: str) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now())


def upgrade() -> None:
    op.create_table(
        "concepts",
        sa.Column("id", sa.BigInteger(), primary_key=True, autoincrement=True),
        _tenant(),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("embedding", Vector(_DIM)),
        sa.Column("frequency", sa.Integer(), nullable=False, server_default="1"),
        _now("created_at"),
        _now("updated_at"),
        sa.UniqueConstraint("tenant_id", "scope", "key", name="uq_concepts_tenant_scope_key"),
    )
    op.create_table(
        "concept_edges",
        _reference("source_id", "concepts", primary_key=True),
        _reference("target_id", "concepts", primary_key=True),
        sa.Column("kind", sa.Text(), primary_key=True),
        _tenant(),
        sa.Column("weight", sa.Integer(), nullable=False, server_default="1"),
    )
    op.create_index("ix_concept_edges_target", "concept_edges", ["target_id"])
    op.create_table(
        "concept_mentions",
        _reference("concept_id", "concepts", primary_key=True),
        _reference("node_id", "nodes", primary_key=True),
        _tenant(),
        _reference("conversation_id", "conversations"),
        sa.Column("weight", sa.SmallInteger(), nullable=False, server_default="1"),
    )
    op.create_index("ix_concept_mentions_node", "concept_mentions", ["node_id"])
    op.create_table(
        "concept_graphs",
        _tenant(),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False, server_default="0"),
        _now("updated_at"),
        sa.PrimaryKeyConstraint("tenant_id", "scope"),
    )
    op.create_table(
        "node_access",
        _reference("node_id", "nodes", primary_key=True),
        _tenant(),
        _reference("conversation_id", "conversations"),
        sa.Column("accesses", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("recent", sa.Integer(), nullable=False, server_default="0"),
        _now("window_start"),
        _now("last_access"),
        sa.Column("tier", sa.Text(), nullable=False, server_default="cold"),
    )
    op.create_index("ix_node_access_conversation_tier", "node_access", ["conversation_id", "tier"])
    op.create_index(
        "ix_node_access_sweep",
        "node_access",
        ["last_access"],
        postgresql_where=sa.text("tier <> 'cold'"),
    )


def downgrade() -> None:
    op.drop_table("node_access")
    op.drop_table("concept_graphs")
    op.drop_table("concept_mentions")
    op.drop_table("concept_edges")
    op.drop_table("concepts")
