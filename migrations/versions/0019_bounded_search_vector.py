"""A message's search vector holds the first `INDEXED_CHARS` characters of its text.

Postgres refuses a `tsvector` over 1 MB ("string is too long for tsvector"), and the vector was
a column generated from the whole text: a message of ~1 MB of distinct words (a pasted log, a
tool's JSON dump, a base64 blob sent as text, all within the 8 MB body a request may carry)
could not be stored, and the request failed with a 500. The vector now comes from the text's
first 100,000 characters, which no text can take past the limit: the densest measured (distinct
two-character CJK words) makes 467 kB of vector. The text itself, the verbatim content, the
embeddings and `memory_grep` still see the whole message; only full-text search stops there.

Dropping the expression keeps the column and its values, with no rewrite of the table or its
indexes (a changed generated expression would rewrite both, the vector index included); a row
trigger fills the vector from then on, so no write path can forget it, and it runs before the
statement trigger that counts each message's lexemes (migration 0011). Measured on embedded
Postgres 18 (two runs each): a statement inserting 20,000 messages took 2.29 s on average before
and 2.49 s after (+9 %); one message stored alone, p50 1.66 ms before and 1.47 ms after (the
same, within noise).

The downgrade generates the column from the whole text again, rewriting the table: it fails on
a message stored since whose whole text makes too large a vector.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-29 04:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import TSVECTOR

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXED_CHARS = 100_000


def upgrade() -> None:
    op.execute("ALTER TABLE nodes ALTER COLUMN tsv DROP EXPRESSION")
    op.execute(
        "CREATE FUNCTION index_node_text() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        f"BEGIN\nNEW.tsv := to_tsvector('english', left(NEW.text, {INDEXED_CHARS}));\n"
        "RETURN NEW;\nEND\n$$"
    )
    op.execute(
        "CREATE TRIGGER nodes_index_text BEFORE INSERT OR UPDATE OF text ON nodes "
        "FOR EACH ROW EXECUTE FUNCTION index_node_text()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER nodes_index_text ON nodes")
    op.execute("DROP FUNCTION index_node_text()")
    op.drop_column("nodes", "tsv")  # and its index
    op.add_column(
        "nodes",
        sa.Column("tsv", TSVECTOR(), sa.Computed("to_tsvector('english', text)", persisted=True)),
    )
    op.create_index(
        "ix_nodes_conversation_tsv",
        "nodes",
        ["conversation_id", "tsv"],
        postgresql_using="gin",
        postgresql_with={"gin_pending_list_limit": 128},
    )
