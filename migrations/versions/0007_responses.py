"""Responses: what a `POST /v1/responses` answered, so that `previous_response_id` can continue
its conversation and `GET /v1/responses/{id}` (and its input items) answer from what is stored.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-28 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column(
            "tenant_id",
            sa.BigInteger(),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("response_id", sa.Text(), primary_key=True),
        sa.Column(
            "conversation_id",
            sa.BigInteger(),
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("last_seq", sa.Integer(), nullable=False),
        sa.Column("head_hash", sa.Text()),
        sa.Column("body", JSONB(), nullable=False),
        sa.Column("input_items", JSONB(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_index("ix_responses_conversation", "responses", ["conversation_id"])


def downgrade() -> None:
    op.drop_index("ix_responses_conversation", table_name="responses")
    op.drop_table("responses")
