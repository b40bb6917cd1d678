"""Chain hashes looked up within a conversation by an index of their own, and the messages
table analyzed after every 1% (at least 2,000) of its rows changed.

Identifying a turn looks up the request's chain hashes among the conversation's messages
(`memory.write.identity._path`, on every request whose history does not hold the head: a client
that sends only its new messages, an edit, a regenerate) and again when the reply is recorded.
Two things made that lookup slow:

* Statistics that predate a conversation's growth. Right after 10,000 messages were imported
  the planner took the conversation for a few rows and read all of them through its
  (conversation, level, seq) index: 4.8 ms warm, 31.8-71.9 ms cold, on every request, until
  an analyze. Autovacuum analyzes a table after 10% of its rows change: at a million messages,
  a hundred thousand stored anywhere. Now after 1% (at least 2,000); an analyze samples a
  bounded number of rows, whatever the table's size.
* The tenant's chain index (tenant_id, chain_hash): the opening system prompt's hash is the
  same in every conversation that opens with it. With 5,000 such conversations and fresh
  statistics the lookup took 1.3-2.5 ms (a bitmap of two other indexes); with this index,
  0.06 ms.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-26 06:20:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_nodes_conversation_chain",
        "nodes",
        ["conversation_id", "chain_hash"],
        postgresql_where=sa.text("level = 0"),
    )
    op.execute(
        "ALTER TABLE nodes SET (autovacuum_analyze_scale_factor = 0.01, "
        "autovacuum_analyze_threshold = 2000)"
    )


def downgrade() -> None:
    op.execute(
        "ALTER TABLE nodes RESET (autovacuum_analyze_scale_factor, autovacuum_analyze_threshold)"
    )
    op.drop_index("ix_nodes_conversation_chain", table_name="nodes")
