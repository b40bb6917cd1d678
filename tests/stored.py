"""Test helpers: conversations stored and built by the real tree builder, and a deterministic
embedder (a vector of its own per text, from `devkit.upstream_script.embedding_vector`)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from devkit.upstream_script import embedding_vector
from memory.build import tree
from memory.write import store

MODEL = "gpt-4o-mini"


class HashEmbedder:
    """A unit vector per text, the same every time; unrelated texts are nearly orthogonal."""

    name = "hash"
    dim = 384

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [embedding_vector(text, self.dim) for text in texts]


async def built_conversation(
    engine: AsyncEngine,
    tenant_id: int,
    texts: Sequence[str],
    *,
    config: tree.TreeConfig,
    user: str | None = None,
    replies: bool = True,
) -> tuple[int, str, list[int]]:
    """A new conversation of `texts` (user and assistant in turn, or all the user's without
    `replies`), a minute apart, its summary tree built to the end (`final=True`): its id,
    external id and message node ids."""
    external_id = f"built-{uuid.uuid4().hex[:12]}"
    start = datetime(2025, 3, 1, 9, tzinfo=UTC)
    async with engine.begin() as conn:
        ref, _ = await store.open_conversation(
            conn, tenant_id=tenant_id, external_id=external_id, user=user
        )
        appended = await store.append(
            conn,
            tenant_id=tenant_id,
            conversation_id=ref.id,
            messages=[
                {"role": "assistant" if replies and i % 2 else "user", "content": body}
                for i, body in enumerate(texts)
            ],
            model=MODEL,
            created_at=[start + timedelta(minutes=i) for i in range(len(texts))],
        )
    await tree.build(engine, tenant_id=tenant_id, conversation_id=ref.id, config=config, final=True)
    return ref.id, external_id, appended.node_ids
