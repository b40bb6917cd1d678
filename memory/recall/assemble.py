"""The prompt for one stored turn: the read path's one entry point (SPEC §6).

`assemble(engine, turn, budget, …)` returns the messages to send upstream and their figures. A
conversation that fits its budget goes as the client sent it (or, when the client sent only its
new messages, as stored); otherwise the prompt is rebuilt from memory by the prompt builder
(`memory.recall.prompt`). `dry_run` is the same for a question that is not stored.

A `StoredTurn` is how a request's messages divide once the write path has stored them: the
leading system prompt, the messages new to the conversation (stored from `first_seq` on) and,
when the request held the whole history, that history. A `Budget` is the room the prompt's
messages get: the tokens requested, capped by the model's window less its output reserve
(`memory.recall.prompt.budget_for`), less what tool definitions will take. `check_fits` refuses
a turn whose system prompt and new messages alone exceed it (`ContextOverflow`); the caller
runs it inside the transaction that stores the turn, so that such a turn stores nothing.
"""

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from memory import tokens
from memory.db import transaction
from memory.embeddings import Embedder
from memory.errors import ContextOverflow, ProviderError
from memory.recall import prompt
from memory.schema import conversations
from memory.stages import staged
from memory.write import store

log = logging.getLogger(__name__)

Message = dict[str, Any]

SYSTEM_ROLES = ("system", "developer")
_QUERY_CHARS = 2000
_RELATED_LIMIT = 20
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
    definitions (`reserved`)."""

    limit: int
    reserved: int

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
        adds) and what the client's own tool definitions cost."""
        model = str(body.get("model", ""))
        reserved = tools_room + _tools_cost(body)
        total = prompt.budget_for(
            model,
            requested=requested if requested is not None else rules.default,
            default_window=rules.window,
            default_reserve=rules.output_reserve,
            max_output=_max_output(body),
        )
        return cls(limit=total - reserved, reserved=reserved)


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
        new_count, first_seq = len(appended.node_ids), appended.first_seq
        if new_count == 0:  # a resent history with nothing new: the last message is the question
            new_count, first_seq = 1, max(0, first_seq - 1)
        system = leading_system(messages)
        whole = len(messages) == first_seq + new_count
        return cls(
            tenant_id=tenant_id,
            conversation_id=appended.conversation.id,
            model=model,
            system=system,
            # The leading system prompt goes first, never again among the new messages.
            new_messages=messages[max(len(messages) - new_count, len(system)) :],
            first_seq=first_seq,
            whole=messages if whole else None,
            stored_tokens=appended.token_count,
            user=appended.user_id,
        )


@dataclass(frozen=True)
class Assembled:
    """The prompt's messages, their tokens, the whole history's tokens, and whether the
    prompt was rebuilt from memory rather than forwarded as the client sent it."""

    messages: list[Message]
    tokens: int
    full_tokens: int
    rebuilt: bool


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
    engine: AsyncEngine,
    turn: StoredTurn,
    budget: Budget,
    *,
    embedder: Embedder,
    cross_conversation: bool,
    tools_guide: bool,
) -> Assembled:
    """The prompt for `turn` within `budget` (see the module docstring).

    The messages and `budget.reserved` together stay within the budget. `cross_conversation`
    lets recall draw on the same user's other conversations; `tools_guide` tells the memory
    message to say how to use the memory tools (when they are offered)."""
    stored_tokens, user = turn.stored_tokens, turn.user
    if stored_tokens is None:
        async with transaction(engine) as conn:
            stored_tokens, user = await _token_count_and_user(conn, turn)
    full = stored_tokens + turn.unstored_tokens + tokens.REPLY_PRIMING_TOKENS
    if full <= budget.limit * 1.25:  # stored counts may come from another model's tokenizer
        verbatim = turn.whole
        if verbatim is None:
            async with transaction(engine) as conn:
                kept = await _history(conn, turn, before=turn.first_seq)
            stored_system = leading_system(kept)
            verbatim = [
                *(turn.system or stored_system),
                *kept[len(stored_system) :],
                *turn.new_messages,
            ]
        count = tokens.count_messages(verbatim, model=turn.model)
        if count <= budget.limit:
            return Assembled(messages=verbatim, tokens=count, full_tokens=full, rebuilt=False)
    async with transaction(engine) as conn:
        related: list[int] = []
        if cross_conversation and user is not None:
            related = await _related(conn, turn, user)
        system = turn.system or await _stored_system(conn, turn)
        built = await prompt.build(
            conn,
            tenant_id=turn.tenant_id,
            conversation_id=turn.conversation_id,
            system=system,
            new_messages=turn.new_messages,
            new_from=turn.first_seq,
            query=query_of(turn.new_messages),
            embed=lambda text: _embed(embedder, text),
            budget=budget.limit + budget.reserved,
            model=turn.model,
            reserved_tokens=budget.reserved,
            conversation_ids=related,
            stored_messages=turn.first_seq,
            stored_tokens=stored_tokens,
            tools_guide=prompt.TOOLS_GUIDE if tools_guide else None,
        )
    return Assembled(messages=built.messages, tokens=built.tokens, full_tokens=full, rebuilt=True)


async def dry_run(
    engine: AsyncEngine,
    *,
    tenant_id: int,
    external_id: str,
    query: str,
    budget: int | None,
    rules: BudgetRules,
    tools_room: int,
    embedder: Embedder,
    cross_conversation: bool,
    model: str = "gpt-4o",
) -> Assembled:
    """The prompt `assemble` would send if the stored conversation `external_id` received
    `query` as a new user message; nothing is stored. `tools_room` is what the memory tools'
    definitions would take (0 when they would not be offered)."""
    async with transaction(engine) as conn:
        ref = await store.find_conversation(conn, tenant_id=tenant_id, external_id=external_id)
        next_seq = await conn.scalar(
            select(conversations.c.next_seq).where(conversations.c.id == ref.id)
        )
    question = {"role": "user", "content": query}
    turn = StoredTurn(
        tenant_id=tenant_id,
        conversation_id=ref.id,
        model=model,
        system=[],
        new_messages=[question],
        first_seq=int(next_seq or 0),
        whole=None,
        unstored_tokens=tokens.count_message(question, model=model),
    )
    body = {"model": model, "messages": [question]}
    return await assemble(
        engine,
        turn,
        Budget.of(body, rules, requested=budget, tools_room=tools_room),
        embedder=embedder,
        cross_conversation=cross_conversation,
        tools_guide=tools_room > 0,
    )


def leading_system(messages: Sequence[Message]) -> list[Message]:
    """The system (or developer) messages a history starts with."""
    count = 0
    while count < len(messages) and messages[count].get("role") in SYSTEM_ROLES:
        count += 1
    return list(messages[:count])


def query_of(new_messages: Sequence[Mapping[str, Any]]) -> str:
    """What retrieval looks for: the new user messages' text (else any new text)."""
    texts = [tokens.message_text(m) for m in new_messages if m.get("role") == "user"]
    if not any(texts):
        texts = [tokens.message_text(m) for m in new_messages]
    return "\n".join(t for t in texts if t)[-_QUERY_CHARS:]


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
async def _related(conn: AsyncConnection, turn: StoredTurn, user: str) -> list[int]:
    """The tenant's other conversations of the same `user`, most recent first."""
    rows = await conn.execute(
        select(conversations.c.id)
        .where(
            conversations.c.tenant_id == turn.tenant_id,
            conversations.c.user_id == user,
            conversations.c.id != turn.conversation_id,
        )
        .order_by(conversations.c.updated_at.desc())
        .limit(_RELATED_LIMIT)
    )
    return [int(row.id) for row in rows]


@staged("read")
async def _stored_system(conn: AsyncConnection, turn: StoredTurn) -> list[Message]:
    """The stored conversation's leading system messages (for clients that send only new
    messages without repeating their system prompt)."""
    return leading_system(await _history(conn, turn, before=_SYSTEM_LOOKAHEAD))


@staged("read")
async def _history(conn: AsyncConnection, turn: StoredTurn, *, before: int) -> list[Message]:
    return await store.history(
        conn, tenant_id=turn.tenant_id, conversation_id=turn.conversation_id, before_seq=before
    )


@staged("embed")
async def _embed(embedder: Embedder, text: str) -> list[float] | None:
    """The query's vector, or None when the embedder fails (retrieval is then full-text)."""
    try:
        [vector] = await embedder.embed([text])
    except ProviderError:
        log.warning("query embedding failed; retrieving by full text only", exc_info=True)
        return None
    return vector


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
