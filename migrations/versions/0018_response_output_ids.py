"""An index on the ids of each stored response's output items.

The Vercel AI SDK's Responses provider (with `store` on, its default) sends an earlier reply
back as an `item_reference` to the output item the gateway answered; the gateway reads the item
from the stored response (`memory.write.responses.output_items`), found by its id through this
index (`btree_gin`, created by 0011, for the tenant's column).

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28 14:30:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        "CREATE INDEX ix_responses_output_ids ON responses "
        "USING gin (tenant_id, (jsonb_path_query_array(body, '$.output[*].id')))"
    )


def downgrade() -> None:
    op.execute("DROP INDEX ix_responses_output_ids")
