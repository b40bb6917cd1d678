"""The prompt rebuilt for one turn's query (`MEMSTRATA_CONTEXT_MODE=rebuild`), and the parts
of the summary tree the working context shares (`read_tree`, `frontier`, `summary_cap`) (SPEC §6).

With the working context (the default, `memory.recall.working_context`) a conversation past its
budget is sent a prompt that grows turn after turn; in `rebuild` mode each turn's prompt is
rebuilt from memory for its own query instead: the most room for what the query needs, and
nothing a provider can cache. `build()` returns the messages, in this order:

1. the client's system prompt(s), as given;
2. one memory message (role `system`) holding, under short headings: how to use the memory
   tools; summaries of the history before the recent turns, coarse for the oldest history and
   finer nearer the present (a frontier of the summary tree, each truncated to a few sentences
   and tagged `[#node_id]` with its span and period); pinned milestones; and the messages
   retrieved for the new message (`memory.recall.retrieval`), verbatim, each tagged `[#node_id]` and
   its speaker, in chronological order under a heading per sitting that gives its date and
   the time it began (`memory.recall.memory_block`);
3. the most recent stored turns verbatim, never starting inside a tool call's results;
4. the new messages (and, when they are tool results, the assistant message that called them,
   and while it fits, the question their exchange answers, with its earlier rounds).

Contract: `tokens` is the exact count (`memory.tokens.count_messages`, the model's tiktoken
encoding) of the messages returned, and `tokens + reserved_tokens <= budget`; when the system
prompt and new messages alone exceed that, `ContextOverflow` is raised and nothing is built;
when they fit but not even the memory message's preamble does, the prompt is the system prompt
and the new messages alone.
The budget is split between the parts by `BudgetSplit`: what a part leaves unused goes to retrieval.
Retrieved nodes are added best first by estimated cost; the exact count then drops the weakest
when the estimates fell short, and a second pass fills the room they left when they ran high.

Budgets are capped by the model's window minus its output reserve (`budget_for`): a table of
known models, and the caller's defaults for others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import tokens
from memory.errors import ContextOverflow
from memory.recall import explain, fusion, retrieval, tool_hints
from memory.recall.memory_block import MemoryBlock
from memory.stages import staged
from memory.write import chains, store

__all__ = [
    "MODEL_LIMITS",
    "TOOLS_GUIDE",
    "BudgetSplit",
    "BuiltPrompt",
    "ContextOverflow",
    "TreeNode",
    "budget_for",
    "build",
    "frontier",
    "model_limits",
    "read_tree",
    "summary_cap",
]

# (context window, output reserve) by model-name prefix; the longest matching prefix wins.
MODEL_LIMITS: Final[Mapping[str, tuple[int, int]]] = {
    "gpt-3.5-turbo": (16_385, 4_096),
    "gpt-4": (8_192, 2_048),
    "gpt-4-32k": (32_768, 4_096),
    "gpt-4-turbo": (128_000, 4_096),
    "gpt-4o": (128_000, 16_384),
    "chatgpt-4o": (128_000, 16_384),
    "gpt-4.1": (1_047_576, 32_768),
    "gpt-4.5": (128_000, 16_384),
    "gpt-5": (400_000, 128_000),
    "gpt-oss": (131_072, 16_384),
    "o1": (200_000, 100_000),
    "o3": (200_000, 100_000),
    "o4": (200_000, 100_000),
}

TOOLS_GUIDE: Final = tool_hints.GUIDE
"""How the memory message tells the model to use the memory tools."""


@dataclass(frozen=True)
class BudgetSplit:
    """The most of the budget left after the fixed parts each part may take."""

    recent: float = 0.1
    summaries: float = 0.06
    milestones: float = 0.04
    # Summaries retrieved for the query, beside the frontier's: they rarely hold the words
    # asked about, so they may not crowd out the messages.
    found_summaries: float = 0.1
    # Each summary is cut to this many tokens at most (its [#id] lets the model expand it).
    summary_cap: int = 120
    # Messages at least kept verbatim at the end when they fit in half the budget.
    recent_min_messages: int = 2


@dataclass(frozen=True)
class BuiltPrompt:
    """A built prompt and what went into it."""

    messages: list[dict[str, Any]]
    tokens: int
    recent_from: int  # seq of the first message kept verbatim after the memory message
    retrieved: list[int] = field(default_factory=list)  # messages in the memory block
    summaries: list[int] = field(default_factory=list)
    milestones: list[int] = field(default_factory=list)
    route: str = "flat"
    # What each message is: system, memory (the memory message), verbatim (stored turns), new.
    labels: list[str] = field(default_factory=list)
    # Why each message the memory message quotes was recalled (or pinned), when asked.
    why: list[explain.Why] = field(default_factory=list)


def _limits(model: str) -> tuple[int, int] | None:
    """(context window, output reserve) of `model` by `MODEL_LIMITS`; None when unknown."""
    name = model.strip().lower().rsplit("/", 1)[-1].removeprefix("ft:")
    best = max((prefix for prefix in MODEL_LIMITS if name.startswith(prefix)), key=len, default="")
    return MODEL_LIMITS[best] if best else None


def model_limits(model: str, *, default_window: int, default_reserve: int) -> tuple[int, int]:
    """(context window, output reserve) of `model`; the defaults for unknown models."""
    return _limits(model) or (default_window, default_reserve)


def budget_for(
    model: str,
    *,
    requested: int,
    default_window: int,
    default_reserve: int,
    max_output: int | None = None,
) -> int:
    """`requested`, capped by the model's window minus its output reserve (the request's own
    `max_tokens` / `max_completion_tokens` when it gives one). For a model not in
    `MODEL_LIMITS` the window is only the configured guess, so a request's output larger than
    the default reserve cuts the budget no further: a client asking an unknown model for 64k
    tokens knows its window, and the upstream judges (it was refused here, whatever its prompt)."""
    known = _limits(model)
    window, reserve = known or (default_window, default_reserve)
    if max_output is not None and max_output > 0:
        reserve = max_output if known else min(max_output, default_reserve)
    return max(0, min(requested, window - reserve))


# -- SQL -------------------------------------------------------------------------------------

_MESSAGE_COLUMNS = (
    "id, seq, role, name, content, tool_calls, tool_call_id, meta, token_count, created_at"
)
_TAIL = text(
    f"SELECT {_MESSAGE_COLUMNS} FROM nodes WHERE tenant_id = :tenant_id "
    "AND conversation_id = :conversation_id AND level = 0 AND seq < :before "
    "AND superseded_at IS NULL AND NOT system_prompt ORDER BY seq DESC LIMIT :limit"
)
# What the memory message opens with, in one statement: the summaries the frontier may use (kind
# 'tree') and the pinned milestones (kind 'pinned'). The summaries are the tree's roots before
# `before`, and the children of the "spine" (the newest root of level ≥ 2, its newest child of
# level ≥ 2, and so on down), which are what refining toward the present opens: never the whole
# tree (at 10,000 messages it has thousands of nodes), so their text comes along.
_OPENING = text(
    """
WITH RECURSIVE spine(id) AS (
    (SELECT id FROM nodes
     WHERE tenant_id = :tenant_id AND conversation_id = :conversation_id AND level >= 2
       AND parent_id IS NULL AND span_start < :before
     ORDER BY span_end DESC LIMIT 1)
    UNION ALL
    SELECT child.id FROM spine s
    CROSS JOIN LATERAL (
        SELECT n.id FROM nodes n
        WHERE n.parent_id = s.id AND n.level >= 2 AND n.span_start < :before
        ORDER BY n.span_end DESC LIMIT 1
    ) child
)
SELECT 'tree' AS kind, parent_id, id, conversation_id, level, seq, span_start, span_end, role,
       name, text, created_at, token_count, tool_calls, tool_call_id
FROM nodes
WHERE tenant_id = :tenant_id AND conversation_id = :conversation_id AND level > 0
  AND span_start < :before
  AND (parent_id IS NULL OR parent_id IN (SELECT id FROM spine))
UNION ALL
(SELECT 'pinned', parent_id, id, conversation_id, level, seq, span_start, span_end, role, name,
        text, created_at, token_count, tool_calls, tool_call_id
 FROM nodes
 WHERE tenant_id = :tenant_id AND conversation_id = :conversation_id AND level = 0 AND pinned
   AND seq < :before AND superseded_at IS NULL
 ORDER BY seq DESC LIMIT 32)
"""
)
_TAIL_PAGE = 128
_TOP_UP = 24  # room left after the exact count worth a second filling pass


@dataclass(frozen=True)
class TreeNode:
    """A summary the frontier may use."""

    hit: retrieval.Hit
    parent_id: int | None


# -- building ----------------------------------------------------------------------------


async def build(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    system: Sequence[Mapping[str, Any]],
    new_messages: Sequence[Mapping[str, Any]],
    new_from: int,
    query: str,
    embed: Callable[[str], Awaitable[Sequence[float] | None]] | None,
    budget: int,
    model: str,
    reserved_tokens: int = 0,
    conversation_ids: Sequence[int] = (),
    stored_messages: int | None = None,
    stored_tokens: int | None = None,
    tools_guide: str | None = TOOLS_GUIDE,
    shares: BudgetSplit | None = None,
    abandoned: bool = False,
    explained: bool = False,
) -> BuiltPrompt:
    """The prompt for a conversation whose history does not fit (see the module docstring).

    `new_messages` are the messages of this turn, stored from seq `new_from` on (or not stored:
    a dry run); everything stored before `new_from` is history. `conversation_ids` are other
    conversations whose memory may be recalled (the same user's). `embed` turns the query into
    a vector, run while the full-text leg runs; without it, or when it returns None, retrieval
    is full-text only. The recent turns are the current branch's; `abandoned` lets retrieval
    also recall messages of abandoned branches. `explained` also says why each retrieved
    message was recalled."""
    shares = shares or BudgetSplit()
    limit = budget - reserved_tokens
    asked, must = await _exchange_of(conn, tenant_id, conversation_id, new_messages, new_from)
    head = [dict(m) for m in system]
    tail_new = [*(store.prompt_message(row) for row in must), *(dict(m) for m in new_messages)]
    first_kept = must[0].seq if must else new_from
    fixed = tokens.count_messages([*head, *tail_new], model=model)
    if fixed > limit:
        raise ContextOverflow(
            f"the system prompt and the new messages need {fixed} tokens, more than the budget "
            f"of {limit} (MEMSTRATA_CONTEXT_BUDGET or X-Memstrata-Budget)"
        )
    # The question the tool results answer goes with them while it fits, before any memory.
    with_question = [*(store.prompt_message(row) for row in asked), *tail_new]
    if asked and (counted := tokens.count_messages([*head, *with_question], model=model)) <= limit:
        tail_new, first_kept, fixed = with_question, asked[0].seq, counted
    preamble = _preamble(stored_messages, stored_tokens, tools_guide)
    # The memory message's own framing and preamble.
    frame = tokens.count_message({"role": "system", "content": preamble}, model=model)
    available = max(0, limit - fixed - frame)

    # The query is embedded while the recent turns are read. The participants' names to leave
    # out of it are known only then; a query naming one is embedded again without it.
    vector_task = asyncio.ensure_future(embed(query)) if embed is not None and query else None
    try:
        recent, participants = await _recent(
            conn, tenant_id, conversation_id, before=first_kept, available=available, shares=shares
        )
        recent_from = recent[0].seq if recent else first_kept
        speakers = retrieval.participants_named(query, participants)
        search_text = retrieval.without_names(query, participants)
        scope_ids = [conversation_id, *(c for c in conversation_ids if c != conversation_id)]
        exclude = (conversation_id, recent_from)
        which = retrieval.route(query)
        # Candidates per leg: enough that what fills the room is chosen among several times more.
        pool = max(100, min(400, available // 8))
        if vector_task is not None and search_text != query:
            vector_task.cancel()
            vector_task = asyncio.ensure_future(embed(search_text)) if embed is not None else None
        fulltext = await retrieval.fulltext_candidates(
            conn,
            tenant_id=tenant_id,
            conversation_ids=scope_ids,
            query=search_text,
            limit=pool,
            exclude_from=exclude,
            abandoned=abandoned,
        )
        tree, pinned = await _opening(conn, tenant_id, conversation_id, before=recent_from)
        # The summaries do not depend on the query: chosen while it is embedded.
        summary_budget = int(available * shares.summaries)
        cap = summary_cap(
            sum(1 for node in tree if node.parent_id is None),
            budget=summary_budget,
            cap=shares.summary_cap,
        )
        chosen = frontier(tree, budget=summary_budget, cap=cap)
        vector = await vector_task if vector_task is not None else None
    finally:
        if vector_task is not None and not vector_task.done():
            vector_task.cancel()
    legs = [fulltext]
    if vector is not None:
        legs += await retrieval.vector_legs(
            conn,
            tenant_id=tenant_id,
            conversation_ids=scope_ids,
            query_vector=vector,
            limit=pool,
            exclude_from=exclude,
            messages=first_kept if len(scope_ids) == 1 else None,
            abandoned=abandoned,
        )
    scores = fusion.fuse(
        legs,
        which=which,
        newest={conversation_id: first_kept - 1},
        primary=conversation_id,
        speakers=speakers,
        exclude_from=exclude,
        within=retrieval.periods(query),
    )
    # Enough candidates to fill the room left even with short messages.
    wanted = (available - sum(row.token_count for row in recent)) // 25 + 20
    hits = await retrieval.load(
        conn, tenant_id=tenant_id, scores=scores, limit=wanted, abandoned=abandoned
    )

    enc = tokens.get_encoding(tokens.encoding_name_for_model(model))
    block = MemoryBlock(enc=enc, primary=conversation_id)
    for node in chosen:
        block.add_summary(node.hit, cap=cap)
    milestone_budget = int(available * shares.milestones)
    # Milestones that bear on the question first, then the newest.
    pinned.sort(key=lambda hit: (-scores.get((hit.conversation_id, 0, hit.seq), 0.0), -hit.seq))
    for hit in pinned:
        if block.milestone_cost + block.cost_of_message(hit) <= milestone_budget:
            block.add_milestone(hit)
    room = available - sum(row.token_count for row in recent) - block.total
    found = int(available * shares.found_summaries)
    recent_messages = [store.prompt_message(row) for row in recent]
    for _ in range(2):  # the second pass fills what the estimates (which run high) left over
        found = _fill(block, hits, room=room, found=found, cap=cap)
        while True:
            memory = {"role": "system", "content": preamble + block.render()}
            messages = [*head, memory, *recent_messages, *tail_new]
            count = tokens.count_messages(messages, model=model)
            if count <= limit or not block.drop_weakest(count - limit):
                break
        room = limit - count
        if room <= _TOP_UP:
            break
    while count > limit and recent_messages:  # only the recent turns can still give way
        recent_messages = _drop_first_turn(recent_messages)
        messages = [*head, memory, *recent_messages, *tail_new]
        count = tokens.count_messages(messages, model=model)
    between = ["memory", *(["verbatim"] * len(recent_messages))]
    if count > limit:  # not even the memory message's preamble fits: no memory at all
        messages, count = [*head, *tail_new], fixed
        between = []
    why: list[explain.Why] = []
    if explained and between:
        quoted = [*block.milestones, *block.messages]
        why = explain.explain(legs, scores, quoted, pinned=[h.node_id for h in block.milestones])
    labels = (
        ["system"] * len(head) + between + ["verbatim"] * len(must) + ["new"] * len(new_messages)
    )
    return BuiltPrompt(
        messages=messages,
        tokens=count,
        recent_from=first_kept - len(recent_messages),
        retrieved=sorted(block.message_ids),
        summaries=sorted(block.summary_ids),
        milestones=[hit.node_id for hit in block.milestones],
        route=str(which),
        labels=labels,
        why=why,
    )


def _fill(
    block: MemoryBlock, hits: Sequence[retrieval.Hit], *, room: int, found: int, cap: int
) -> int:
    """Add the hits, best first, that fit in `room` tokens (summaries also within `found`);
    the summaries' budget left."""
    for hit in hits:
        if room <= 8:
            break
        if hit.node_id in block.summary_ids or hit.node_id in block.message_ids:
            continue
        if hit.level > 0:
            cost = block.cost_of_summary(hit, cap=cap)
            if cost <= min(room, found):
                block.add_summary(hit, cap=cap)
                room -= cost
                found -= cost
            continue
        cost = block.cost_of_message(hit)
        if cost <= room:
            block.add_message(hit, cost=cost)
            room -= cost
    return found


def _preamble(messages: int | None, stored_tokens: int | None, guide: str | None) -> str:
    size = ""
    if messages is not None:
        size = f" {messages:,} earlier messages"
        if stored_tokens is not None:
            size += f" ({stored_tokens:,} tokens)"
        size += " are stored."
    lines = [
        f"[Memory of this conversation.{size} Below: summaries, milestones and messages "
        "retrieved for the newest message, tagged [#id]; the latest messages follow.]"
    ]
    if guide:
        lines.append(guide)
    return "\n".join(lines) + "\n"


# -- the parts -------------------------------------------------------------------------------


@staged("opening")
async def _opening(
    conn: AsyncConnection, tenant_id: int, conversation_id: int, *, before: int
) -> tuple[list[TreeNode], list[retrieval.Hit]]:
    """The summaries the frontier may use, and the newest pinned milestones (`_OPENING`)."""
    tree: list[TreeNode] = []
    pinned: list[retrieval.Hit] = []
    rows = await conn.execute(
        _OPENING, {"tenant_id": tenant_id, "conversation_id": conversation_id, "before": before}
    )
    for kind, parent_id, *columns in rows:
        hit = retrieval.as_hit(columns, 0.0)
        if kind == "tree":
            tree.append(TreeNode(hit=hit, parent_id=parent_id))
        else:
            pinned.append(hit)
    return tree, pinned


@staged("recent")
async def _exchange_of(
    conn: AsyncConnection,
    tenant_id: int,
    conversation_id: int,
    new_messages: Sequence[Mapping[str, Any]],
    new_from: int,
) -> tuple[list[Any], list[Any]]:
    """When the new messages begin with tool results: the stored messages back to (and with)
    the assistant message that called them, which a call's results are never split from;
    and before those, the user message that asked what the exchange answers, with the
    exchange's earlier rounds (none when it is not among the newest stored messages)."""
    if not new_messages or new_messages[0].get("role") != "tool":
        return [], []
    rows = list(
        await conn.execute(
            _TAIL,
            {
                "tenant_id": tenant_id,
                "conversation_id": conversation_id,
                "before": new_from,
                "limit": 64,
            },
        )
    )
    calls = next(
        (i for i, row in enumerate(rows) if row.role == "assistant" and row.tool_calls), None
    )
    if calls is None or any(row.role != "tool" for row in rows[:calls]):
        return [], []
    for index in range(calls + 1, len(rows)):
        row = rows[index]
        if row.role == "user":
            return rows[calls + 1 : index + 1][::-1], rows[: calls + 1][::-1]
        if row.role != "tool" and not (row.role == "assistant" and row.tool_calls):
            break
    return [], rows[: calls + 1][::-1]


@staged("recent")
async def _recent(
    conn: AsyncConnection,
    tenant_id: int,
    conversation_id: int,
    *,
    before: int,
    available: int,
    shares: BudgetSplit,
) -> tuple[list[Any], set[str]]:
    """The newest stored messages before `before` within the recent share, oldest first,
    starting on a message that is not a tool result; and the speaker names (`name`) seen among
    the newest messages read."""
    cap = int(available * shares.recent)
    floor = available // 2
    kept: list[Any] = []
    names: set[str] = set()
    used = 0
    cursor = before
    while cursor > 0:
        rows = list(
            await conn.execute(
                _TAIL,
                {
                    "tenant_id": tenant_id,
                    "conversation_id": conversation_id,
                    "before": cursor,
                    "limit": _TAIL_PAGE,
                },
            )
        )
        names.update(row.name for row in rows if row.name and row.role in ("user", "assistant"))
        for row in rows:
            if row.role in chains.SYSTEM_ROLES:
                return _clean_start(kept[::-1]), names
            within = used + row.token_count <= cap
            if not within and not (
                len(kept) < shares.recent_min_messages and used + row.token_count <= floor
            ):
                return _clean_start(kept[::-1]), names
            kept.append(row)
            used += row.token_count
        if len(rows) < _TAIL_PAGE:
            break
        cursor = rows[-1].seq
    return _clean_start(kept[::-1]), names


def _clean_start(rows: list[Any]) -> list[Any]:
    """Drop leading tool results whose call is not kept."""
    start = 0
    while start < len(rows) and rows[start].role == "tool":
        start += 1
    return rows[start:]


def _drop_first_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rest = messages[1:]
    while rest and rest[0].get("role") == "tool":
        rest = rest[1:]
    return rest


def summary_cap(tree_roots: int, *, budget: int, cap: int) -> int:
    """Tokens each summary may keep so that the roots of the tree fit the summaries' budget."""
    return max(24, min(cap, budget // max(1, tree_roots) - 16))


async def read_tree(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, before: int
) -> list[TreeNode]:
    """The summaries a frontier of the history before seq `before` may use (see `_OPENING`)."""
    tree, _ = await _opening(conn, tenant_id, conversation_id, before=before)
    return tree


def frontier(tree: Sequence[TreeNode], *, budget: int, cap: int) -> list[TreeNode]:
    """Summaries covering the history, coarse for the oldest and finer near the present:
    start from the roots and open the newest openable node while the budget allows."""
    if not tree or budget <= 0:
        return []
    ids = {node.hit.node_id for node in tree}
    children: dict[int, list[TreeNode]] = {}
    for node in tree:
        if node.parent_id is not None and node.parent_id in ids:
            children.setdefault(node.parent_id, []).append(node)

    def cost(node: TreeNode) -> int:
        return min(node.hit.token_count, cap) + 16

    chosen = sorted(
        (node for node in tree if node.parent_id is None or node.parent_id not in ids),
        key=lambda node: node.hit.span_start,
    )
    # Too many roots: keep the coarsest ones (they cover the most history).
    while chosen and sum(cost(node) for node in chosen) > budget:
        chosen.remove(min(chosen, key=lambda node: (node.hit.level, -node.hit.span_start)))
    total = sum(cost(node) for node in chosen)
    while True:
        openable = [node for node in chosen if node.hit.node_id in children]
        if not openable:
            break
        newest = max(openable, key=lambda node: node.hit.span_end)
        kids = sorted(children[newest.hit.node_id], key=lambda node: node.hit.span_start)
        change = sum(cost(kid) for kid in kids) - cost(newest)
        if total + change > budget:
            break
        index = chosen.index(newest)
        chosen[index : index + 1] = kids
        total += change
    return chosen
