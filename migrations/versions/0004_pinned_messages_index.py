"""An index of each conversation's pinned messages (the prompt's milestones).

The prompt builder reads a conversation's newest pinned messages on every rebuilt prompt; they
are a few per thousand messages, so without this partial index that read scanned the table
(5 ms at 10,000 messages).

Revision ID: 0004
Revises: 0002
Create Date: 2026-11-21 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_nodes_pinned",
        "nodes",
        ["conversation_id", "seq"],
        postgresql_where=sa.text("pinned AND level = 0"),
    )


def downgrade() -> None:
    op.drop_index("ix_nodes_pinned", table_name="nodes")
