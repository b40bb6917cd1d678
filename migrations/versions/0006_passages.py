"""Passages: a message's sentences, embedded on their own.

The passage leg of retrieval (`memory.passages`) ranks a message by its best-matching sentence;
passages are read by node id only, so they have no vector index. Messages embedded before this
revision have no passages and are ranked by their whole vector.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-21 12:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from pgvector.sqlalchemy import Vector

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DIM = 384  # memory.schema.EMBEDDING_DIM when this revision was written


def upgrade() -> None:
    op.create_table(
        "passages",
        sa.Column(
            "node_id",
            sa.BigInteger(),
            sa.ForeignKey("nodes.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("ordinal", sa.SmallInteger(), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.BigInteger(),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("embedding", Vector(_DIM), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("passages")
