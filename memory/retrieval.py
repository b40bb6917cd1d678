"""Hybrid retrieval over the whole summary tree of one or more conversations (SPEC §6).

`search()` is the one entry point the prompt builder, the memory tools and the admin API share:

* tenant-scoped: only nodes of `tenant_id` in `conversation_ids` are ever read; a conversation
  id of another tenant simply finds nothing;
* two legs fused by reciprocal rank (`RRF_K`): pgvector cosine distance (`query_vector`, when
  given; exact for one conversation, the HNSW index scanned iteratively for several) and
  Postgres full text: candidates are the nodes matching `websearch_to_tsquery` of the query's
  words joined by `or` (quoted phrases stay phrases), ranked by a BM25-like score (inverse
  document frequency of each query lexeme, and of each identifier the parser splits, within the
  searched conversations, normalized by node length), so a rare identifier outweighs "go";
* exact matches win: a node holding a rare identifier of the query, or a vector hit standing
  far above the rest of its leg, gets a bonus worth `EXACT_BONUS` first ranks;
* messages that have no embedding yet are found by the full-text leg alone: nothing just written
  is invisible;
* collapsed tree: summaries of every level are searched beside messages (`levels` restricts);
* query routing (`route()`): sequential questions ("last time", "earlier", "before",
  "recently") weight recency heavily, relational ones ("how", "why", "relate") raise summaries,
  others are flat hybrid with a light recency tie-break;
* temporal contiguity: each message lends a share of its score to the messages next to it
  (`CONTIGUITY`), so an answer right after the best match is found even when it shares no word
  with the question;
* periods: a query naming a calendar period ("in March 2023", "on 2023-03-16") raises the
  messages written within it (or in the week after), after contiguity too;
* speakers: a query naming one participant (a message `name`) raises that participant's
  messages, after contiguity (what a message lends its neighbours is not raised, so the other
  participant's replies around it do not crowd out the named one's own words); callers strip
  participants' names from the text they embed (`without_names`).

System and developer messages are never returned (they are the client's prompt, not memory).
`search()` costs one SQL round trip per leg plus one to load the hits; the full-text leg does
not need the vector, so callers may run it (`fulltext_candidates`) while the query is embedded.
Weights were tuned on LoCoMo (see docs/benchmarks.md).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.query import (
    Route,
    identifiers,
    participants_named,
    periods,
    route,
    websearch_query,
    without_names,
)

__all__ = [
    "Candidates",
    "Hit",
    "Route",
    "as_hit",
    "fulltext_candidates",
    "fuse",
    "identifiers",
    "load",
    "load_nodes",
    "participants_named",
    "periods",
    "ranked",
    "route",
    "search",
    "vector_candidates",
    "websearch_query",
    "without_names",
]

RRF_K: Final = 20
"""Reciprocal-rank fusion constant: score = Σ weight / (RRF_K + rank). Lower than the usual 60:
tuned on LoCoMo, where the first ranks of each leg deserve more weight."""

CANDIDATES: Final = 100
"""Candidates each leg returns at least, before fusion."""

EXACT_SCAN_MAX: Final = 6000
"""Most messages in scope for which the vector leg computes every distance (see
`vector_candidates`): a filtered scan of the HNSW index, shared by every tenant, once missed a
5,000-message conversation's clearly best match (similarity 0.48, the next 0.34) in a database
holding many near-duplicate vectors; the exact scan costs a few ms per thousand messages."""

CONTIGUITY: Final = (0.8, 0.4)
"""Share of a message's relevance lent to the messages 1, 2, ... places away: an exchange is
about one thing, so a question's answer often sits next to the message that matches best."""

EXACT_BONUS: Final = 2.0
"""A node holding a rare identifier of the query (a word with digits that at most 3 searched
nodes hold: a ticket, a booking reference) gains this many first ranks: rank fusion alone would
let a near-miss by meaning tie with the exact match."""

STANDOUT_Z: Final = 4.0
"""How far (in standard deviations) a vector hit must stand above its leg to count as exact."""

SPEAKER_BOOST: Final = 2.0
"""Multiplier of the fused score of candidates written by the one participant a query names."""

PERIOD_BOOST: Final = 2.0
"""Multiplier of the fused score of candidates written within a calendar period the query
names (`memory.query.periods`: "in March 2023" also reaches the week after, when messages
still tell of it)."""


@dataclass(frozen=True)
class Weights:
    """How one route weighs summaries and recency against relevance."""

    summary: float  # multiplier of a summary's fused score
    recency: float  # weight of the recency boost (0: none)


ROUTE_WEIGHTS: Final[Mapping[Route, Weights]] = {
    Route.FLAT: Weights(summary=0.6, recency=0.05),
    Route.SEQUENTIAL: Weights(summary=0.8, recency=1.5),
    Route.RELATIONAL: Weights(summary=1.5, recency=0.05),
}


@dataclass(frozen=True)
class Hit:
    """One node found: a message (level 0) or a summary, with its fused score."""

    node_id: int
    conversation_id: int
    level: int
    seq: int
    span_start: int
    span_end: int
    role: str | None
    text: str
    created_at: datetime
    score: float
    name: str | None = None
    token_count: int = 0
    tool_calls: Any = None
    tool_call_id: str | None = None


Key = tuple[int, int, int]
"""A node's place: (conversation id, level, seq), unique in its tenant."""


@dataclass(frozen=True)
class Place:
    """What fusion needs to know of a candidate."""

    key: Key
    span_end: int
    name: str | None
    exact: bool = False  # holds a rare identifier-like word of the query (digits, ≥ 4 chars)
    similarity: float | None = None  # cosine similarity to the query (vector leg)
    created_at: datetime | None = None


@dataclass(frozen=True)
class Candidates:
    """One leg's candidates, best first."""

    ranked: list[Place]


# -- the legs ------------------------------------------------------------------------------

_SCOPE = """
    n.tenant_id = :tenant_id
    AND n.conversation_id = ANY(:conversation_ids)
    AND (n.level > 0 OR n.role IS NULL OR n.role NOT IN ('system', 'developer'))
    AND (CAST(:levels AS smallint[]) IS NULL OR n.level = ANY(CAST(:levels AS smallint[])))
    AND (CAST(:exclude_conversation AS bigint) IS NULL
         OR n.conversation_id <> CAST(:exclude_conversation AS bigint)
         OR n.span_start < CAST(:exclude_from AS integer))
"""

# BM25 without term frequency: Σ idf(lexeme) over the query lexemes a node holds, normalized by
# the node's length; idf is taken within the searched conversations. The nodes are read once per
# term through the GIN index (a node matching the whole query, as (term, node) pairs) instead of
# testing every term against every matched node's tsvector; idf is computed once per term.
_FULLTEXT = text(
    f"""
WITH terms AS MATERIALIZED (
    SELECT row_number() OVER () AS term, lexeme, tq FROM (
        SELECT DISTINCT lexeme, quote_literal(lexeme)::tsquery AS tq
        FROM unnest(tsvector_to_array(to_tsvector('english', :query))) AS lexeme
        UNION
        -- An identifier the parser splits ("PO-2314" → 'po', '-2314') is a term of its own.
        SELECT word, phraseto_tsquery('english', word)
        FROM unnest(CAST(:identifiers AS text[])) AS word
        WHERE numnode(phraseto_tsquery('english', word)) > 1
    ) AS query_terms
),
pairs AS MATERIALIZED (
    SELECT t.term, n.id, n.conversation_id, n.level, n.seq, n.span_end, n.name, n.created_at,
           n.token_count
    FROM terms t
    JOIN nodes n ON n.tsv @@ t.tq
    WHERE {_SCOPE}
      AND n.tsv @@ websearch_to_tsquery('english', :websearch)
),
stats AS MATERIALIZED (
    SELECT greatest(sum(c.next_seq), 1) AS total,
           (SELECT greatest(avg(token_count), 1)
            FROM (SELECT DISTINCT ON (id) token_count FROM pairs) AS matched) AS avg_tokens
    FROM conversations c
    WHERE c.tenant_id = :tenant_id AND c.id = ANY(:conversation_ids)
),
df AS MATERIALIZED (
    -- Messages only: summaries repeat their messages' identifiers and would halve the idf.
    SELECT d.term, d.lexeme, d.df, ln(1 + (s.total - d.df + 0.5) / (d.df + 0.5)) AS idf
    FROM (SELECT t.term, t.lexeme, count(p.id) FILTER (WHERE p.level = 0) AS df
          FROM terms t LEFT JOIN pairs p ON p.term = t.term
          GROUP BY t.term, t.lexeme) AS d
    CROSS JOIN stats s
)
SELECT p.conversation_id, p.level, p.seq, p.span_end, p.name, p.created_at,
       bool_or(df.df <= 3 AND df.lexeme ~ '[0-9]' AND length(df.lexeme) >= 4) AS exact,
       NULL::float AS similarity,
       sum(df.idf) * 2.2 / (1 + 1.2 * (0.25 + 0.75 * p.token_count / s.avg_tokens)) AS score
FROM pairs p
JOIN df ON df.term = p.term
CROSS JOIN stats s
GROUP BY p.id, p.conversation_id, p.level, p.seq, p.span_end, p.name, p.created_at,
         p.token_count, s.total, s.avg_tokens
ORDER BY score DESC, p.id DESC
LIMIT :limit
"""
)

_VECTOR = text(
    f"""
SELECT n.conversation_id, n.level, n.seq, n.span_end, n.name, n.created_at, false AS exact,
       1 - (n.embedding <=> CAST(:vector AS vector)) AS similarity
FROM nodes n
WHERE {_SCOPE} AND n.embedding IS NOT NULL
ORDER BY n.embedding <=> CAST(:vector AS vector)
LIMIT :limit
"""
)
# The same, exact: `+ 0` keeps the planner off the HNSW index, so the conversation's rows are
# read through the (conversation_id, level, seq) index and every distance is computed.
_VECTOR_EXACT = text(
    f"""
SELECT n.conversation_id, n.level, n.seq, n.span_end, n.name, n.created_at, false AS exact,
       1 - (n.embedding <=> CAST(:vector AS vector)) AS similarity
FROM nodes n
WHERE {_SCOPE} AND n.embedding IS NOT NULL
ORDER BY (n.embedding <=> CAST(:vector AS vector)) + 0
LIMIT :limit
"""
)

_LOAD = text(
    """
SELECT n.id, n.conversation_id, n.level, n.seq, n.span_start, n.span_end, n.role, n.name,
       n.text, n.created_at, n.token_count, n.tool_calls, n.tool_call_id
FROM unnest(CAST(:conversations AS bigint[]), CAST(:levels AS smallint[]),
            CAST(:seqs AS integer[])) AS w(conv, level, seq)
JOIN nodes n ON n.conversation_id = w.conv AND n.level = w.level AND n.seq = w.seq
WHERE n.tenant_id = :tenant_id
  AND (n.level > 0 OR n.role IS NULL OR n.role NOT IN ('system', 'developer'))
"""
)


def _scope_params(
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    levels: Sequence[int] | None,
    exclude_from: tuple[int, int] | None,
) -> dict[str, Any]:
    return {
        "tenant_id": tenant_id,
        "conversation_ids": list(conversation_ids),
        "levels": list(levels) if levels is not None else None,
        "exclude_conversation": exclude_from[0] if exclude_from else None,
        "exclude_from": exclude_from[1] if exclude_from else None,
    }


async def fulltext_candidates(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query: str,
    limit: int = CANDIDATES,
    levels: Sequence[int] | None = None,
    exclude_from: tuple[int, int] | None = None,
) -> Candidates:
    """The full-text leg: nodes matching any query word, best BM25-like score first."""
    websearch = websearch_query(query)
    if not websearch or not conversation_ids:
        return Candidates([])
    rows = await conn.execute(
        _FULLTEXT,
        {
            **_scope_params(
                tenant_id=tenant_id,
                conversation_ids=conversation_ids,
                levels=levels,
                exclude_from=exclude_from,
            ),
            "query": query,
            "websearch": websearch,
            "identifiers": identifiers(query),
            "limit": limit,
        },
    )
    return _candidates(rows)


async def vector_candidates(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query_vector: Sequence[float],
    limit: int = CANDIDATES,
    levels: Sequence[int] | None = None,
    exclude_from: tuple[int, int] | None = None,
    messages: int | None = None,
) -> Candidates:
    """The vector leg: embedded nodes by cosine distance to `query_vector`, nearest first.

    A small scope (`messages`, the searched conversations' message count, at most
    `EXACT_SCAN_MAX`; unknown: one conversation) is scanned exactly: its rows come from the
    conversation's index and every distance is computed, where the HNSW index, shared by every
    tenant, is approximate. Larger scopes use the HNSW index, scanned iteratively (pgvector
    ≥ 0.8) so that the tenant and conversation filter still leaves `limit` rows when enough
    exist: at 10,000 messages the exact scan costs ~50 ms here, the index ~10 ms, and the two
    share 99% of their first 100 rows."""
    if not conversation_ids:
        return Candidates([])
    params = {
        **_scope_params(
            tenant_id=tenant_id,
            conversation_ids=conversation_ids,
            levels=levels,
            exclude_from=exclude_from,
        ),
        "vector": _vector_literal(query_vector),
        "limit": limit,
    }
    if (messages is None and len(conversation_ids) == 1) or (
        messages is not None and messages <= EXACT_SCAN_MAX
    ):
        return _candidates(await conn.execute(_VECTOR_EXACT, params))
    # Without `enable_sort = off` the planner, misjudging how many rows the filter keeps,
    # prefers reading the whole conversation and sorting: the exact scan this path avoids.
    await conn.execute(
        text(
            "SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true), "
            "set_config('hnsw.ef_search', :ef, true), set_config('enable_sort', 'off', true)"
        ),
        {"ef": str(max(40, min(1000, 2 * limit)))},
    )
    found = _candidates(await conn.execute(_VECTOR, params))
    await conn.execute(text("SELECT set_config('enable_sort', 'on', true)"))
    # A relaxed-order scan returns its rows only nearly sorted; fusion goes by rank.
    found.ranked.sort(key=lambda place: -(place.similarity or 0.0))
    return found


def _vector_literal(vector: Sequence[float]) -> str:
    return "[" + ",".join(f"{float(x):.6g}" for x in vector) + "]"


def _candidates(rows: Any) -> Candidates:
    # By position: named access to a row's columns costs more than the rest of this loop.
    return Candidates(
        [
            Place(
                key=(conversation_id, level, seq),
                span_end=span_end,
                name=name,
                exact=bool(exact),
                similarity=None if similarity is None else float(similarity),
                created_at=created_at,
            )
            for (
                conversation_id,
                level,
                seq,
                span_end,
                name,
                created_at,
                exact,
                similarity,
                *_,
            ) in rows
        ]
    )


# -- fusion --------------------------------------------------------------------------------


def fuse(
    legs: Sequence[Candidates],
    *,
    which: Route,
    newest: Mapping[int, int],
    primary: int | None = None,
    speakers: Collection[str] = (),
    exclude_from: tuple[int, int] | None = None,
    kernel: Sequence[float] = CONTIGUITY,
    within: Sequence[tuple[date, date]] = (),
) -> dict[Key, float]:
    """Fused score per node place (see the module docstring).

    Reciprocal-rank fusion of the legs; each message lends `kernel[d-1]` of its score to the
    messages `d` places away (which may not be candidates themselves); candidates written by
    the one participant in `speakers`, and those written within one of the periods `within`
    (first day, last day), are then raised; summaries are weighted by the route;
    recency (`newest` maps a conversation to its newest message seq) raises newer nodes, more
    so for sequential queries; other conversations than `primary` weigh a little less."""
    weights = ROUTE_WEIGHTS[which]
    base: dict[Key, float] = {}
    span_end: dict[Key, int] = {}
    names: dict[Key, str | None] = {}
    written: dict[Key, date] = {}
    exact: set[Key] = set()
    for leg in legs:
        for rank, place in enumerate(leg.ranked):
            base[place.key] = base.get(place.key, 0.0) + 1.0 / (RRF_K + rank + 1)
            span_end[place.key] = place.span_end
            names[place.key] = place.name
            if place.created_at is not None:
                written[place.key] = place.created_at.date()
            if place.exact:
                exact.add(place.key)
    exact |= _standouts(legs)
    # Thousands of keys per prompt: the loops below keep their lookups local.
    summary_weight = weights.summary
    recency_weight = weights.recency
    lends = list(enumerate(kernel, start=1))
    # The exact-identifier bonus is the node's own: it is not lent to neighbours.
    scores: dict[Key, float] = {key: EXACT_BONUS / (RRF_K + 1) for key in exact}
    get = scores.get
    for key, score in base.items():
        conv, level, seq = key
        if level > 0:
            scores[key] = get(key, 0.0) + score * summary_weight
            continue
        scores[key] = get(key, 0.0) + score
        for distance, share in lends:
            for near in (seq - distance, seq + distance):
                if near >= 0:
                    lent: Key = (conv, 0, near)
                    scores[lent] = get(lent, 0.0) + share * score
    excluded_conv, excluded_from = exclude_from if exclude_from is not None else (None, 0)
    result: dict[Key, float] = {}
    for key, score in scores.items():
        conv, level, seq = key
        end = span_end.get(key, seq)
        last = newest.get(conv)
        if level == 0 and (
            (last is not None and seq > last)  # a neighbour past the end
            or (conv == excluded_conv and seq >= excluded_from)
        ):
            continue
        last = end if last is None else last
        recency = math.exp(-max(0, last - end) / max(50.0, 0.05 * (last + 1)))
        score *= 1.0 + recency_weight * recency
        if primary is not None and conv != primary:
            score *= 0.9
        if level == 0 and len(speakers) == 1 and names.get(key) in speakers:
            score *= SPEAKER_BOOST
        day = written.get(key)
        if level == 0 and day is not None and any(a <= day <= b for a, b in within):
            score *= PERIOD_BOOST
        result[key] = score
    return result


def _standouts(legs: Sequence[Candidates]) -> set[Key]:
    """Candidates whose similarity stands far above the rest of their leg's (more than
    `STANDOUT_Z` standard deviations over the mean of its first 50): a match by meaning that
    clear is as telling as an exact identifier, which rank fusion alone would not show."""
    found: set[Key] = set()
    for leg in legs:
        sims = [p.similarity for p in leg.ranked[:50] if p.similarity is not None]
        if len(sims) < 10:
            continue
        mean = sum(sims) / len(sims)
        spread = math.sqrt(sum((x - mean) ** 2 for x in sims) / len(sims))
        if spread <= 1e-6:
            continue
        for place in leg.ranked[:3]:
            if place.similarity is not None and (place.similarity - mean) / spread > STANDOUT_Z:
                found.add(place.key)
    return found


# -- the entry point -----------------------------------------------------------------------


async def search(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query: str,
    query_vector: Sequence[float] | None,
    limit: int = 10,
    levels: Sequence[int] | None = None,
    exclude_from: tuple[int, int] | None = None,
    which: Route | None = None,
    candidates: int = CANDIDATES,
    participants: Collection[str] = (),
    fulltext: Candidates | None = None,
) -> list[Hit]:
    """The `limit` best nodes for `query`, best first (see the module docstring).

    `exclude_from=(conversation_id, seq)` leaves out that conversation's nodes that start at or
    after `seq` (the recent turns a prompt already holds verbatim). `which` overrides routing.
    `participants` are the conversation's speaker names (see `fuse`). `fulltext` passes a
    full-text leg already run with the same scope."""
    if limit <= 0 or not conversation_ids:
        return []
    which = which or route(query)
    pool = max(candidates, limit)
    legs: list[Candidates] = []
    if fulltext is None:
        fulltext = await fulltext_candidates(
            conn,
            tenant_id=tenant_id,
            conversation_ids=conversation_ids,
            query=query,
            limit=pool,
            levels=levels,
            exclude_from=exclude_from,
        )
    legs.append(fulltext)
    newest = await _newest(conn, tenant_id=tenant_id, conversation_ids=conversation_ids)
    if query_vector is not None:
        legs.append(
            await vector_candidates(
                conn,
                tenant_id=tenant_id,
                conversation_ids=conversation_ids,
                query_vector=query_vector,
                limit=pool,
                levels=levels,
                exclude_from=exclude_from,
                messages=sum(last + 1 for last in newest.values()),
            )
        )
    scores = fuse(
        legs,
        which=which,
        newest=newest,
        primary=conversation_ids[0] if len(conversation_ids) > 1 else None,
        speakers=participants_named(query, participants),
        exclude_from=exclude_from,
        kernel=CONTIGUITY if levels is None or 0 in levels else (),
        within=periods(query),
    )
    return (await load(conn, tenant_id=tenant_id, scores=scores, limit=limit))[:limit]


async def load(
    conn: AsyncConnection, *, tenant_id: int, scores: Mapping[Key, float], limit: int
) -> list[Hit]:
    """The `limit` best-scored places that exist (and are not system prompts), as hits in
    descending score order."""
    best = ranked(scores, limit)
    if not best:
        return []
    rows = await conn.execute(
        _LOAD,
        {
            "tenant_id": tenant_id,
            "conversations": [key[0] for key in best],
            "levels": [key[1] for key in best],
            "seqs": [key[2] for key in best],
        },
    )
    hits = [as_hit(row, scores[(row[1], row[2], row[3])]) for row in rows]
    return sorted(hits, key=lambda hit: (-hit.score, -hit.seq, hit.node_id))


def ranked(scores: Mapping[Key, float], limit: int) -> list[Key]:
    """The `limit` best-scored places, best first (ties: the newer first)."""
    if limit <= 0 or not scores:
        return []
    # Only the places scoring at least the `limit`-th best score need the full sort.
    floor = heapq.nlargest(limit, scores.values())[-1]
    best = [key for key, score in scores.items() if score >= floor]
    return sorted(best, key=lambda key: (-scores[key], -key[2], key))[:limit]


async def load_nodes(conn: AsyncConnection, *, tenant_id: int, ids: Sequence[int]) -> list[Hit]:
    """Nodes by id (of this tenant), scored 0."""
    if not ids:
        return []
    rows = await conn.execute(
        text(
            "SELECT id, conversation_id, level, seq, span_start, span_end, role, name, text, "
            "created_at, token_count, tool_calls, tool_call_id FROM nodes "
            "WHERE tenant_id = :tenant_id AND id = ANY(:ids)"
        ),
        {"tenant_id": tenant_id, "ids": list(ids)},
    )
    return [as_hit(row, 0.0) for row in rows]


async def _newest(
    conn: AsyncConnection, *, tenant_id: int, conversation_ids: Sequence[int]
) -> dict[int, int]:
    rows = await conn.execute(
        text(
            "SELECT id, next_seq FROM conversations WHERE tenant_id = :tenant_id AND id = ANY(:ids)"
        ),
        {"tenant_id": tenant_id, "ids": list(conversation_ids)},
    )
    return {int(row.id): int(row.next_seq) - 1 for row in rows}


def as_hit(row: Any, score: float) -> Hit:
    """A hit from a row of `nodes` with the columns `_LOAD` selects, in its order (read by
    position: hundreds of rows per prompt)."""
    (
        node_id,
        conversation_id,
        level,
        seq,
        span_start,
        span_end,
        role,
        name,
        body,
        created_at,
        token_count,
        tool_calls,
        tool_call_id,
    ) = row
    return Hit(
        node_id=node_id,
        conversation_id=conversation_id,
        level=level,
        seq=seq,
        span_start=span_start,
        span_end=span_end,
        role=role,
        text=body,
        created_at=created_at,
        score=score,
        name=name,
        token_count=token_count,
        tool_calls=tool_calls,
        tool_call_id=tool_call_id,
    )
