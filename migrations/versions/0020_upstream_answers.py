"""When the upstream last answered, and when each job last met it unavailable.

A job whose upstream request fails transiently (`ProviderUnavailable`: 5xx, timed out, ...) is
given back without spending an attempt, so that an outage of any length dead-letters nothing.
A request that the upstream fails *by itself* (a segment whose summary always gets a 500 or
always times out) was thus retried for ever, and held back every later job of its conversation.
A transient failure is now charged as an attempt when the upstream evidently answers: it
answered a request of the same endpoint after the job last met it unavailable
(`memory.build.upstream`). Both times are kept in the database, which every worker shares:

* `upstream_answers`: one row per endpoint (`chat`, `embeddings`), the last time a worker saw
  it answer;
* `jobs.upstream_failed_at`: when the job's last attempt ended on an unavailable upstream
  (NULL: never). Adding a nullable column rewrites nothing.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-30 10:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "upstream_answers",
        sa.Column("endpoint", sa.Text(), primary_key=True),
        sa.Column("answered_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.add_column("jobs", sa.Column("upstream_failed_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("jobs", "upstream_failed_at")
    op.drop_table("upstream_answers")
