"""Full text by conversation: lexeme statistics, and the GIN index keyed by conversation too.

The full-text leg of retrieval (`memory.recall.retrieval`) reads `lexemes`, how many messages of
each conversation hold each lexeme, to know before reading any node which of a query's words are
common in the searched conversations: it reads the nodes of the rarer words only, and scores the
common words on the nodes those found. The
counts are kept by the database itself, a statement-level trigger on `nodes` adding each
inserted message's distinct lexemes (messages are never updated or deleted one by one; a
conversation's counts go with it), so no write path can forget them and none pays a round trip
for them. System and developer messages are not counted: retrieval never returns them.
Existing messages are counted here.

The full-text GIN index becomes one on (conversation_id, tsv) (`btree_gin`, a contrib extension
every Postgres distribution ships; trusted, so a database owner may create it): a word is then
looked up within the searched conversations inside the index, where the index on `tsv` alone
gave every node of every tenant holding the word, each fetched from the heap to be filtered out.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25 04:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The rows of `nodes` inserted by one statement are counted in one upsert.
_COUNT = """
INSERT INTO lexemes (conversation_id, lexeme, tenant_id, messages)
SELECT n.conversation_id, l.lexeme, n.tenant_id, count(*)
FROM {source} n CROSS JOIN LATERAL unnest(tsvector_to_array(n.tsv)) AS l(lexeme)
WHERE n.level = 0 AND (n.role IS NULL OR n.role NOT IN ('system', 'developer'))
GROUP BY n.conversation_id, l.lexeme, n.tenant_id
ON CONFLICT (conversation_id, lexeme) DO UPDATE SET messages = lexemes.messages + excluded.messages
"""


def upgrade() -> None:
    op.execute("CREATE EXTENSION IF NOT EXISTS btree_gin")
    op.create_index(
        "ix_nodes_conversation_tsv",
        "nodes",
        ["conversation_id", "tsv"],
        postgresql_using="gin",
    )
    op.drop_index("ix_nodes_tsv", table_name="nodes", postgresql_using="gin")
    op.create_table(
        "lexemes",
        sa.Column(
            "conversation_id",
            sa.BigInteger(),
            sa.ForeignKey("conversations.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("lexeme", sa.Text(), primary_key=True),
        sa.Column(
            "tenant_id",
            sa.BigInteger(),
            sa.ForeignKey("tenants.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("messages", sa.Integer(), nullable=False),
    )
    op.execute(
        "CREATE FUNCTION count_lexemes() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        f"BEGIN\n{_COUNT.format(source='inserted_nodes')};\nRETURN NULL;\nEND\n$$"
    )
    op.execute(
        "CREATE TRIGGER nodes_count_lexemes AFTER INSERT ON nodes "
        "REFERENCING NEW TABLE AS inserted_nodes "
        "FOR EACH STATEMENT EXECUTE FUNCTION count_lexemes()"
    )
    op.execute(_COUNT.format(source="nodes"))


def downgrade() -> None:
    op.execute("DROP TRIGGER nodes_count_lexemes ON nodes")
    op.execute("DROP FUNCTION count_lexemes()")
    op.drop_table("lexemes")
    op.create_index("ix_nodes_tsv", "nodes", ["tsv"], postgresql_using="gin")
    op.drop_index("ix_nodes_conversation_tsv", table_name="nodes", postgresql_using="gin")
