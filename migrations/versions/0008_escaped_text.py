"""Messages stored escaped: `nodes.escaped` marks a message whose text Postgres could not hold.

An upstream answer may carry a NUL character or an unpaired surrogate, which Postgres's `text`
and `jsonb` refuse; such a message is stored with those characters escaped (`\\u0000`,
`\\ud800`) and marked, instead of being lost.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24 03:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "nodes",
        sa.Column("escaped", sa.Boolean(), nullable=False, server_default=sa.text("false")),
    )


def downgrade() -> None:
    op.drop_column("nodes", "escaped")
