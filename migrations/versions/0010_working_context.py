"""The working context of each conversation, and what its prompts cost upstream.

`working_contexts` holds, per conversation that no longer fits its budget, the stable part of
the last prompt sent (`memory.recall.working_context`): the stable-memory messages (JSON, with
their text), the compaction point (`verbatim_from`: messages from there on are sent verbatim),
the point before which large tool results are masked, the recall notes kept since the last
compaction, a compaction prepared in the background (`prepared`) and the recall prepared for
the next turn (`recall_*`). New columns of `conversations` count what the upstream reported
(`usage_*`, cached tokens included), the prompt tokens that repeated the previous prompt's
prefix (`tokens_reused`), and keep that prompt's fingerprint.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-24 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from pgvector.sqlalchemy import Vector
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DIM = 384  # memory.schema.EMBEDDING_DIM when this revision was written
_USAGE = ("usage_prompt_tokens", "usage_cached_tokens", "usage_completion_tokens", "tokens_reused")


def upgrade() -> None:
    op.create_table(
        "working_contexts",
        sa.Column(
            "conversation_id",
            sa.BigInteger(),
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "tenant_id",
            sa.BigInteger(),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("version", sa.Integer(), nullable=False, server_default="1"),
        sa.Column("compactions", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("budget", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("system_tokens", sa.Integer(), nullable=False, server_default="0"),
        sa.Column(
            "stable", postgresql.JSONB(), nullable=False, server_default=sa.text("'[]'::jsonb")
        ),
        sa.Column("verbatim_from", sa.Integer(), nullable=False),
        sa.Column("mask_before", sa.Integer(), nullable=False),
        sa.Column(
            "notes", postgresql.JSONB(), nullable=False, server_default=sa.text("'[]'::jsonb")
        ),
        sa.Column("upto", sa.Integer(), nullable=False),
        sa.Column("prepared", postgresql.JSONB()),
        sa.Column("recall_after", sa.Integer()),
        sa.Column("recall_vector", Vector(_DIM)),
        sa.Column("recall_ids", postgresql.ARRAY(sa.BigInteger())),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    for column in _USAGE:
        op.add_column(
            "conversations",
            sa.Column(column, sa.BigInteger(), nullable=False, server_default="0"),
        )
    op.add_column("conversations", sa.Column("prompt_fingerprint", postgresql.JSONB()))


def downgrade() -> None:
    op.drop_column("conversations", "prompt_fingerprint")
    for column in reversed(_USAGE):
        op.drop_column("conversations", column)
    op.drop_table("working_contexts")
