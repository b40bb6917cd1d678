"""A turn's prompt from its conversation's working context (`memory.recall.working_context`).

`build(conn, turn, budget, recall, …)` is what `memory.recall.assemble` runs for a conversation
that does not fit its budget, in the caller's transaction:

1. the context is loaded, cut back to the message before the branch point when the turn's
   history branched inside its verbatim turns (`_cut_at`: the prompt repeats the last one up
   to there), or built from scratch when there is none, the history branched inside its
   stable memory or the model's tokenizer changed (`compaction.build`);
2. when the prompt without its note would pass the high-water mark, the context is compacted
   (the compaction prepared in the background, when there is one and it is enough, else one
   computed now), never past the question of the exchange whose calls the new messages answer;
   a prompt that does not fit the budget even so (the new messages take most of it) is
   compacted as far as it goes, and sent without its stable memory if that still does not fit,
   keeping that question while it fits, and then only the call; a turn that still does not fit
   (tool results whose call alone is too large) is refused (`ContextOverflow`);
3. the new message is embedded meanwhile (`recall.embedder` may have started it while the turn
   was stored: `memory.recall.early`; again without the participants' names once the verbatim
   turns tell them, when it names one), and the recall note is chosen
   (`memory.recall.recall_note`), from the candidates prepared after the last reply when they
   cover it (`memory.recall.anticipation.usable`), else by retrieval, whose vector legs run in
   a spare pooled connection beside its full-text leg when the turn did not branch
   (`memory.db.spare`: nothing they read changed in this transaction), in the room
   `Policy.note` gives a message that asks something, never more than the budget leaves; a
   statement gets no note (measured on LoCoMo: a quarter of that room for statements cost 6
   points of cacheable share for 1 point of recall), nor does a turn whose new messages are
   tool results (a note between a call and its results is not allowed), nor a message that
   follows the latest exchange of the verbatim turns more closely than anything outside the
   context (`recall_note`);
4. with `persist`, the context is saved as this turn leaves it (the note kept with
   `Policy.keep_notes`); with `explained` (a dry run), the prompt says why each message of
   the note was picked.

The prompt is the system prompt, the context, the note and the new messages; `marks` are the
message counts where a later prompt may stop repeating it (`memory.recall.reuse`).
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy.ext.asyncio import AsyncConnection

from memory import db, stages, tokens
from memory.errors import ContextOverflow
from memory.recall import anticipation, compaction, explain, recall_note, retrieval
from memory.recall import working_context as wc
from memory.recall.compaction import Fixed
from memory.recall.fusion import Candidates
from memory.recall.working_context import Policy

if TYPE_CHECKING:
    from memory.recall.assemble import Budget, Recall, StoredTurn

__all__ = ["ContextPrompt", "build"]

Message = dict[str, Any]
Change = Literal["kept", "cut", "compacted", "built"]


@dataclass(frozen=True)
class ContextPrompt:
    """A turn's prompt from the working context, what each message is and costs, the
    context's version, and why the note's messages were picked (when asked)."""

    messages: list[Message]
    labels: list[str]
    counts: list[int]
    marks: list[int]
    compacted: bool
    prepared_recall: bool
    version: int
    why: tuple[explain.Why, ...] = ()


async def build(
    conn: AsyncConnection,
    turn: StoredTurn,
    budget: Budget,
    recall: Recall,
    *,
    system: list[Message],
    related: list[int],
    persist: bool,
    explained: bool = False,
) -> ContextPrompt:
    """The prompt for `turn` from its working context (see the module docstring); `related`
    are the same user's other conversations, whose messages a note may recall."""
    policy, model, limit = recall.policy, turn.model, budget.limit
    system = [wc.canonical(m) for m in system]
    new = [wc.canonical(m) for m in turn.new_messages]
    system_counts = tokens.count_each(system, model=model)
    new_counts = tokens.count_each(new, model=model)
    fixed = Fixed(system=sum(system_counts), new=sum(new_counts) + tokens.REPLY_PRIMING_TOKENS)
    answers_calls = bool(new) and new[0].get("role") == "tool"
    # Only a message that asks something gets a note: only its query is embedded.
    query = recall_note.note_query(new)
    share = policy.note if query else 0.0
    vector_task = (
        asyncio.ensure_future(recall_note.embed_query(recall.embedder, query)) if share else None
    )
    fulltext: asyncio.Future[Candidates] | None = None
    try:
        with stages.stage("context"):
            state, items, context, change = await _advance(
                conn, turn, limit=limit, policy=policy, fixed=fixed, answers_calls=answers_calls
            )
        compacted = change == "compacted"
        if fixed.system + context.tokens + fixed.new > limit:
            state, context = await _last_resort(
                conn,
                turn,
                state,
                items,
                limit=limit,
                policy=policy,
                fixed=fixed,
                answers_calls=answers_calls,
            )
            compacted, change = True, "compacted"
        scope = [turn.conversation_id, *related]
        participants = {item.name for item in items if item.name}
        unnamed = retrieval.without_names(query, participants) if vector_task else query
        if vector_task is not None and unnamed != query:
            # A participant's name says nothing about the topic and pulls the vector toward
            # every message that greets them: embedded again without it, as the rebuild does.
            vector_task.cancel()
            vector_task = asyncio.ensure_future(recall_note.embed_query(recall.embedder, unnamed))
        # Small budgets still give a note room for a few messages, when they leave it.
        wanted = max(int(share * limit), recall_note.FLOOR) if share else 0
        room = min(wanted, limit - fixed.system - context.tokens - fixed.new)
        # Candidates prepared on a branch the turn left, or before a compaction, no longer fit.
        fresh = (
            not compacted
            and turn.branched_at is None
            and anticipation.fresh(state, first_seq=turn.first_seq)
        )
        if vector_task is not None and room >= recall_note.MIN_ROOM and not fresh:
            # Retrieval will run: its full-text leg goes while the query is embedded.
            fulltext = asyncio.ensure_future(
                recall_note.fulltext_leg(
                    conn,
                    tenant_id=turn.tenant_id,
                    conversation_ids=scope,
                    query=query,
                    participants=participants,
                    exclude_from=state.verbatim_from,
                    abandoned=recall.abandoned_branches,
                )
            )
        vector = await vector_task if vector_task is not None else None
        prepared = fresh and anticipation.usable(state, first_seq=turn.first_seq, vector=vector)
        # Retrieval's vector legs may run in a spare connection beside its full-text leg when
        # this transaction changed nothing they read: a turn that branched superseded messages.
        beside = (
            vector is not None
            and not prepared
            and room >= recall_note.MIN_ROOM
            and turn.branched_at is None
        )
        spare: AbstractAsyncContextManager[AsyncConnection | None] = (
            db.spare(conn) if beside else nullcontext(None)
        )
        async with spare as aside:
            note = await recall_note.recall(
                conn,
                tenant_id=turn.tenant_id,
                conversation_ids=scope,
                query=query,
                vector=vector,
                prepared=state.recall_ids if prepared else None,
                newest=turn.first_seq - 1,
                exclude_from=state.verbatim_from,
                present=state.present(),
                participants=participants,
                room=room,
                model=model,
                abandoned=recall.abandoned_branches,
                fulltext=fulltext,
                aside=aside,
                explained=explained,
                latest=_latest_exchange(items),
            )
    finally:
        for task in (vector_task, fulltext):
            if task is not None and not task.done():
                task.cancel()
    if persist:
        notes = tuple(kept for kept in state.notes if kept.before < turn.first_seq)
        if note is not None and policy.keep_notes:
            notes += (wc.Note(before=turn.first_seq, text=note.text, ids=note.ids),)
        with stages.stage("save"):
            # A turn that kept the prefix writes only what it changed.
            await (wc.advance if change == "kept" else wc.save)(
                conn,
                replace(
                    state,
                    model=model,
                    budget=limit,
                    tokens=context.tokens + (note.tokens if note and policy.keep_notes else 0),
                    system_tokens=fixed.system,
                    upto=turn.next_seq if turn.next_seq is not None else turn.first_seq,
                    notes=notes,
                    compactions=state.compactions + int(compacted),
                ),
            )
    noted = [] if note is None else [(wc.note_message(note.text), note.tokens)]
    stable = context.labels.count("stable")
    return ContextPrompt(
        messages=[*system, *context.messages, *(m for m, _ in noted), *new],
        labels=["system"] * len(system)
        + context.labels
        + ["note"] * len(noted)
        + ["new"] * len(new),
        counts=[*system_counts, *context.counts, *(count for _, count in noted), *new_counts],
        marks=[len(system) + count for count in range(stable + 1)]
        + [len(system) + len(context.messages)],
        compacted=compacted,
        prepared_recall=prepared,
        version=state.version,
        why=note.why if note is not None else (),
    )


async def _last_resort(
    conn: AsyncConnection,
    turn: StoredTurn,
    state: wc.State,
    items: list[wc.Item],
    *,
    limit: int,
    policy: Policy,
    fixed: Fixed,
    answers_calls: bool,
) -> tuple[wc.State, wc.Rendered]:
    """A context that does not fit the budget even at the low-water mark (the new messages take
    most of it), compacted as far as it goes, and rendered for this turn alone without stable
    memory when that is what fits: first keeping the question of the exchange the new messages
    continue, then only the call they answer. `ContextOverflow` when not even that fits."""
    protects = dict.fromkeys(
        (
            compaction.exchange_start(items, answers_calls, turn.first_seq),
            compaction.calls_start(items, answers_calls, turn.first_seq),
        )
    )
    need = 0
    for protect in protects:
        state = await compaction.compact(
            conn,
            state,
            items,
            limit=limit,
            policy=replace(policy, low=0.0),
            model=turn.model,
            fixed=fixed,
            end=turn.first_seq,
            protect=protect,
            consolidate=True,
        )
        for shown in (state, replace(state, stable=())):
            context = wc.render(shown, items, policy=policy, model=turn.model)
            need = fixed.system + context.tokens + fixed.new
            if need <= limit:
                return state, context
    # What is left is the call the new messages answer, which no compaction splits from them:
    # sent as is, the prompt would pass the budget.
    raise ContextOverflow(
        f"the system prompt, the new tool results and the tool call they answer need {need} "
        f"tokens, more than the budget of {limit} leaves for messages"
    )


async def _advance(
    conn: AsyncConnection,
    turn: StoredTurn,
    *,
    limit: int,
    policy: Policy,
    fixed: Fixed,
    answers_calls: bool,
) -> tuple[wc.State, list[wc.Item], wc.Rendered, Change]:
    """The context as this turn finds it (built or rebuilt, compacted if it must be), its
    verbatim turns, their rendering, and what changed: nothing (`kept`), a cut back to a
    branch point (`cut`), a compaction, or a build."""
    state = await wc.load(conn, tenant_id=turn.tenant_id, conversation_id=turn.conversation_id)
    kept: Change = "kept"
    if state is not None and (cut := _cut(state, turn)) is not None:
        state, kept = _cut_at(state, cut), "cut"
    if state is None or _branched(state, turn):
        built, items = await compaction.build(
            conn,
            tenant_id=turn.tenant_id,
            conversation_id=turn.conversation_id,
            end=turn.first_seq,
            limit=limit,
            policy=policy,
            model=turn.model,
            fixed=fixed,
            answers_calls=answers_calls,
            previous=state,
        )
        return built, items, wc.render(built, items, policy=policy, model=turn.model), "built"
    items = await wc.read_items(
        conn,
        tenant_id=turn.tenant_id,
        conversation_id=turn.conversation_id,
        start=state.verbatim_from,
        end=turn.first_seq,
        model=turn.model,
    )
    context = wc.render(state, items, policy=policy, model=turn.model)
    if fixed.system + context.tokens + fixed.new <= policy.high * limit:
        return state, items, context, kept
    protect = compaction.exchange_start(items, answers_calls, turn.first_seq)
    swapped = compaction.swap(state)
    if swapped is not None and swapped.verbatim_from <= protect:
        context = wc.render(swapped, items, policy=policy, model=turn.model)
        # Enough if it leaves the next compaction at least half the usual way off.
        if fixed.system + context.tokens + fixed.new <= (policy.low + policy.high) / 2 * limit:
            return swapped, items, context, "compacted"
        state = replace(swapped, version=state.version)
    compacted = await compaction.compact(
        conn,
        state,
        items,
        limit=limit,
        policy=policy,
        model=turn.model,
        fixed=fixed,
        end=turn.first_seq,
        protect=protect,
    )
    return (
        compacted,
        items,
        wc.render(compacted, items, policy=policy, model=turn.model),
        "compacted",
    )


def _latest_exchange(items: list[wc.Item]) -> list[int]:
    """The node ids of the latest exchange among the verbatim turns: the last user message and
    what followed it (none without a user message)."""
    for index in range(len(items) - 1, -1, -1):
        if items[index].role == "user":
            return [item.node_id for item in items[index:]]
    return []


def _cut(state: wc.State, turn: StoredTurn) -> int | None:
    """Where the turn's history branched, when that is inside the context's verbatim turns (an
    edit, a regenerate, a client that rewrote its own messages: `memory.write.rewritten`)."""
    at = turn.branched_at
    return at if at is not None and state.verbatim_from <= at < state.upto else None


def _cut_at(state: wc.State, branched_at: int) -> wc.State:
    """The context cut back to the messages before `branched_at`: its stable memory and the
    verbatim turns (and kept notes) before that stay, so the prompt still repeats the last one
    up to there, where a rebuild changed it whole. A compaction prepared over the abandoned
    branch is dropped (`rebuilt`)."""
    notes = tuple(note for note in state.notes if note.before < branched_at)
    return state.rebuilt(upto=branched_at, notes=notes)


def _branched(state: wc.State, turn: StoredTurn) -> bool:
    """Whether the turn's history branched inside what the context already holds before its
    verbatim turns (its stable memory: an edit there), the model's tokenizer changed, or the
    context is ahead of the conversation: then it is rebuilt."""
    if turn.branched_at is not None and turn.branched_at < state.upto:
        return True
    # Another model's tokenizer: the stable memory's counts, and its cache, are not this one's.
    if tokens.encoding_name_for_model(turn.model) != tokens.encoding_name_for_model(state.model):
        return True
    return state.verbatim_from > turn.first_seq
