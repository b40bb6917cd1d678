"""The prompt for one stored turn: the read path's one entry point (SPEC §6).

`assemble(conn, turn, budget, recall, …)` returns the messages to send upstream and their
figures. A conversation that fits its budget goes as the client sent it (or, when the client
sent only its new messages, as stored); when such a turn moved the branch inside the working
context, the context is dropped, to be built afresh (`working_context.forget`). Otherwise the
prompt comes from the conversation's working context (`memory.recall.working_context`):
compacted first when the turn would pass the high-water mark (`memory.recall.compaction`: the
compaction prepared in the background when there is one, else computed now), then the turn's
recall note (`memory.recall.recall_note`, from the candidates prepared after the last reply
when they cover the new message: `memory.recall.anticipation`) and the new messages; the
context is saved with the turn, in the caller's transaction. With `Recall.mode` `rebuild`, the
prompt is instead rebuilt for each turn's query by the prompt builder (`memory.recall.prompt`).
Every prompt is measured against the previous one (`memory.recall.reuse`). `dry_run` is the
same for a question that is not stored, and saves nothing.

A `StoredTurn` is how a request's messages divide once the write path has stored them: the
leading system prompt, the messages new to the conversation (stored from `first_seq` on) and,
when the request held the whole history, that history. A `Budget` is the room the prompt's
messages get: the tokens requested, capped by the model's window less its output reserve
(`memory.recall.prompt.budget_for`), less what tool definitions will take. `check_fits` refuses
a turn whose system prompt and new messages alone exceed it (`ContextOverflow`); the caller
runs it inside the transaction that stores the turn, so that such a turn stores nothing.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory import tokens
from memory.db import transaction
from memory.embeddings import Embedder
from memory.errors import ContextOverflow
from memory.recall import context_prompt, explain, prompt, reuse, tool_hints, working_context
from memory.recall.recall_note import embed_query, note_query, query_of, related_conversations
from memory.recall.working_context import Policy
from memory.schema import conversations
from memory.stages import staged
from memory.write import chains, store

Message = dict[str, Any]

_SYSTEM_LOOKAHEAD = 4


@dataclass(frozen=True)
class BudgetRules:
    """The budget settings: what a turn gets when it asks for none, and the window and output
    reserve assumed for models the table of `memory.recall.prompt` does not know."""

    default: int
    window: int
    output_reserve: int


@dataclass(frozen=True)
class Budget:
    """The tokens a prompt's messages may take (`limit`), and those kept beside them for tool
    definitions (`reserved`): the client's and, `tools_room` of them, the memory tools'."""

    limit: int
    reserved: int
    tools_room: int = 0

    @classmethod
    def of(
        cls,
        body: Mapping[str, Any],
        rules: BudgetRules,
        *,
        requested: int | None,
        tools_room: int,
    ) -> "Budget":
        """The budget of a chat request `body`: `requested` (else the default), capped by the
        model's window less its output reserve, less `tools_room` (definitions the gateway
        adds) and what the client's own tool definitions cost. A budget that would leave the
        messages less than `SMALLEST` beside the gateway's definitions goes without them: they
        would take most of it (a 76-token question was refused at a budget of 400)."""
        model = str(body.get("model", ""))
        total = prompt.budget_for(
            model,
            requested=requested if requested is not None else rules.default,
            default_window=rules.window,
            default_reserve=rules.output_reserve,
            max_output=_max_output(body),
        )
        client = _tools_cost(body)
        if total - client - tools_room < SMALLEST:
            tools_room = 0
        reserved = tools_room + client
        return cls(limit=total - reserved, reserved=reserved, tools_room=tools_room)


SMALLEST: Final = 256
"""The fewest tokens a budget keeps for messages beside the memory tools' definitions."""


@dataclass(frozen=True)
class StoredTurn:
    """A request's messages once stored (see the module docstring)."""

    tenant_id: int
    conversation_id: int
    model: str
    system: list[Message]
    new_messages: list[Message]
    first_seq: int
    whole: list[Message] | None
    """The request's messages, when they are the whole stored history."""
    stored_tokens: int | None = None
    """Tokens the conversation holds, when just read (else `assemble` reads them)."""
    user: str | None = None
    unstored_tokens: int = 0
    """Tokens of new messages that are not stored (a dry run's question)."""
    next_seq: int | None = None
    """The conversation's next seq once the turn is stored (None: after the new messages)."""
    branched_at: int | None = None
    """The first stored seq this turn's history superseded (an edit, a regenerate)."""
    previous_fingerprint: Any = None
    """The fingerprint of the conversation's last prompt (`memory.recall.reuse`)."""

    @classmethod
    def of(
        cls,
        messages: list[Message],
        appended: store.Appended,
        *,
        tenant_id: int,
        model: str,
    ) -> "StoredTurn":
        """How the request's `messages` divide, given what the write path `appended`."""
        first_seq = appended.first_seq
        if not appended.node_ids:  # a resent history with nothing new: the last message asks
            first_seq = max(0, first_seq - 1)
        system = leading_system(messages)
        return cls(
            tenant_id=tenant_id,
            conversation_id=appended.conversation.id,
            model=model,
            system=system,
            new_messages=_new_part(messages, len(appended.node_ids), system=len(system)),
            first_seq=first_seq,
            whole=messages if appended.whole else None,
            stored_tokens=appended.token_count,
            user=appended.user_id,
            next_seq=appended.first_seq + len(appended.node_ids),
            branched_at=appended.branched_at,
            previous_fingerprint=appended.prompt_fingerprint,
        )


@dataclass(frozen=True)
class Recall:
    """How the read path recalls: the query embedder, whether the same user's other
    conversations count, the working context's policy, whether prompts are built from the
    working context (`working`) or rebuilt for each turn's query (`rebuild`), and whether
    messages off their conversation's current branch may be recalled."""

    embedder: Embedder
    cross_conversation: bool = True
    policy: Policy = field(default_factory=Policy)
    mode: Literal["working", "rebuild"] = "working"
    abandoned_branches: bool = False
    """Recall also draws on messages that left their conversation's current branch."""


@dataclass(frozen=True)
class Assembled:
    """The prompt's messages, their tokens, the whole history's tokens, and whether the
    prompt was rebuilt from memory rather than forwarded as the client sent it; what each
    message is (`labels`: system, stable, verbatim, note, new; `memory` for a rebuilt turn's
    memory message, `history` for a forwarded one's), the tokens that repeat the previous
    prompt's prefix and the prompt's fingerprint (`memory.recall.reuse`), and whether the
    working context was compacted for it and its note came from prepared candidates. When
    asked (`explained`), why each message the recall note (or a rebuilt turn's memory
    message) quotes was picked (`why`)."""

    messages: list[Message]
    tokens: int
    full_tokens: int
    rebuilt: bool
    labels: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    """Tokens of each message (the prompt's `tokens` adds the reply priming)."""
    reused: int = 0
    fingerprint: list[Any] | None = None
    compacted: bool = False
    prepared_recall: bool = False
    context_version: int | None = None
    """The working context's version the prompt came from (None: not from one)."""
    why: list[explain.Why] = field(default_factory=list)

    @property
    def reuse(self) -> float:
        """The share of the prompt's tokens that repeat the previous prompt's prefix."""
        return self.reused / self.tokens if self.tokens else 0.0


def _new_part(messages: list[Message], count: int, *, system: int) -> list[Message]:
    """The last `count` of `messages` (the last one when none is new: a resent history's
    question), never the leading `system` messages: the system prompt goes first, never again
    among the new messages."""
    return messages[max(len(messages) - max(count, 1), system) :]


def query_ahead(
    messages: list[Message],
    *,
    new_from: int,
    stored_tokens: int,
    budget: Budget,
    recall: Recall,
    model: str,
) -> str:
    """The query `assemble` will embed for a request's `messages`, whose new ones start at
    `new_from` (`len(messages)`: none is new), on a conversation that held `stored_tokens`
    before them, as far as it can be told before they are stored (`memory.recall.early`): ""
    when the conversation still fits `budget` (it goes as sent) or the turn asks nothing."""
    new = _new_part(messages, len(messages) - new_from, system=len(leading_system(messages)))
    if stored_tokens + tokens.count_messages(new, model=model) <= budget.limit:
        return ""
    return _query(new, recall)


def query_guess(messages: list[Message], *, recall: Recall) -> str:
    """The query `query_ahead` most likely finds, guessed before the conversation is identified
    (for one past its budget: `memory.recall.early`): a request's trailing user messages are
    usually its new ones, whether the client resends its history or sends the new message
    alone after its system prompt."""
    start = len(messages)
    while start > 0 and messages[start - 1].get("role") == "user":
        start -= 1
    return _query(messages[start:], recall)


def _query(new: list[Message], recall: Recall) -> str:
    return query_of(new) if recall.mode == "rebuild" else note_query(new)


def check_fits(turn: StoredTurn, budget: Budget) -> None:
    """`ContextOverflow` when the system prompt and the new messages alone exceed the budget."""
    need = tokens.count_messages([*turn.system, *turn.new_messages], model=turn.model)
    if need > budget.limit:
        raise ContextOverflow(
            f"the system prompt and the new messages need {need} tokens, more than the "
            f"{max(budget.limit, 0)} a budget of {budget.limit + budget.reserved} leaves after "
            f"{budget.reserved} for tool definitions (MEMSTRATA_CONTEXT_BUDGET or "
            "X-Memstrata-Budget, capped by the model's window less its reply)"
        )


async def assemble(
    conn: AsyncConnection,
    turn: StoredTurn,
    budget: Budget,
    recall: Recall,
    *,
    tools_guide: bool,
    persist: bool = True,
    explained: bool = False,
) -> Assembled:
    """The prompt for `turn` within `budget` (see the module docstring), in the caller's
    transaction, which holds the conversation's row lock when `persist` (the working context
    is saved with the turn; a dry run saves nothing).

    The messages and `budget.reserved` together stay within the budget. `tools_guide`: the
    memory tools are offered, so a rebuilt memory message says how to use them, and a working
    context keeps its hints of them (`tool_hints`); `explained` says why each recalled message
    was picked."""
    stored_tokens, user = turn.stored_tokens, turn.user
    if stored_tokens is None:
        stored_tokens, user = await _token_count_and_user(conn, turn)
    full = stored_tokens + turn.unstored_tokens + tokens.REPLY_PRIMING_TOKENS
    if full <= budget.limit * 1.25:  # stored counts may come from another model's tokenizer
        verbatim = turn.whole
        if verbatim is None:
            kept = await _history(conn, turn, before=turn.first_seq)
            stored_system = leading_system(kept)
            verbatim = [
                *(turn.system or await _replaced_system(conn, turn) or stored_system),
                *kept[len(stored_system) :],
                *turn.new_messages,
            ]
        counts = tokens.count_each(verbatim, model=turn.model)
        if sum(counts) + tokens.REPLY_PRIMING_TOKENS <= budget.limit:
            if persist and turn.branched_at is not None:
                # The working context does not see this turn's branch: dropped if it held
                # the messages the branch left (`working_context.forget`).
                await working_context.forget(
                    conn,
                    tenant_id=turn.tenant_id,
                    conversation_id=turn.conversation_id,
                    branched_at=turn.branched_at,
                )
            head = len(leading_system(verbatim))
            labels = ["system"] * head + ["history"] * (len(verbatim) - head)
            return _measured(turn, verbatim, counts, labels, full=full, rebuilt=False)
    related: list[int] = []
    if recall.cross_conversation and user is not None:
        related = await related_conversations(
            conn, tenant_id=turn.tenant_id, conversation_id=turn.conversation_id, user=user
        )
    system = turn.system or await _stored_system(conn, turn)
    if recall.mode == "rebuild":
        built = await prompt.build(
            conn,
            tenant_id=turn.tenant_id,
            conversation_id=turn.conversation_id,
            system=system,
            new_messages=turn.new_messages,
            new_from=turn.first_seq,
            query=query_of(turn.new_messages),
            embed=lambda text: embed_query(recall.embedder, text),
            budget=budget.limit + budget.reserved,
            model=turn.model,
            reserved_tokens=budget.reserved,
            conversation_ids=related,
            stored_messages=turn.first_seq,
            stored_tokens=stored_tokens,
            tools_guide=prompt.TOOLS_GUIDE if tools_guide else None,
            abandoned=recall.abandoned_branches,
            explained=explained,
        )
        counts = tokens.count_each(built.messages, model=turn.model)
        return _measured(
            turn, built.messages, counts, built.labels, full=full, rebuilt=True, why=built.why
        )
    context = await context_prompt.build(
        conn,
        turn,
        budget,
        recall,
        system=system,
        related=related,
        persist=persist,
        explained=explained,
    )
    messages, counts = context.messages, context.counts
    if not tools_guide:
        messages, counts = tool_hints.without(messages, context.labels, counts, model=turn.model)
    return _measured(
        turn,
        messages,
        counts,
        context.labels,
        full=full,
        rebuilt=True,
        marks=context.marks,
        compacted=context.compacted,
        prepared_recall=context.prepared_recall,
        context_version=context.version,
        why=context.why,
    )


def _measured(
    turn: StoredTurn,
    messages: list[Message],
    counts: Sequence[int],
    labels: list[str],
    *,
    full: int,
    rebuilt: bool,
    marks: Sequence[int] = (),
    compacted: bool = False,
    prepared_recall: bool = False,
    context_version: int | None = None,
    why: Sequence[explain.Why] = (),
) -> Assembled:
    """The prompt with its reuse of the previous prompt and its own fingerprint."""
    system = len(leading_system(messages))
    repeated, fingerprint = reuse.measure(
        turn.previous_fingerprint, messages, counts, [system, *marks]
    )
    return Assembled(
        messages=messages,
        tokens=sum(counts) + tokens.REPLY_PRIMING_TOKENS,
        full_tokens=full,
        rebuilt=rebuilt,
        labels=labels,
        counts=list(counts),
        reused=repeated,
        fingerprint=fingerprint,
        compacted=compacted,
        prepared_recall=prepared_recall,
        context_version=context_version,
        why=list(why),
    )


async def dry_run(
    engine: AsyncEngine,
    *,
    tenant_id: int,
    external_id: str,
    query: str,
    budget: int | None,
    rules: BudgetRules,
    tools_room: int,
    recall: Recall,
    model: str = "gpt-4o",
) -> Assembled:
    """The prompt `assemble` would send if the stored conversation `external_id` received
    `query` as a new user message, with why each recalled message was picked; nothing is
    stored. `tools_room` is what the memory tools' definitions would take (0 when they would
    not be offered)."""
    question = {"role": "user", "content": query}
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=external_id)
        row = (
            await conn.execute(
                select(conversations.c.next_seq, conversations.c.prompt_fingerprint).where(
                    conversations.c.id == ref.id
                )
            )
        ).one()
        turn = StoredTurn(
            tenant_id=tenant_id,
            conversation_id=ref.id,
            model=model,
            system=[],
            new_messages=[question],
            first_seq=int(row.next_seq or 0),
            whole=None,
            unstored_tokens=tokens.count_message(question, model=model),
            next_seq=int(row.next_seq or 0),
            previous_fingerprint=row.prompt_fingerprint,
        )
        body = {"model": model, "messages": [question]}
        planned = Budget.of(body, rules, requested=budget, tools_room=tools_room)
        return await assemble(
            conn,
            turn,
            planned,
            recall,
            tools_guide=planned.tools_room > 0,
            persist=False,
            explained=True,
        )


def leading_system(messages: Sequence[Message]) -> list[Message]:
    """The system (or developer) messages a history starts with."""
    count = 0
    while count < len(messages) and messages[count].get("role") in chains.SYSTEM_ROLES:
        count += 1
    return list(messages[:count])


@staged("read")
async def _token_count_and_user(conn: AsyncConnection, turn: StoredTurn) -> tuple[int, str | None]:
    row = (
        await conn.execute(
            select(conversations.c.token_count, conversations.c.user_id).where(
                conversations.c.id == turn.conversation_id,
                conversations.c.tenant_id == turn.tenant_id,
            )
        )
    ).one()
    return int(row.token_count), row.user_id


@staged("read")
async def _stored_system(conn: AsyncConnection, turn: StoredTurn) -> list[Message]:
    """The conversation's system prompt, for clients that send only new messages without
    repeating theirs: the latest that replaced it, else the messages it opens with."""
    return await _replaced_system(conn, turn) or leading_system(
        await _history(conn, turn, before=_SYSTEM_LOOKAHEAD)
    )


@staged("read")
async def _replaced_system(conn: AsyncConnection, turn: StoredTurn) -> list[Message]:
    return await store.latest_system_prompt(
        conn,
        tenant_id=turn.tenant_id,
        conversation_id=turn.conversation_id,
        before_seq=turn.first_seq,
    )


@staged("read")
async def _history(conn: AsyncConnection, turn: StoredTurn, *, before: int) -> list[Message]:
    return await store.history(
        conn, tenant_id=turn.tenant_id, conversation_id=turn.conversation_id, before_seq=before
    )


def _tools_cost(body: Mapping[str, Any]) -> int:
    """Tokens the client's own tool schemas cost in the prompt (an estimate)."""
    tools = body.get("tools")
    if not tools:
        return 0
    model = str(body.get("model", ""))
    return tokens.count_text(json.dumps(tools, separators=(",", ":")), model=model)


def _max_output(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
