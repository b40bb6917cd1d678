"""Per-conversation request statistics, and indexes for listing conversations and keys.

`requests`, `tokens_sent` and `tokens_full` count the answered chat requests of a conversation,
the prompt tokens sent upstream for them, and the tokens their whole histories would have cost
(the admin API's compression ratio is `tokens_full / tokens_sent`).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "conversations", sa.Column("requests", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column(
        "conversations",
        sa.Column("tokens_sent", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.add_column(
        "conversations",
        sa.Column("tokens_full", sa.BigInteger(), server_default="0", nullable=False),
    )
    op.create_index("ix_conversations_tenant_id", "conversations", ["tenant_id", "id"])
    op.create_index("ix_api_keys_tenant", "api_keys", ["tenant_id"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_tenant", table_name="api_keys")
    op.drop_index("ix_conversations_tenant_id", table_name="conversations")
    op.drop_column("conversations", "tokens_full")
    op.drop_column("conversations", "tokens_sent")
    op.drop_column("conversations", "requests")
