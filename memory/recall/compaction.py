"""Compaction: a working context rebuilt down to the low-water mark (SPEC §6).

A turn whose prompt would pass the high-water mark compacts its working context
(`memory.recall.working_context`) until the prompt without its note fits the low-water mark,
cheapest step first:

1. **Observation masking.** Tool results older than the fresh tail (the newest turns, within
   `Policy.fresh` of the budget) are replaced by a one-line placeholder: the node id, the size
   and "memory_expand to read" (`working_context.masked`). Nothing else changes when that is
   enough.
2. **Summaries.** The oldest verbatim turns give way to summaries from the tree: the compaction
   point moves forward, never between a tool call and its results (nor, while tool results
   come in, past the question of their exchange: `exchange_start`), and a new stable-memory
   message (`StablePart`) lists, for the messages it took out, the coarsest summaries whose
   span lies within them and the segments that straddle its edges, each tagged `[#id]`, with
   the milestones among them verbatim. The point stops where the tree's segments end, when
   that still leaves the context under the high-water mark, rather than compact messages no
   summary covers yet. Every compacted message is under a summary of the prompt, or, while
   the tree has not summarized it yet (or a consolidation had no room for its summary), in a
   range the message names ("memory_browse … reads them"): nothing is lost, and every
   summary can be expanded.
3. **Consolidation.** When stable memory passes `Policy.stable` of the budget (or on a first
   build), it becomes one message: a frontier of the summary tree over everything before the
   compaction point, coarse for the oldest history and finer near the present, with the newest
   milestones.

The earlier stable-memory messages stay byte for byte through steps 1 and 2, so a compaction
turn still repeats the prefix up to them; only a consolidation rebuilds the prefix after the
system prompt. Recall notes are dropped at every compaction.

`prepare()` is the background half: once a context passes halfway from the low- to the
high-water mark, it computes the next compaction ahead of time, aimed at what the turn that
reaches the high-water mark will need, and stores it beside the state (`State.prepared`), so
that that turn only swaps it in (`swap()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from sqlalchemy import text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory import tokens
from memory.db import transaction
from memory.recall import prompt, retrieval, tool_hints
from memory.recall.memory_block import MemoryBlock
from memory.recall.working_context import (
    Item,
    Policy,
    StablePart,
    State,
    load,
    masked,
    part_json,
    parts,
    read_items,
    render,
)
from memory.schema import conversations, working_contexts
from memory.stages import staged

__all__ = ["Fixed", "build", "calls_start", "compact", "exchange_start", "prepare", "swap"]

SUMMARY_CAP: Final = prompt.BudgetSplit().summary_cap
"""Most tokens of one summary in stable memory (its `[#id]` opens the whole)."""
CONSOLIDATED: Final = 0.5
"""Share of `Policy.stable` a consolidation fills: the rest is for the messages of the next
compactions, which keep the prefix up to it (a consolidation that filled the whole share was
redone by the very next compaction: in a LongMemEval replay every compaction turn then
repeated nothing past the system prompt)."""
MILESTONE_SHARE: Final = 0.2
"""Share of a stable-memory message's room its milestones may take."""
PREPARE_AT: Final = 0.5
"""How far from the low- to the high-water mark a context must be for its next compaction to
be prepared in the background."""
_ATTEMPTS: Final = 4
# What a root summary cut to the shortest costs in a frontier (`prompt.summary_cap`'s floor of
# 24 tokens, 16 for its tag), with the milestones' share beside it.
_ROOT_COST: Final = int(40 / (1 - MILESTONE_SHARE)) + 1


@dataclass(frozen=True)
class Fixed:
    """What a turn's prompt holds besides its context: tokens of the system prompt and of the
    new messages (with the reply priming)."""

    system: int
    new: int


# -- choosing the compaction point -------------------------------------------------------------


def _fresh_start(items: Sequence[Item], fresh: int) -> int:
    """The seq where the fresh tail starts: the newest items within `fresh` tokens (at least
    the last two), never on a tool result whose call is before it."""
    if not items:
        return 0
    used, index = 0, len(items)
    while index > 0 and (used + items[index - 1].tokens <= fresh or len(items) - index < 2):
        index -= 1
        used += items[index].tokens
    while 0 < index < len(items) and items[index].role == "tool":
        index -= 1
    return items[index].seq if index < len(items) else items[-1].seq + 1


def _cost(item: Item, *, masks: bool, model: str) -> int:
    """What `item` costs in the prompt, masked or whole."""
    return tokens.count_message(masked(item), model=model) if masks else item.tokens


def _costs(items: Sequence[Item], mask_before: int, model: str) -> list[int]:
    return [
        _cost(item, masks=item.maskable and item.seq < mask_before, model=model) for item in items
    ]


def verbatim_start(
    items: Sequence[Item], costs: Sequence[int], *, room: int, protect: int, end: int
) -> int:
    """The first seq kept verbatim so that the items from it on cost at most `room`, never past
    `protect` and never on a tool result: past the results of a compacted call, or, when that
    would pass `protect`, back to the call."""
    total = sum(costs)
    index = 0
    while index < len(items) and total > room and items[index].seq < protect:
        total -= costs[index]
        index += 1
    forward = index
    while forward < len(items) and items[forward].role == "tool":
        forward += 1
    if (items[forward].seq if forward < len(items) else end) <= protect:
        index = forward
    else:
        # Every turn compacted, `protect` past the last of them and short of `end` (the seqs
        # between are off the branch: the answer a regeneration replaces, once the tree has
        # covered its question): no turn is left to step back over.
        while 0 < index < len(items) and items[index].role == "tool":
            index -= 1
    return items[index].seq if index < len(items) else end


def calls_start(items: Sequence[Item], answers_calls: bool, end: int) -> int:
    """Where a compaction must stop: at the assistant message whose calls the new messages
    answer (`answers_calls`: a call and its results are never split), else at `end`."""
    if not answers_calls:
        return end
    for item in reversed(items):
        if item.role == "assistant" and item.message.get("tool_calls"):
            return item.seq
        if item.role != "tool":
            break
    return end


def exchange_start(items: Sequence[Item], answers_calls: bool, end: int) -> int:
    """Where a compaction had better stop: at the question of the exchange whose calls the new
    messages answer (compacted, the model would get tool results and no word of what they are
    for), when the verbatim turns hold it; else at `calls_start`."""
    calls = calls_start(items, answers_calls, end)
    if calls == end:
        # No call to answer: nothing before the new messages is held back.
        return calls
    for item in reversed(items):
        if item.seq >= calls or item.role in ("assistant", "tool"):
            continue
        return item.seq if item.role == "user" else calls
    return calls


# -- compacting --------------------------------------------------------------------------------


@staged("compaction")
async def compact(
    conn: AsyncConnection,
    state: State,
    items: Sequence[Item],
    *,
    limit: int,
    policy: Policy,
    model: str,
    fixed: Fixed,
    end: int,
    protect: int,
    consolidate: bool = False,
) -> State:
    """`state` compacted so that the prompt without its note fits `policy.low` of `limit` (see
    the module docstring). `items` are the verbatim turns from `state.verbatim_from` to `end`;
    none from `protect` on is compacted (a call whose results are the new messages)."""
    enc = tokens.get_encoding(tokens.encoding_name_for_model(model))
    target = int(policy.low * limit) - fixed.system - fixed.new
    live = [item for item in items if item.seq >= state.verbatim_from]
    mask_before = max(state.mask_before, _fresh_start(live, int(policy.fresh * limit)))
    costs = _costs(live, mask_before, model)
    stable = state.stable
    if not consolidate and sum(costs) + sum(part.tokens for part in stable) <= target:
        return state.rebuilt(mask_before=mask_before)
    start = state.verbatim_from
    allowance = 0 if consolidate else sum(part.tokens for part in stable)
    ceiling = int(policy.high * limit) - fixed.system - fixed.new
    covered = await _covered(conn, state)
    point = start
    for _ in range(_ATTEMPTS):
        point = verbatim_start(live, costs, room=target - allowance, protect=protect, end=end)
        if point > covered > start:
            # Compacting only what the tree has summarized loses no summary: preferred while
            # the context stays under the high-water mark.
            near = verbatim_start(live, costs, room=target - allowance, protect=covered, end=end)
            if _kept(live, costs, near) + allowance <= ceiling:
                point = near
        stable = state.stable
        if consolidate or (point > start and _wide(live, start, point, limit)):
            stable = await _consolidated(conn, state, point, limit=limit, policy=policy, enc=enc)
        elif point > start:
            stable = (
                *state.stable,
                await _part(conn, state, start, point, limit=limit, policy=policy, enc=enc),
            )
            if sum(part.tokens for part in stable) > policy.stable * limit:
                stable = await _consolidated(
                    conn, state, point, limit=limit, policy=policy, enc=enc
                )
        over = _kept(live, costs, point) + sum(part.tokens for part in stable) - target
        if over <= 0 or point >= protect:
            break
        allowance += over
    return state.rebuilt(stable=stable, verbatim_from=point, mask_before=max(mask_before, point))


def _kept(items: Sequence[Item], costs: Sequence[int], point: int) -> int:
    return sum(cost for item, cost in zip(items, costs, strict=True) if item.seq >= point)


_COVERED = text(
    "SELECT span_end + 1 FROM nodes WHERE tenant_id = :tenant_id "
    "AND conversation_id = :conversation_id AND level = 1 ORDER BY seq DESC LIMIT 1"
)


async def _covered(conn: AsyncConnection, state: State) -> int:
    """The first seq no segment of the tree covers yet."""
    found = await conn.scalar(
        _COVERED, {"tenant_id": state.tenant_id, "conversation_id": state.conversation_id}
    )
    return int(found or 0)


def _wide(items: Sequence[Item], start: int, point: int, limit: int) -> bool:
    """Whether the messages to compact are too many for a message of their own (the
    conversation grew by several budgets since the last turn): then consolidate."""
    return sum(item.tokens for item in items if start <= item.seq < point) > 4 * limit


@staged("compaction")
async def build(
    conn: AsyncConnection,
    *,
    tenant_id: int,
    conversation_id: int,
    end: int,
    limit: int,
    policy: Policy,
    model: str,
    fixed: Fixed,
    answers_calls: bool,
    previous: State | None = None,
) -> tuple[State, list[Item]]:
    """A first working context for the messages before `end` (or one rebuilt from scratch, in
    place of `previous`, after a branch): the newest turns that fit the low-water mark, and
    stable memory consolidated over the rest; with the verbatim turns read. `answers_calls`:
    the new messages are tool results, whose call must stay."""
    room = int(policy.low * limit) - fixed.system - fixed.new
    fresh = int(policy.fresh * limit)
    items: list[Item] = []
    start, used = end, 0
    # Tool results answer a call that must stay: read back to it even with no room left.
    while start > 0 and (used < room or (answers_calls and not items)):
        page = await read_items(
            conn,
            tenant_id=tenant_id,
            conversation_id=conversation_id,
            start=max(0, start - _PAGE),
            end=start,
            model=model,
        )
        start = max(0, start - _PAGE)
        items[:0] = page
        tail = 0
        used = 0
        for item in reversed(items):
            tail += item.tokens
            used += _cost(item, masks=item.maskable and tail > fresh, model=model)
    state = State(
        tenant_id=tenant_id,
        conversation_id=conversation_id,
        model=model,
        budget=limit,
        verbatim_from=start,
        mask_before=start,
        upto=end,
        version=previous.version if previous is not None else 0,
        compactions=previous.compactions if previous is not None else 0,
    )
    built = await compact(
        conn,
        state,
        items,
        limit=limit,
        policy=policy,
        model=model,
        fixed=fixed,
        end=end,
        protect=exchange_start(items, answers_calls, end),
        consolidate=start > 0,
    )
    return built, [item for item in items if item.seq >= built.verbatim_from]


_PAGE: Final = 256


# -- stable memory -----------------------------------------------------------------------------

_RANGE_SUMMARIES = text(
    "SELECT id, conversation_id, level, seq, span_start, span_end, role, name, text, "
    "created_at, token_count, tool_calls, tool_call_id, parent_id FROM nodes "
    "WHERE tenant_id = :tenant_id AND conversation_id = :conversation_id AND level >= 1 "
    "AND span_start < :end AND span_end >= :start"
)
_RANGE_PINNED = text(
    "SELECT id, conversation_id, level, seq, span_start, span_end, role, name, text, "
    "created_at, token_count, tool_calls, tool_call_id FROM nodes "
    "WHERE tenant_id = :tenant_id AND conversation_id = :conversation_id AND level = 0 "
    "AND pinned AND seq >= :start AND seq < :end AND superseded_at IS NULL "
    "ORDER BY seq DESC LIMIT 32"
)


async def _part(
    conn: AsyncConnection,
    state: State,
    start: int,
    end: int,
    *,
    limit: int,
    policy: Policy,
    enc: Any,
) -> StablePart:
    """The stable-memory message of the messages `start` to `end - 1`: the coarsest summaries
    within them, the segments across their edges, and their milestones."""
    params = {
        "tenant_id": state.tenant_id,
        "conversation_id": state.conversation_id,
        "start": start,
        "end": end,
    }
    rows = list(await conn.execute(_RANGE_SUMMARIES, params))
    inside = {row.id for row in rows if row.span_start >= start and row.span_end < end}
    chosen = [
        retrieval.as_hit(row[:-1], 0.0)
        for row in rows
        if (row.id in inside and row.parent_id not in inside)
        or (row.id not in inside and row.level == 1)
    ]
    header = (
        f"[Memory: messages {start}-{end - 1} of this conversation, summarized{tool_hints.EXPAND}.]"
    )
    return await _write(
        conn, state, chosen, header, start, end, room=int(policy.stable * limit), enc=enc
    )


async def _consolidated(
    conn: AsyncConnection,
    state: State,
    end: int,
    *,
    limit: int,
    policy: Policy,
    enc: Any,
) -> tuple[StablePart, ...]:
    """Stable memory as one message: a frontier of the tree over the messages before `end`."""
    if end <= 0:
        return ()
    tree = await prompt.read_tree(
        conn, tenant_id=state.tenant_id, conversation_id=state.conversation_id, before=end
    )
    roots = sum(1 for node in tree if node.parent_id is None)
    # `CONSOLIDATED` of the share, or more when the tree's roots, each cut short, need it to
    # cover everything (up to the whole share).
    whole = int(policy.stable * limit)
    room = min(whole, max(int(whole * CONSOLIDATED), roots * _ROOT_COST))
    budget = int(room * (1 - MILESTONE_SHARE))
    cap = prompt.summary_cap(roots, budget=budget, cap=SUMMARY_CAP)
    chosen = [node.hit for node in prompt.frontier(tree, budget=budget, cap=cap)]
    guide = f" {policy.tools_guide}" if policy.tools_guide else ""
    header = (
        f"[Memory of this conversation: its first {end:,} messages, summarized (the oldest "
        f"most coarsely), each summary tagged [#id]; the messages since follow verbatim.]{guide}"
    )
    part = await _write(conn, state, chosen, header, 0, end, room=room, enc=enc, cap=cap)
    return (part,)


async def _write(
    conn: AsyncConnection,
    state: State,
    summaries: Sequence[retrieval.Hit],
    header: str,
    start: int,
    end: int,
    *,
    room: int,
    enc: Any,
    cap: int = SUMMARY_CAP,
) -> StablePart:
    """A stable-memory message: `header`, the `summaries`, the milestones of `start`..`end - 1`
    within its share of `room`, and a line per range no summary covers yet."""
    block = MemoryBlock(enc=enc, primary=state.conversation_id)
    for hit in sorted(summaries, key=lambda hit: (hit.span_start, -hit.level)):
        block.add_summary(hit, cap=cap)
    pinned = await conn.execute(
        _RANGE_PINNED,
        {
            "tenant_id": state.tenant_id,
            "conversation_id": state.conversation_id,
            "start": start,
            "end": end,
        },
    )
    for hit in (retrieval.as_hit(row, 0.0) for row in pinned):
        if block.milestone_cost + block.cost_of_message(hit) <= room * MILESTONE_SHARE:
            block.add_milestone(hit)
    lines = [header, block.render()] if block.summaries or block.milestones else [header]
    lines += [
        f"[Messages {first}-{last} are not summarized here{tool_hints.browse(first, last)}.]"
        for first, last in _gaps(summaries, start, end)
    ]
    body = "\n".join(line for line in lines if line)
    count = tokens.count_message({"role": "system", "content": body}, model=state.model)
    return StablePart(
        text=body,
        start=start,
        end=end,
        tokens=count,
        ids=tuple(sorted(hit.node_id for hit in block.milestones)),
    )


def _gaps(summaries: Sequence[retrieval.Hit], start: int, end: int) -> list[tuple[int, int]]:
    """The ranges of `start`..`end - 1` that none of `summaries` covers."""
    gaps: list[tuple[int, int]] = []
    cursor = start
    for hit in sorted(summaries, key=lambda hit: hit.span_start):
        if hit.span_start > cursor:
            gaps.append((cursor, min(hit.span_start, end) - 1))
        cursor = max(cursor, hit.span_end + 1)
        if cursor >= end:
            break
    if cursor < end:
        gaps.append((cursor, end - 1))
    return [(first, last) for first, last in gaps if first <= last]


# -- prepared in the background ----------------------------------------------------------------


def swap(state: State) -> State | None:
    """`state` with the compaction prepared for it swapped in, or None when none is."""
    prepared = state.prepared
    if not prepared or prepared.get("version") != state.version:
        return None
    return state.rebuilt(
        stable=tuple(parts(prepared["stable"])),
        verbatim_from=int(prepared["verbatim_from"]),
        mask_before=int(prepared["mask_before"]),
    )


async def prepare(
    engine: AsyncEngine, *, tenant_id: int, conversation_id: int, policy: Policy
) -> bool:
    """Prepare the conversation's next compaction if its context is past `PREPARE_AT` from the
    low- to the high-water mark and none is prepared for its version; True if one was stored.
    Idempotent; a turn that rebuilt the context meanwhile makes the result moot (not stored)."""
    async with transaction(engine) as conn:
        state = await load(conn, tenant_id=tenant_id, conversation_id=conversation_id)
        if state is None or swap(state) is not None:
            return False
        end = await conn.scalar(
            conversations.select()
            .with_only_columns(conversations.c.next_seq)
            .where(conversations.c.id == conversation_id)
        )
        items = await read_items(
            conn,
            tenant_id=tenant_id,
            conversation_id=conversation_id,
            start=state.verbatim_from,
            end=int(end or 0),
            model=state.model,
        )
        context = render(state, items, policy=policy, model=state.model).tokens
        share = (state.system_tokens + context) / max(state.budget, 1)
        if share < policy.low + PREPARE_AT * (policy.high - policy.low):
            return False
        # The turn that swaps it in is near the high-water mark: take out what brings that
        # down to the low-water mark, not what brings today's context there.
        ahead = replace(policy, low=max(0.0, share - (policy.high - policy.low)))
        compacted = await compact(
            conn,
            replace(state, notes=()),
            items,
            limit=state.budget,
            policy=ahead,
            model=state.model,
            fixed=Fixed(system=state.system_tokens, new=tokens.REPLY_PRIMING_TOKENS),
            end=int(end or 0),
            protect=int(end or 0),
        )
        prepared = {
            "version": state.version,
            "stable": [part_json(part) for part in compacted.stable],
            "verbatim_from": compacted.verbatim_from,
            "mask_before": compacted.mask_before,
        }
        stored = await conn.execute(
            update(working_contexts)
            .where(
                working_contexts.c.conversation_id == conversation_id,
                working_contexts.c.version == state.version,
            )
            .values(prepared=prepared)
        )
    return bool(stored.rowcount)
