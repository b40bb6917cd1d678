"""The concept graph, consolidated when a segment closes (SPEC §5, seed F3).

`memory.build.tree` calls `prepare()` for a batch of closed segments once they are summarized
(outside any transaction: it may embed), then `consolidate()` in the transaction that inserts
their summaries, so a segment is consolidated exactly once, with its summary, and a build
interrupted anywhere redoes both or neither.

* **Concepts of a segment** (`extract`), at most `GraphConfig.per_segment`, ranked:
  - the summary's key facts: names and identifiers, and dates that hold a digit (relative
    ones, "yesterday", name no concept). Written by the upstream LLM when it wrote the summary,
    by the regular expressions of `memory.build.facts` otherwise;
  - topics: the LLM's own (`Summary.topics`) when it gave some; otherwise, offline, the
    messages' phrases (`memory.concepts.phrases`: runs of content words) found twice or more,
    or of two words or more.
* **Merging**: a concept whose key the scope already holds is that concept; a new key is
  embedded (the embedder of messages) and merges into the scope's nearest concept when their
  cosine similarity is at least `GraphConfig.merge_similarity`, else it is a new concept. The
  concept's frequency counts the segments it was found in; from `memory.concepts.SCHEMATIC` it
  is schematic.
* **Edges**: `co_occurs` between every two of a segment's first `CO_OCCURRING` concepts
  (stored once, source < target, weight = segments shared); `precedes` from each of a
  segment's `TOPICS` most mentioned concepts to the next segment's (weight = times seen).
* **Mentions**: each message that names a concept (its key, as words, case and possessives
  aside), with the count, and the segment's summary, which mentions all its concepts.
* **Version**: each consolidated segment raises its scope's graph version by one.
* **Backfill** (`backfill`): the segments of a conversation summarized before it had a graph
  (before migration 0012, or with `MEMSTRATA_GRAPH=off`), consolidated the same way.

Consolidations of one scope are serialized by a transaction-level advisory lock (two
conversations of one user may build at once). Everything is keyed by tenant.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory.build.facts import string_list
from memory.build.summarize import Summary
from memory.concepts import concept_key, phrases, scope_key
from memory.db import transaction
from memory.embeddings import Embedder, vector_literal
from memory.schema import concepts, conversations

__all__ = [
    "CO_OCCURRING",
    "TOPICS",
    "Found",
    "GraphConfig",
    "Prepared",
    "backfill",
    "consolidate",
    "extract",
    "prepare",
]

CO_OCCURRING: Final = 8
"""A segment's first concepts linked to each other: 28 edges at most per segment."""

TOPICS: Final = 3
"""A segment's most mentioned concepts, linked by `precedes` to the next segment's."""

_CACHED_VECTORS: Final = 4096
_DIGIT = re.compile(r"\d")
_POSSESSIVE = re.compile(r"['\u2019]s\b")
_SPACES = re.compile(r"\s+")


@dataclass
class GraphConfig:
    """How concepts are extracted and merged; one per worker (it caches concept vectors)."""

    embedder: Embedder
    merge_similarity: float = 0.85
    per_segment: int = 12
    _vectors: dict[str, list[float]] = field(default_factory=dict, repr=False)

    async def vectors(self, keys: Sequence[str]) -> dict[str, list[float]]:
        """The vectors of concept keys, embedded once per process (a key merged into another
        concept is met again, and would be embedded again)."""
        missing = [key for key in dict.fromkeys(keys) if key not in self._vectors]
        if missing:
            if len(self._vectors) + len(missing) > _CACHED_VECTORS:
                self._vectors.clear()
            embedded = await self.embedder.embed(missing)
            self._vectors.update(zip(missing, embedded, strict=True))
        return {key: self._vectors[key] for key in keys}


@dataclass(frozen=True)
class Found:
    """A concept of one segment: its key, the name it is shown by, its rank score."""

    key: str
    name: str
    score: float


@dataclass(frozen=True)
class _Segment:
    found: list[Found]
    # Per message (node id), the concepts it names with their counts.
    mentions: dict[int, Counter[str]]


@dataclass(frozen=True)
class Prepared:
    """A batch of segments ready to consolidate: their concepts, and the vectors of the keys
    their scope did not hold when prepared."""

    tenant_id: int
    conversation_id: int
    scope: str
    segments: list[_Segment]
    vectors: dict[str, list[float]]


def extract(
    messages: Sequence[tuple[int, str]], summary: Summary, *, limit: int
) -> tuple[list[Found], dict[int, Counter[str]]]:
    """The concepts of a segment, best first, and how often each message (id, text) names
    them (see the module docstring)."""
    scores: dict[str, float] = {}
    names: dict[str, str] = {}

    def add(name: str, weight: float) -> None:
        key = concept_key(name)
        if len(key) >= 2 and not key.isdigit():
            scores[key] = scores.get(key, 0.0) + weight
            names.setdefault(key, name.strip())

    facts = summary.facts
    for value in string_list(facts.get("names")):
        add(value, 3.0)
    for value in string_list(facts.get("identifiers")):
        add(value, 3.0)
    for value in string_list(facts.get("dates")):
        if _DIGIT.search(value):
            add(value, 2.0)
    if summary.topics:
        for value in summary.topics:
            add(value, 2.0)
    else:
        counted = Counter(phrase for _, body in messages for phrase in phrases(body))
        for phrase, count in counted.items():
            if count >= 2 or " " in phrase:
                add(phrase, float(count))
    ranked = sorted(scores, key=lambda key: (-scores[key], key))[:limit]
    found = [Found(key=key, name=names[key], score=scores[key]) for key in ranked]
    return found, _mentions(messages, [item.key for item in found])


def _mentions(messages: Sequence[tuple[int, str]], keys: Sequence[str]) -> dict[int, Counter[str]]:
    if not keys:
        return {}
    pattern = re.compile(
        r"(?<!\w)("
        + "|".join(re.escape(key) for key in sorted(keys, key=len, reverse=True))
        + r")(?!\w)"
    )
    found: dict[int, Counter[str]] = {}
    for node_id, body in messages:
        plain = _SPACES.sub(" ", _POSSESSIVE.sub("", body.casefold()))
        counted = Counter(pattern.findall(plain))
        if counted:
            found[node_id] = counted
    return found


async def prepare(
    engine: AsyncEngine,
    config: GraphConfig,
    *,
    tenant_id: int,
    conversation_id: int,
    segments: Sequence[tuple[Sequence[tuple[int, str]], Summary]],
) -> Prepared:
    """Extract the concepts of closed segments (each its messages as (node id, text) and its
    summary) and embed the keys their scope does not hold yet."""
    extracted = [
        _Segment(*extract(messages, summary, limit=config.per_segment))
        for messages, summary in segments
    ]
    keys = list(dict.fromkeys(item.key for segment in extracted for item in segment.found))
    async with transaction(engine) as conn:
        user = await conn.scalar(
            select(conversations.c.user_id).where(
                conversations.c.id == conversation_id, conversations.c.tenant_id == tenant_id
            )
        )
        scope = scope_key(user=user, conversation_id=conversation_id)
        known = set(
            await conn.scalars(
                select(concepts.c.key).where(
                    concepts.c.tenant_id == tenant_id,
                    concepts.c.scope == scope,
                    concepts.c.key.in_(keys),
                )
            )
        )
    unknown = [key for key in keys if key not in known]
    return Prepared(
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        scope=scope,
        segments=extracted,
        vectors=await config.vectors(unknown) if unknown else {},
    )


# -- consolidation ----------------------------------------------------------------------------

# Vectors travel as pgvector's text form here: a few dozen short rows per batch.
_NEAREST = text(
    """
SELECT k.i, c.id, 1 - (c.embedding <=> CAST(k.v AS vector)) AS similarity
FROM unnest(CAST(:vectors AS text[])) WITH ORDINALITY AS k(v, i)
CROSS JOIN LATERAL (
    SELECT id, embedding FROM concepts
    WHERE tenant_id = :tenant_id AND scope = :scope AND embedding IS NOT NULL
    ORDER BY embedding <=> CAST(k.v AS vector) LIMIT 1
) c
"""
)
_INSERT = text(
    """
INSERT INTO concepts (tenant_id, scope, key, name, embedding, frequency)
SELECT :tenant_id, :scope, u.key, u.name, CAST(u.v AS vector), 0
FROM unnest(CAST(:keys AS text[]), CAST(:names AS text[]), CAST(:vectors AS text[]))
     AS u(key, name, v)
ON CONFLICT (tenant_id, scope, key) DO UPDATE SET updated_at = now()
RETURNING key, id
"""
)
_RAISE = text(
    """
UPDATE concepts SET frequency = frequency + u.n, updated_at = now()
FROM unnest(CAST(:ids AS bigint[]), CAST(:counts AS integer[])) AS u(id, n)
WHERE concepts.id = u.id AND concepts.tenant_id = :tenant_id
"""
)
_EDGES = text(
    """
INSERT INTO concept_edges (source_id, target_id, kind, tenant_id, weight)
SELECT s, t, k, :tenant_id, w
FROM unnest(CAST(:sources AS bigint[]), CAST(:targets AS bigint[]), CAST(:kinds AS text[]),
            CAST(:weights AS integer[])) AS u(s, t, k, w)
ON CONFLICT (source_id, target_id, kind)
DO UPDATE SET weight = concept_edges.weight + excluded.weight
"""
)
_MENTIONS = text(
    """
INSERT INTO concept_mentions (concept_id, node_id, tenant_id, conversation_id, weight)
SELECT c, n, :tenant_id, :conversation_id, least(w, 32767)
FROM unnest(CAST(:concepts AS bigint[]), CAST(:nodes AS bigint[]), CAST(:weights AS integer[]))
     AS u(c, n, w)
ON CONFLICT DO NOTHING
"""
)
_PREVIOUS_TOPICS = text(
    """
SELECT m.concept_id FROM nodes n
JOIN concept_mentions m ON m.node_id = n.id
WHERE n.tenant_id = :tenant_id AND n.conversation_id = :conversation_id AND n.level = 1
  AND n.seq = :seq
ORDER BY m.weight DESC, m.concept_id LIMIT :limit
"""
)
_VERSION = text(
    """
INSERT INTO concept_graphs (tenant_id, scope, version) VALUES (:tenant_id, :scope, :n)
ON CONFLICT (tenant_id, scope)
DO UPDATE SET version = concept_graphs.version + excluded.version, updated_at = now()
"""
)


async def consolidate(
    conn: AsyncConnection,
    prepared: Prepared,
    *,
    summaries: Sequence[tuple[int, int] | None],
    merge_similarity: float,
) -> None:
    """Merge the prepared segments into their scope's graph, in the caller's transaction.

    `summaries` gives, per prepared segment, its summary's (level-1 seq, node id), or None for
    a segment whose summary a racing build inserted (it is consolidated there)."""
    todo = [
        (segment, summary)
        for segment, summary in zip(prepared.segments, summaries, strict=True)
        if summary is not None
    ]
    if not todo:
        return
    tenant_id, scope = prepared.tenant_id, prepared.scope
    await conn.execute(
        text("SELECT pg_advisory_xact_lock(hashtext(:lock))"),
        {"lock": f"graph:{tenant_id}:{scope}"},
    )
    ids = await _concept_ids(conn, prepared, [segment for segment, _ in todo], merge_similarity)
    mentions: Counter[tuple[int, int]] = Counter()
    co_occurs: Counter[tuple[int, int]] = Counter()
    precedes: Counter[tuple[int, int]] = Counter()
    seen: Counter[int] = Counter()
    previous: list[int] | None = None
    for segment, (seq, summary_id) in todo:
        ranked = list(dict.fromkeys(ids[item.key] for item in segment.found))
        seen.update(ranked)
        totals: Counter[int] = Counter()
        for node_id, counted in segment.mentions.items():
            for key, count in counted.items():
                mentions[(ids[key], node_id)] += count
                totals[ids[key]] += count
        for concept in ranked:
            mentions[(concept, summary_id)] += max(totals[concept], 1)
        first = ranked[:CO_OCCURRING]
        for a_index, a in enumerate(first):
            for b in first[a_index + 1 :]:
                co_occurs[(min(a, b), max(a, b))] += 1
        topics = sorted(ranked, key=lambda c: (-totals[c], ranked.index(c)))[:TOPICS]
        if previous is None and seq > 0:
            previous = list(
                await conn.scalars(
                    _PREVIOUS_TOPICS,
                    {
                        "tenant_id": tenant_id,
                        "conversation_id": prepared.conversation_id,
                        "seq": seq - 1,
                        "limit": TOPICS,
                    },
                )
            )
        for before in previous or []:
            for after in topics:
                if before != after:
                    precedes[(before, after)] += 1
        previous = topics
    await conn.execute(
        _RAISE, {"tenant_id": tenant_id, "ids": list(seen), "counts": list(seen.values())}
    )
    edges = [(s, t, "co_occurs", w) for (s, t), w in co_occurs.items()]
    edges += [(s, t, "precedes", w) for (s, t), w in precedes.items()]
    if edges:
        sources, targets, kinds, weights = (list(column) for column in zip(*edges, strict=True))
        await conn.execute(
            _EDGES,
            {
                "tenant_id": tenant_id,
                "sources": sources,
                "targets": targets,
                "kinds": kinds,
                "weights": weights,
            },
        )
    if mentions:
        await conn.execute(
            _MENTIONS,
            {
                "tenant_id": tenant_id,
                "conversation_id": prepared.conversation_id,
                "concepts": [concept for concept, _ in mentions],
                "nodes": [node for _, node in mentions],
                "weights": list(mentions.values()),
            },
        )
    await conn.execute(_VERSION, {"tenant_id": tenant_id, "scope": scope, "n": len(todo)})


async def _concept_ids(
    conn: AsyncConnection,
    prepared: Prepared,
    segments: Sequence[_Segment],
    merge_similarity: float,
) -> dict[str, int]:
    """The concept id of every key of `segments`: the scope's concept of that key, else the
    nearest one within `merge_similarity`, else a new concept (frequency 0: `consolidate`
    counts the segments)."""
    tenant_id, scope = prepared.tenant_id, prepared.scope
    keys = list(dict.fromkeys(item.key for segment in segments for item in segment.found))
    names = {item.key: item.name for segment in segments for item in segment.found}
    rows = await conn.execute(
        select(concepts.c.key, concepts.c.id).where(
            concepts.c.tenant_id == tenant_id,
            concepts.c.scope == scope,
            concepts.c.key.in_(keys),
        )
    )
    ids: dict[str, int] = {key: concept for key, concept in rows}
    unknown = [key for key in keys if key not in ids and key in prepared.vectors]
    if unknown:
        vectors = [prepared.vectors[key] for key in unknown]
        nearest = await conn.execute(
            _NEAREST,
            {
                "tenant_id": tenant_id,
                "scope": scope,
                "vectors": [vector_literal(v) for v in vectors],
            },
        )
        for index, concept, similarity in nearest:
            if similarity is not None and similarity >= merge_similarity:
                ids[unknown[index - 1]] = concept
        fresh = _merge_within(
            [key for key in unknown if key not in ids], prepared.vectors, merge_similarity
        )
        heads = [key for key, head in fresh.items() if key == head]
        if heads:
            ids.update(
                await _insert(conn, prepared, heads, names, [prepared.vectors[k] for k in heads])
            )
        for key, head in fresh.items():
            ids[key] = ids[head]
    # Known when prepared (so not embedded) yet gone now (its tenant's data deleted meanwhile):
    # kept by name, without a vector, rather than losing its mentions.
    missing = [key for key in keys if key not in ids]
    if missing:
        ids.update(await _insert(conn, prepared, missing, names, [None] * len(missing)))
    return ids


async def _insert(
    conn: AsyncConnection,
    prepared: Prepared,
    keys: Sequence[str],
    names: Mapping[str, str],
    vectors: Sequence[Sequence[float] | None],
) -> dict[str, int]:
    rows = await conn.execute(
        _INSERT,
        {
            "tenant_id": prepared.tenant_id,
            "scope": prepared.scope,
            "keys": list(keys),
            "names": [names[key] for key in keys],
            "vectors": [None if v is None else vector_literal(v) for v in vectors],
        },
    )
    return {str(key): int(concept) for key, concept in rows}


def _merge_within(
    keys: Sequence[str], vectors: Mapping[str, Sequence[float]], threshold: float
) -> dict[str, str]:
    """New keys of one batch merged among themselves: each maps to the first earlier key
    within `threshold` (itself when none)."""
    if not keys:
        return {}
    matrix = np.asarray([vectors[key] for key in keys], dtype=np.float64)
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    matrix = matrix / np.where(norms > 0, norms, 1.0)
    heads: list[int] = []
    result: dict[str, str] = {}
    for row, key in enumerate(keys):
        if heads:
            similarity = matrix[heads] @ matrix[row]
            best = int(np.argmax(similarity))
            if float(similarity[best]) >= threshold:
                result[key] = keys[heads[best]]
                continue
        heads.append(row)
        result[key] = key
    return result


# Level-1 summaries of a conversation's current branch that no concept mentions yet, oldest
# first, with their messages: segments closed before the graph existed (migration 0012) or
# while `MEMSTRATA_GRAPH` was off.
_UNCONSOLIDATED = text(
    """
SELECT s.id, s.seq, s.text, s.facts, s.method, s.model,
       array_agg(m.id ORDER BY m.seq) AS message_ids, array_agg(m.text ORDER BY m.seq) AS texts
FROM nodes s
JOIN nodes m ON m.parent_id = s.id AND m.level = 0
WHERE s.tenant_id = :tenant_id AND s.conversation_id = :conversation_id AND s.level = 1
  AND s.superseded_at IS NULL
  AND NOT EXISTS (SELECT 1 FROM concept_mentions c WHERE c.node_id = s.id)
GROUP BY s.id
ORDER BY s.seq
"""
)


async def backfill(
    engine: AsyncEngine,
    config: GraphConfig,
    *,
    tenant_id: int,
    conversation_id: int,
    batch: int = 16,
) -> int:
    """Consolidate the conversation's closed segments that are not in its graph yet, oldest
    first, `batch` at a time; how many were. A segment whose summary names no concept is
    consolidated again by the next call (it adds nothing)."""
    async with transaction(engine) as conn:
        rows = (
            await conn.execute(
                _UNCONSOLIDATED, {"tenant_id": tenant_id, "conversation_id": conversation_id}
            )
        ).all()
    for start in range(0, len(rows), batch):
        part = rows[start : start + batch]
        prepared = await prepare(
            engine,
            config,
            tenant_id=tenant_id,
            conversation_id=conversation_id,
            segments=[
                (
                    list(zip(row.message_ids, row.texts, strict=True)),
                    Summary(
                        text=row.text,
                        facts=dict(row.facts or {}),
                        method=row.method or "extractive",
                        model=row.model,
                    ),
                )
                for row in part
            ],
        )
        async with transaction(engine) as conn:
            await consolidate(
                conn,
                prepared,
                summaries=[(int(row.seq), int(row.id)) for row in part],
                merge_similarity=config.merge_similarity,
            )
    return len(rows)
