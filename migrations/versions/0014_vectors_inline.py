"""Messages' vectors stored in their rows: `nodes.embedding` with storage MAIN, not pgvector's
EXTERNAL, and rows of up to ~4 kB kept whole (`toast_tuple_target` 4080, not ~2 kB).

A 384-dimension vector takes 1,544 bytes, and a message's row with its text, search vector,
chain hash and metadata passes ~2 kB, past which Postgres moves values out of line to the
TOAST table. pgvector's EXTERNAL storage made the vector the value moved: in a database of
10,000- and 1,000-message conversations of varied text (`bench.vectors`), 8,796 of its 12,779
vectors were out of line, and every distance the vector legs computed over such a row cost a
TOAST lookup. Storage MAIN alone keeps the vector in but moves the row's text values out
instead (the search vectors of 8,420 of 15,059 nodes), which the full-text leg then reads from
the TOAST table. With both changes, nothing of a typical message's row leaves it; a larger row
moves its text out first (compressible) and its vector last.

`bench.vectors` measures each leg over that database rewritten (`VACUUM FULL`) either way:
results, docs/benchmarks.md, "Vectors in their rows".

Rows written before this revision stay as they are until rewritten (`VACUUM FULL nodes`, which
locks the table while it runs: 2.4 s for 16,000 nodes here); a row written from now on (a new
message, the worker's embedding of it) is stored the new way.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 08:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE nodes ALTER COLUMN embedding SET STORAGE MAIN")
    op.execute("ALTER TABLE nodes SET (toast_tuple_target = 4080)")


def downgrade() -> None:
    op.execute("ALTER TABLE nodes RESET (toast_tuple_target)")
    op.execute("ALTER TABLE nodes ALTER COLUMN embedding SET STORAGE EXTERNAL")
