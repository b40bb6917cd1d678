"""Reading memory node by node: the bodies of the memory tools (`memory.recall.tools`).

* `expand(node_id)`: a summary → the nodes it summarizes (finer summaries, or the original
  messages verbatim; by parent link, or by the span it covers while the tree is rebuilt); a
  message → it with `NEIGHBOURS` messages on each side.
* `browse(level, start, end)`: the nodes of one level by their sequence numbers (messages by
  seq, level-k summaries by their ordinal), at most `MAX_BROWSE`.
* `find(pattern, start_seq, end_seq)`: messages whose text matches a regular expression (the
  `regex` module, Python syntax). A pattern is refused above `MAX_PATTERN_CHARS`; matching runs
  in a worker thread (the GIL released) under one time budget, `Limits.regex_timeout`, so a
  catastrophic pattern yields `PatternRejected` quickly, never a hung worker; at most
  `MAX_MATCHES` results, with a note of where to continue.
* `search(query, limit)`: hybrid retrieval (`memory.recall.retrieval.search`), at most `MAX_SEARCH`,
  for the query's first `MAX_QUERY_CHARS` characters.

Every function reads within a `Scope`: one tenant, one conversation, and for `expand` and
`search` the other conversations it may recall; messages that left their conversation's
current branch (`memory.write.branches`) only when the scope allows (`abandoned`), marked so.
A node of another tenant or outside the scope behaves exactly as a missing one (`NotFound`).
Results are compact text for a model: each node tagged `[#id]` with its place, time (UTC, to
the minute) and speaker, never more than `Limits.result_chars` characters (a note says what was
left out and how to get it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import regex
from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import db
from memory.db import AnyRow
from memory.embeddings import Embedder
from memory.errors import InvalidInput, NotFound, PatternRejected
from memory.recall import retrieval
from memory.schema import nodes
from memory.text import escape_unstorable
from memory.write import conversations

MAX_PATTERN_CHARS: Final = 500
MAX_QUERY_CHARS: Final = 2000
MAX_MATCHES: Final = 20
MAX_BROWSE: Final = 50
MAX_SEARCH: Final = 25
NEIGHBOURS: Final = 2
SNIPPET_CHARS: Final = 400
_FIND_BATCH: Final = 500
MARK: Final = "→ "
DEFAULT_SEARCH_LIMIT: Final = 8
# The widest values of the columns a tool's numbers are compared with (a model may write any
# number; Postgres refuses a parameter its column type cannot hold).
_MAX_ID: Final = 2**63 - 1  # nodes.id, bigint
_MAX_LEVEL: Final = 2**15 - 1  # nodes.level, smallint
_MAX_SEQ: Final = 2**31 - 1  # nodes.seq, integer


@dataclass(frozen=True)
class Scope:
    """Whose memory a call reads: `conversation_id` (browse, find, neighbours) and, for search
    and expand, the other conversations of the same tenant it may recall."""

    tenant_id: int
    conversation_id: int
    recall: tuple[int, ...] = ()
    abandoned: bool = False
    """Messages off their conversation's current branch are read too."""

    @property
    def conversation_ids(self) -> list[int]:
        return [self.conversation_id, *(c for c in self.recall if c != self.conversation_id)]


@dataclass(frozen=True)
class Limits:
    """How much one call may cost: regex seconds, and characters handed back."""

    regex_timeout: float = 1.0
    result_chars: int = 16_000


DEFAULT_LIMITS: Final = Limits()


# -- the tools ---------------------------------------------------------------------------------


async def expand(
    conn: AsyncConnection,
    scope: Scope,
    *,
    node_id: int,
    limits: Limits = DEFAULT_LIMITS,
) -> str:
    """A summary with its children, or a message with its neighbours."""
    in_range = -_MAX_ID <= node_id <= _MAX_ID
    found = await _nodes(conn, scope, nodes.c.id == node_id, everywhere=True) if in_range else []
    if not found:
        raise NotFound(f"node {node_id} does not exist")
    node = found[0]
    same = nodes.c.conversation_id == node.conversation_id
    if node.level == 0:
        around = await _nodes(
            conn,
            scope,
            same,
            nodes.c.level == 0,
            nodes.c.seq.between(node.seq - NEIGHBOURS, node.seq + NEIGHBOURS),
            everywhere=True,
        )
        head = f"message [#{node.id}] ({MARK.strip()}) with its neighbours:"
        lines = [(MARK if n.id == node.id else "") + _line(n, n.text) for n in around]
        return _fit([head, *lines], limits, more="")
    children = await _nodes(conn, scope, same, nodes.c.parent_id == node.id, everywhere=True)
    if not children:  # a tree being rebuilt: fall back to the span the summary covers
        children = await _nodes(
            conn,
            scope,
            same,
            nodes.c.level == node.level - 1,
            nodes.c.span_start >= node.span_start,
            nodes.c.span_end <= node.span_end,
            everywhere=True,
        )
    head = f"{_line(node, None)} summarizes {len(children)} nodes:"
    body = [_line(child, child.text) for child in children]
    return _fit([head, *body], limits, more="expand a child [#id] to read it whole")


async def browse(
    conn: AsyncConnection,
    scope: Scope,
    *,
    level: int,
    start: int = 0,
    end: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> str:
    """The nodes of `level` whose sequence numbers lie in `start..end`."""
    if level < 0:
        raise InvalidInput("level must be 0 (messages) or more (summaries)")
    start = min(max(start, 0), _MAX_SEQ)
    end = start + MAX_BROWSE - 1 if end is None else min(end, start + MAX_BROWSE - 1)
    if end < start:
        raise InvalidInput("end must not be before start")
    end = min(end, _MAX_SEQ)
    found = (
        await _nodes(conn, scope, nodes.c.level == level, nodes.c.seq.between(start, end))
        if level <= _MAX_LEVEL
        else []
    )
    if not found:
        counts = await _level_counts(conn, scope)
        held = ", ".join(f"level {lvl}: {count} nodes (0-{count - 1})" for lvl, count in counts)
        return f"no level-{level} nodes in {start}-{end}; the conversation holds {held or 'none'}"
    what = "messages" if level == 0 else f"level-{level} summaries"
    head = f"{what} {found[0].seq}-{found[-1].seq}:"
    more = f"continue with memory_browse(level={level}, start=<next seq>)"
    return _fit([head, *(_line(n, n.text) for n in found)], limits, more=more)


async def find(
    conn: AsyncConnection,
    scope: Scope,
    *,
    pattern: str,
    start_seq: int | None = None,
    end_seq: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> str:
    """Messages matching `pattern`, in order, at most `MAX_MATCHES`."""
    compiled = _compile(pattern)
    deadline = time.monotonic() + limits.regex_timeout
    after = min(max(start_seq or 0, 0), _MAX_SEQ) - 1
    if end_seq is not None:
        end_seq = min(max(end_seq, -1), _MAX_SEQ)
    matches: list[str] = []
    stopped: str | None = None
    while len(matches) < MAX_MATCHES:
        query = [nodes.c.level == 0, nodes.c.seq > after]
        if end_seq is not None:
            query.append(nodes.c.seq <= end_seq)
        batch = await _nodes(conn, scope, *query, limit=_FIND_BATCH)
        if not batch:
            break
        if time.monotonic() >= deadline:
            stopped = f"the time limit stopped the search before message {batch[0].seq}"
            break
        room = MAX_MATCHES - len(matches)
        found, after = await asyncio.to_thread(_match, compiled, batch, deadline, pattern, room)
        matches.extend(_line(node, _around(node.text, span)) for node, span in found)
    head = f"{len(matches)} messages match {pattern!r}" + (":" if matches else ".")
    notes = [stopped] if stopped else []
    if len(matches) >= MAX_MATCHES:
        notes.append(f"more may match after message {after}: continue with start_seq")
    return _fit([head, *matches[:MAX_MATCHES], *notes], limits, more="narrow the range")


async def search(
    conn: AsyncConnection,
    scope: Scope,
    *,
    query: str,
    limit: int = DEFAULT_SEARCH_LIMIT,
    embedder: Embedder,
    limits: Limits = DEFAULT_LIMITS,
) -> str:
    """The best matching nodes for `query`: the full-text leg runs while it is embedded, and
    the vector legs beside it in a spare connection when one is free (the tools' transactions
    write nothing the legs read)."""
    # A longer query is read from its start: Postgres refuses the search vector of a long one
    # (a megabyte of distinct words failed the call), and the encoder reads far less anyway.
    query = query[:MAX_QUERY_CHARS]
    limit = min(max(limit, 1), MAX_SEARCH)
    # Postgres and encoders refuse a NUL or an unpaired surrogate; stored text holds them
    # escaped, so the escaped query is also the one that finds them.
    query, _ = escape_unstorable(query)
    embedding = asyncio.ensure_future(embedder.embed([query]))
    fulltext = asyncio.ensure_future(
        retrieval.fulltext_candidates(
            conn,
            tenant_id=scope.tenant_id,
            conversation_ids=scope.conversation_ids,
            query=query,
            limit=max(retrieval.CANDIDATES, limit),
            abandoned=scope.abandoned,
        )
    )
    try:
        async with db.spare(conn) as aside:
            [vector] = await embedding
            hits = await retrieval.search(
                conn,
                tenant_id=scope.tenant_id,
                conversation_ids=scope.conversation_ids,
                query=query,
                query_vector=vector,
                limit=limit,
                abandoned=scope.abandoned,
                fulltext=fulltext,
                aside=aside,
            )
    finally:  # when one failed, a finished task ignores it
        embedding.cancel()
        fulltext.cancel()
    if not hits:
        return f"nothing found for {query!r}"
    elsewhere = await conversations.external_ids(
        conn,
        tenant_id=scope.tenant_id,
        ids={h.conversation_id for h in hits} - {scope.conversation_id},
    )
    lines = [f"{len(hits)} results for {query!r}, best first:"]
    for hit in hits:
        node = _Node.from_hit(hit)
        body = _clip(node.text, SNIPPET_CHARS)
        lines.append(_line(node, body, origin=elsewhere.get(hit.conversation_id)))
    return _fit(lines, limits, more="use fewer results")


# -- reading nodes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Node:
    id: int
    conversation_id: int
    level: int
    seq: int
    span_start: int
    span_end: int
    role: str | None
    name: str | None
    text: str
    tool_calls: Any
    created_at: datetime
    meta: Mapping[str, Any]
    status: str = "complete"
    superseded: bool = False

    @classmethod
    def from_row(cls, row: AnyRow) -> _Node:
        return cls(
            id=row.id,
            conversation_id=row.conversation_id,
            level=row.level,
            seq=row.seq,
            span_start=row.span_start,
            span_end=row.span_end,
            role=row.role,
            name=row.name,
            text=row.text,
            tool_calls=row.tool_calls,
            created_at=row.created_at,
            meta=row.meta or {},
            status=row.status,
            superseded=row.superseded_at is not None,
        )

    @classmethod
    def from_hit(cls, hit: retrieval.Hit) -> _Node:
        return cls(
            id=hit.node_id,
            conversation_id=hit.conversation_id,
            level=hit.level,
            seq=hit.seq,
            span_start=hit.span_start,
            span_end=hit.span_end,
            role=hit.role,
            name=hit.name,
            text=hit.text,
            tool_calls=hit.tool_calls,
            created_at=hit.created_at,
            meta={},
        )


_COLUMNS: Final = (
    nodes.c.id,
    nodes.c.conversation_id,
    nodes.c.level,
    nodes.c.seq,
    nodes.c.span_start,
    nodes.c.span_end,
    nodes.c.role,
    nodes.c.name,
    nodes.c.text,
    nodes.c.tool_calls,
    nodes.c.created_at,
    nodes.c.meta,
    nodes.c.status,
    nodes.c.superseded_at,
)


async def _nodes(
    conn: AsyncConnection,
    scope: Scope,
    *where: ColumnElement[bool],
    everywhere: bool = False,
    limit: int | None = None,
) -> list[_Node]:
    """Nodes of the scope's tenant matching `where`, in the scope's conversation (or, with
    `everywhere`, in any conversation it may recall), by level then seq."""
    allowed = scope.conversation_ids if everywhere else [scope.conversation_id]
    if not scope.abandoned:
        where = (*where, nodes.c.superseded_at.is_(None))
    query = (
        select(*_COLUMNS)
        .where(nodes.c.tenant_id == scope.tenant_id, nodes.c.conversation_id.in_(allowed), *where)
        .order_by(nodes.c.level.desc(), nodes.c.seq)
        .limit(limit)
    )
    return [_Node.from_row(row) for row in await conn.execute(query)]


async def _level_counts(conn: AsyncConnection, scope: Scope) -> list[tuple[int, int]]:
    rows = await conn.execute(
        select(nodes.c.level, func.count())
        .where(
            nodes.c.tenant_id == scope.tenant_id, nodes.c.conversation_id == scope.conversation_id
        )
        .group_by(nodes.c.level)
        .order_by(nodes.c.level)
    )
    return [(int(level), int(count)) for level, count in rows]


# -- regular expressions -------------------------------------------------------------------------


def _compile(pattern: str) -> regex.Pattern[str]:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternRejected(f"the pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:
        return regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError) as exc:
        raise PatternRejected(f"the pattern is not a valid regular expression: {exc}") from exc


def _match(
    compiled: regex.Pattern[str],
    batch: Sequence[_Node],
    deadline: float,
    pattern: str,
    room: int,
) -> tuple[list[tuple[_Node, tuple[int, int]]], int]:
    """The first match in each node, at most `room`, and the seq of the last node looked at
    (run in a worker thread: `concurrent` releases the GIL while matching)."""
    found: list[tuple[_Node, tuple[int, int]]] = []
    for node in batch:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            match = compiled.search(node.text, timeout=remaining, concurrent=True)
        except TimeoutError as exc:
            raise PatternRejected(
                f"the pattern {pattern!r} ran out of time at message {node.seq} "
                "(nested repetition such as (a|aa)+ backtracks exponentially); simplify it "
                "or narrow start_seq/end_seq"
            ) from exc
        if match is not None:
            found.append((node, match.span()))
            if len(found) >= room:
                return found, node.seq
    return found, batch[-1].seq


# -- formatting ----------------------------------------------------------------------------------


def _when(moment: datetime | str | None) -> str:
    """A time to the minute, UTC (summaries keep theirs as ISO strings in `meta`)."""
    if isinstance(moment, str):
        try:
            moment = datetime.fromisoformat(moment)
        except ValueError:
            return str(moment)
    if moment is None:
        return ""
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M")


def _line(node: _Node, body: str | None, *, origin: str | None = None) -> str:
    """`[#id] place · time · who: body` (a verbatim body may span lines); no body: the place."""
    where = f" in conversation {origin}" if origin else ""
    if node.level == 0:
        place = f"[#{node.id}] message {node.seq}{where} · {_when(node.created_at)}"
        who = node.role or "?"
        if node.name:
            who += f" ({node.name})"
        if node.status != "complete":
            who += f" [{node.status}]"
        if node.superseded:
            who += " [abandoned branch]"
    else:
        start = _when(node.meta.get("started_at") or node.created_at)
        end = _when(node.meta.get("ended_at") or node.created_at)
        period = start if start == end else f"{start} → {end}"
        place = (
            f"[#{node.id}] level-{node.level} summary {node.seq}{where} of messages "
            f"{node.span_start}-{node.span_end} · {period}"
        )
        who = "summary"
    if body is None:
        return place
    return f"{place} · {who}: {body}{_calls(node.tool_calls)}"


def _calls(tool_calls: Any) -> str:
    if not isinstance(tool_calls, list) or not tool_calls:
        return ""
    shown = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            shown.append(f"{function.get('name')}({_clip(str(function.get('arguments')), 200)})")
    return " [calls " + ", ".join(shown) + "]" if shown else ""


def _clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + f"… (+{len(text) - chars} chars)"


def _around(text: str, span: tuple[int, int], context: int = 120) -> str:
    start, end = span
    end = min(end, start + SNIPPET_CHARS)
    left, right = max(0, start - context), min(len(text), end + context)
    return ("…" if left else "") + text[left:right] + ("…" if right < len(text) else "")


def _fit(lines: Sequence[str], limits: Limits, *, more: str) -> str:
    """`lines` joined, cut to `limits.result_chars` with a note of what was left out."""
    out: list[str] = []
    used = 0
    for index, line in enumerate(lines):
        if used + len(line) + 1 > limits.result_chars:
            room = limits.result_chars - used - 1
            if room > 200:
                out.append(line[:room] + f"… (+{len(line) - room} chars)")
            left = len(lines) - index - (1 if room > 200 else 0)
            note = f"[{left} more lines not shown{'; ' + more if more else ''}]"
            out.append(note)
            break
        out.append(line)
        used += len(line) + 1
    return "\n".join(out)
