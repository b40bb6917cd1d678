"""Messages that are a conversation's system prompt changed, not a turn of its history
(`memory.write.system_prompts`).

A client that sends only its new messages, under a system prompt that changes (the time in it),
stored each new system prompt as a message within the history, and every prompt after it
carried all of them. Such a message is now marked: kept, but never a verbatim turn; the prompt
leads with the request's own system prompt, or with the latest one stored. Messages stored
before it are turns, as they were.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28 11:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A constant default: Postgres adds the column without rewriting the table.
    op.add_column(
        "nodes",
        sa.Column("system_prompt", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.create_index(
        "ix_nodes_system_prompts",
        "nodes",
        ["conversation_id", "seq"],
        postgresql_where=sa.text("system_prompt AND level = 0"),
    )


def downgrade() -> None:
    op.drop_index("ix_nodes_system_prompts", table_name="nodes")
    op.drop_column("nodes", "system_prompt")
