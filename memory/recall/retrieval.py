"""Hybrid retrieval over the whole summary tree of one or more conversations (SPEC §6).

`search()` is the one entry point the prompt builder, the memory tools and the admin API share:

* tenant-scoped: only nodes of `tenant_id` in `conversation_ids` are ever read; a conversation
  id of another tenant simply finds nothing;
* three legs, fused by `memory.recall.fusion` (reciprocal rank, exact matches, contiguity, routing,
  periods, speakers):
  - Postgres full text: candidates are the nodes matching `websearch_to_tsquery` of the query's
    words joined by `or` (quoted phrases stay phrases), ranked by a BM25-like score (inverse
    document frequency of each query lexeme, and of each identifier the parser splits, within
    the searched conversations, normalized by node length), so a rare identifier outweighs "go";
  - pgvector cosine distance to `query_vector`, when given (exact for one conversation, the
    HNSW index scanned iteratively for several);
  - passages (`memory.build.passages`): the vector leg's messages ranked again by the better of
    their own similarity and their best sentence's, so that a message whose one relevant
    sentence is diluted by small talk rises to where that sentence alone would rank;
* messages that have no embedding yet are found by the full-text leg alone: nothing just written
  is invisible;
* collapsed tree: summaries of every level are searched beside messages (`levels` restricts);
* query routing (`route()`): sequential questions ("last time", "earlier", "before",
  "recently") weight recency heavily, relational ones ("how", "why", "relate") raise summaries;
* callers strip participants' names from the text they embed (`without_names`): inside a
  conversation they say nothing about the topic.

System and developer messages are never returned (they are the client's prompt, not memory),
nor, unless a caller asks (`abandoned`), messages that left their conversation's current branch
(an edited message, a regenerated answer: `memory.write.branches`).
`search()` costs one SQL round trip per leg plus one to load the hits; the full-text leg does
not need the vector, so callers may start it (`fulltext_candidates`) while the query is embedded,
and the vector legs may run beside it in a second connection (`aside`).

The full-text leg is here; the vector legs are `memory.recall.nearest`'s, and what every leg
searches (its scope) and returns (its candidates) is `memory.recall.legs`'s. This module is the
face the rest of the code calls: it names them all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.recall.fusion import CONTIGUITY, Candidates, Key, fuse, ranked
from memory.recall.legs import ARRAYS, CANDIDATES, SCOPE, candidates_of, rows_of, scope_params
from memory.recall.nearest import vector_legs
from memory.recall.query import (
    Route,
    asks,
    identifiers,
    participants_named,
    periods,
    route,
    websearch_query,
    without_names,
)
from memory.stages import staged

A = TypeVar("A")
B = TypeVar("B")

__all__ = [
    "CANDIDATES",
    "Candidates",
    "Hit",
    "Route",
    "as_hit",
    "asks",
    "beside",
    "candidates_of",
    "fulltext_candidates",
    "identifiers",
    "load",
    "participants_named",
    "periods",
    "route",
    "search",
    "vector_legs",
    "websearch_query",
    "without_names",
]

FULLTEXT_READS: Final = 1000
"""Most messages whose nodes the full-text leg reads for one query: its terms are read rarest
first within this many (see `_FULLTEXT`)."""


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


# -- the legs ------------------------------------------------------------------------------

# BM25 without term frequency: Σ idf(term) over the query terms a node holds, normalized by the
# node's length; idf is taken within the searched conversations.
#
# What it costs is the nodes it reads, so it reads only those of the query's rarer terms. The
# lexeme statistics (`lexemes`, kept by the database) say how many messages of the searched
# conversations hold each term before any node is read; the terms are taken rarest first while
# their messages together stay within :reads, and only their nodes are read (through the GIN
# index on (conversation_id, tsv), in one scan). Every term, read or not, is then scored on
# the nodes found: a common word still adds its (small) idf to a node a rarer word found, it
# only finds none of its own. When the query's terms are held by :reads messages or fewer
# together, the ranking is exactly that of reading every term: so it was on all 1,540 LoCoMo
# questions and the 60 of the LongMemEval dev sample (conversations of 370-690 and ~500
# messages) at `FULLTEXT_READS`. A question made only of terms held by more than :reads
# messages finds nothing here (the vector legs still do).
#
# Measured at 10,000 messages (medians of 8 questions, EXPLAIN ANALYZE; reading every term on
# the index on tsv alone, before, / now): rows of `nodes` read 12,874 / 490 and buffers 5,927 /
# 532 when the words repeat ("message 412 about topic 10 with number 2884", asked "new question
# 7 about topic 3"); 1,735 / 1,102 and 3,429 / 1,184 on varied text.
_FULLTEXT = text(
    f"""
WITH terms AS MATERIALIZED (
    SELECT q.term, q.lexeme, q.tq, q.held,
           sum(q.held) OVER (ORDER BY q.held, q.term) <= :reads AS read
    FROM (
        SELECT row_number() OVER () AS term, lexeme, tq, (
            -- A phrase is held by at most as many messages as its rarest lexeme.
            SELECT coalesce(min(per_lexeme.held), 0) FROM (
                -- Looked up lexeme by lexeme, through the primary key: joined to the lexemes
                -- of a term, the planner read the conversation's whole table for each term.
                SELECT coalesce((SELECT sum(l.messages) FROM lexemes l
                                 WHERE l.lexeme = x.lexeme AND l.tenant_id = :tenant_id
                                   AND l.conversation_id = ANY(:conversation_ids)), 0) AS held
                FROM unnest(query_terms.lexemes) AS x(lexeme)
            ) AS per_lexeme
        ) AS held
        FROM (
            SELECT DISTINCT lexeme, quote_literal(lexeme)::tsquery AS tq, ARRAY[lexeme] AS lexemes
            FROM unnest(tsvector_to_array(to_tsvector('english', :query))) AS lexeme
            UNION
            -- An identifier the parser splits ("PO-2314" → 'po', '-2314') is a term of its own.
            SELECT word, phraseto_tsquery('english', word),
                   tsvector_to_array(to_tsvector('english', word))
            FROM unnest(CAST(:identifiers AS text[])) AS word
            WHERE numnode(phraseto_tsquery('english', word)) > 1
        ) AS query_terms
    ) AS q
),
found AS MATERIALIZED (
    -- One bitmap scan for every term read (their union, in the index), so each node comes
    -- once: reading them term by term, each node a term found came once per term and had to
    -- be made distinct again, the whole row with its search vector. The whole query is checked
    -- on the rows found, not in the index (`IS TRUE` keeps it out of the index condition):
    -- there it made the index read every term's posting list, common words included.
    SELECT n.id, n.conversation_id, n.level, n.seq, n.span_end, n.name, n.created_at,
           n.token_count, n.tsv
    FROM nodes n
    WHERE n.tsv @@ (SELECT string_agg('(' || t.tq::text || ')', ' | ')::tsquery
                    FROM terms t WHERE t.read)
      AND {SCOPE}
      AND (n.tsv @@ websearch_to_tsquery('english', :websearch)) IS TRUE
),
pairs AS MATERIALIZED (
    -- (term, node) for every term a node found holds, read or not. Each pair carries its
    -- node's columns, so that scoring never joins back to `found`: the planner cannot count a
    -- CTE's rows, guessed one each and joined them in a nested loop, 5.2 million comparisons
    -- (480 ms) for 1,188 nodes found when the words repeat.
    SELECT t.term, f.id, f.conversation_id, f.level, f.seq, f.span_end, f.name, f.created_at,
           f.token_count
    FROM terms t JOIN found f ON f.tsv @@ t.tq
),
stats AS MATERIALIZED (
    -- In float8: as the sum's numeric, every score after it was computed in numeric. With the
    -- one scan above, 14.4 -> 12.3 ms at the median on 10,000 messages of varied text and 5-13 %
    -- less on LoCoMo's conversations, the same order (`bench.fulltext`).
    SELECT greatest(sum(c.next_seq), 1)::float8 AS total,
           (SELECT greatest(avg(token_count), 1) FROM found)::float8 AS avg_tokens
    FROM conversations c
    WHERE c.tenant_id = :tenant_id AND c.id = ANY(:conversation_ids)
),
df AS MATERIALIZED (
    -- Messages only: summaries repeat their messages' identifiers and would halve the idf. A
    -- term read is counted among the nodes found (all that hold it); one not read, by the
    -- statistics.
    SELECT d.term, d.lexeme, d.df, ln(1 + (s.total - d.df + 0.5) / (d.df + 0.5)) AS idf
    FROM (SELECT t.term, t.lexeme,
                 CASE WHEN t.read THEN count(p.id) FILTER (WHERE p.level = 0)
                      ELSE min(t.held) END AS df
          FROM terms t LEFT JOIN pairs p ON p.term = t.term
          GROUP BY t.term, t.lexeme, t.read) AS d
    CROSS JOIN stats s
)
SELECT {ARRAYS.format(order=" ORDER BY score DESC, id DESC")}
FROM (
    SELECT p.id, p.conversation_id, p.level, p.seq, p.span_end, p.name, p.created_at,
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
) AS best
"""
)

# The hits' rows as one row of arrays (`legs.rows_of`), and a message without tool calls (stored
# as JSON null) with SQL NULL: a note loads a few hundred hits, and the driver decoded each
# row, and each JSON null, on its own (3.6-4.1 -> 1.5-2.4 ms of CPU for 260 hits).
_LOAD = text(
    """
SELECT array_agg(n.id), array_agg(n.conversation_id), array_agg(n.level), array_agg(n.seq),
       array_agg(n.span_start), array_agg(n.span_end), array_agg(n.role), array_agg(n.name),
       array_agg(n.text), array_agg(n.created_at), array_agg(n.token_count),
       array_agg(NULLIF(n.tool_calls, 'null'::jsonb)), array_agg(n.tool_call_id)
FROM unnest(CAST(:conversations AS bigint[]), CAST(:levels AS smallint[]),
            CAST(:seqs AS integer[])) AS w(conv, level, seq)
JOIN nodes n ON n.conversation_id = w.conv AND n.level = w.level AND n.seq = w.seq
WHERE n.tenant_id = :tenant_id
  AND (n.level > 0 OR n.role IS NULL OR n.role NOT IN ('system', 'developer'))
  AND (CAST(:abandoned AS boolean) OR n.superseded_at IS NULL)
"""
)


@staged("fulltext")
async def fulltext_candidates(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_ids: Sequence[int],
    query: str,
    limit: int = CANDIDATES,
    levels: Sequence[int] | None = None,
    exclude_from: tuple[int, int] | None = None,
    abandoned: bool = False,
    reads: int = FULLTEXT_READS,
) -> Candidates:
    """The full-text leg: nodes matching any query word, best BM25-like score first; only the
    nodes of the rarest words held by at most `reads` messages together are read (see
    `_FULLTEXT`)."""
    websearch = websearch_query(query)
    if not websearch or not conversation_ids:
        return Candidates([])
    rows = await conn.execute(
        _FULLTEXT,
        {
            **scope_params(
                tenant_id=tenant_id,
                conversation_ids=conversation_ids,
                levels=levels,
                exclude_from=exclude_from,
                abandoned=abandoned,
            ),
            "query": query,
            "websearch": websearch,
            "identifiers": identifiers(query),
            "limit": limit,
            "reads": reads,
        },
    )
    return candidates_of(rows_of(rows))


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
    fulltext: Awaitable[Candidates] | None = None,
    abandoned: bool = False,
    aside: AsyncConnection | None = None,
) -> list[Hit]:
    """The `limit` best nodes for `query`, best first (see the module docstring).

    `exclude_from=(conversation_id, seq)` leaves out that conversation's nodes that start at or
    after `seq` (the recent turns a prompt already holds verbatim). `which` overrides routing.
    `participants` are the conversation's speaker names (see `fuse`). `fulltext` is the
    full-text leg already started with the same scope. `abandoned` also searches messages that
    left their conversation's current branch (`memory.write.branches`). With `aside`, a spare
    connection (`memory.db.spare`) that sees what `conn` sees (`conn`'s transaction wrote
    nothing the legs read), the vector legs run there while the full-text leg runs in `conn`."""
    if limit <= 0 or not conversation_ids:
        return []
    which = which or route(query)
    pool = max(candidates, limit)
    if fulltext is None:
        fulltext = fulltext_candidates(
            conn,
            tenant_id=tenant_id,
            conversation_ids=conversation_ids,
            query=query,
            limit=pool,
            levels=levels,
            exclude_from=exclude_from,
            abandoned=abandoned,
        )

    async def nearest(on: AsyncConnection) -> tuple[dict[int, int], list[Candidates]]:
        newest = await _newest(on, tenant_id=tenant_id, conversation_ids=conversation_ids)
        if query_vector is None:
            return newest, []
        return newest, await vector_legs(
            on,
            tenant_id=tenant_id,
            conversation_ids=conversation_ids,
            query_vector=query_vector,
            limit=pool,
            levels=levels,
            exclude_from=exclude_from,
            messages=sum(last + 1 for last in newest.values()),
            abandoned=abandoned,
        )

    if aside is None or query_vector is None:
        found = await fulltext
        newest, vectors = await nearest(conn)
    else:
        found, (newest, vectors) = await beside(fulltext, nearest(aside))
    scores = fuse(
        [found, *vectors],
        which=which,
        newest=newest,
        primary=conversation_ids[0] if len(conversation_ids) > 1 else None,
        speakers=participants_named(query, participants),
        exclude_from=exclude_from,
        kernel=CONTIGUITY if levels is None or 0 in levels else (),
        within=periods(query),
    )
    return (await load(conn, tenant_id=tenant_id, scores=scores, limit=limit, abandoned=abandoned))[
        :limit
    ]


async def beside(first: Awaitable[A], second: Awaitable[B]) -> tuple[A, B]:
    """Both results, the two run at once (each in its own connection); when one fails, the
    other is cancelled rather than left running in its connection."""
    one, two = asyncio.ensure_future(first), asyncio.ensure_future(second)
    try:
        await asyncio.gather(one, two)
    finally:
        one.cancel()
        two.cancel()
    return one.result(), two.result()


@staged("load")
async def load(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    scores: Mapping[Key, float],
    limit: int,
    abandoned: bool = False,
) -> list[Hit]:
    """The `limit` best-scored places that exist (and are not system prompts, nor, unless
    `abandoned`, messages off their conversation's current branch), as hits in descending score
    order."""
    best = ranked(scores, limit)
    if not best:
        return []
    rows = await conn.execute(
        _LOAD,
        {
            "tenant_id": tenant_id,
            "abandoned": abandoned,
            "conversations": [key[0] for key in best],
            "levels": [key[1] for key in best],
            "seqs": [key[2] for key in best],
        },
    )
    hits = [as_hit(row, scores[(row[1], row[2], row[3])]) for row in rows_of(rows)]
    return sorted(hits, key=lambda hit: (-hit.score, -hit.seq, hit.node_id))


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
