"""The fingerprint of each conversation's newest system prompt, kept on its row.

A client that sends only its new turns usually repeats its system prompt; the request path
recognises it by `conversations.system_hash` instead of looking the prompt up among the
conversation's messages. Existing conversations get theirs computed here, with the formula of
`memory.identity.content_hash` (copied: a migration must not change when that module does).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-21 09:00:00.000000
"""

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH = 1000


def _content_hash(content: Any) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def upgrade() -> None:
    op.add_column("conversations", sa.Column("system_hash", sa.Text(), nullable=True))
    bind = op.get_bind()
    rows = bind.execute(
        sa.text(
            "SELECT DISTINCT ON (conversation_id) conversation_id, content FROM nodes "
            "WHERE level = 0 AND role IN ('system', 'developer') "
            "ORDER BY conversation_id, seq DESC"
        ).columns(conversation_id=sa.BigInteger(), content=postgresql.JSONB())
    ).all()
    update = sa.text("UPDATE conversations SET system_hash = :hash WHERE id = :id")
    for start in range(0, len(rows), _BATCH):
        batch = rows[start : start + _BATCH]
        bind.execute(
            update, [{"id": r.conversation_id, "hash": _content_hash(r.content)} for r in batch]
        )


def downgrade() -> None:
    op.drop_column("conversations", "system_hash")
