"""The full-text index keeps a small pending list (`gin_pending_list_limit` 128 kB, not 4 MB).

A GIN index takes new entries into an unsorted pending list and merges them into the index only
when the list passes `gin_pending_list_limit` (4 MB by default) or (auto)vacuum or analyze runs.
Every lookup reads the whole pending list, whatever conversation it searches: the full-text leg
of retrieval (`memory.recall.retrieval`) looks up each term it reads, so it read up to 4 MB
again per term. Measured on a database of 57,000 messages (the leg alone, mean of the eight
`bench.overhead` questions on a conversation of 10,000 varied messages): 5.2 ms with an empty
pending list, 11.6 ms after 7,500 messages were stored into other conversations (buffers
1,669 -> 3,072), and 5.4 ms with this limit after the same. A single message stored costs no
more (p95 2.2 ms against 2.6 over 1,500 turns: the merge of 128 kB is paid by one insert in
every few dozen); a bulk import of 6,000 messages took 1.0 s against 0.8 s. Turning the pending
list off (`fastupdate = off`) stored as fast but left the leg slower (7.4 ms).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-26 04:30:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER INDEX ix_nodes_conversation_tsv SET (gin_pending_list_limit = 128)")


def downgrade() -> None:
    op.execute("ALTER INDEX ix_nodes_conversation_tsv RESET (gin_pending_list_limit)")
