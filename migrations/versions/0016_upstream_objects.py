"""The upstream's objects and the tenant that made each (`memory.write.upstream_objects`).

With authentication on, one upstream key serves every tenant, so the upstream's files, batches
and vector stores are one pool; this table keeps each object to the tenant that created it
through the gateway. Objects made before it existed have no owner and reach no tenant.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 05:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "upstream_objects",
        sa.Column("object_id", sa.Text(), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.BigInteger(),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )
    op.create_index("ix_upstream_objects_tenant", "upstream_objects", ["tenant_id"])


def downgrade() -> None:
    op.drop_table("upstream_objects")
