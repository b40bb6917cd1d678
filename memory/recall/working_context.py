"""The working context of a conversation: the stable part of its last prompt, persisted (SPEC §6).

A conversation that no longer fits its budget is sent, turn after turn, the same growing
prompt, so that a provider can cache its prefix:

    client system prompt → stable memory → verbatim turns → (recall note) → new messages

* **Stable memory**: one `system` message per compaction since the last consolidation
  (`StablePart`), each holding the summaries of the messages that compaction took out of the
  verbatim turns, tagged `[#id]`, and the milestones among them, verbatim (`memory.recall.
  compaction` writes them). Its text is stored: it never changes until a consolidation.
* **Verbatim turns**: every stored message from the compaction point `verbatim_from` on, in
  order, the system messages the conversation opens with aside (the request's own system
  prompt goes first; a system message within the history is a turn like any other); a
  tool result before `mask_before` of more than `MASK_MIN_TOKENS` is masked (`masked()`: its
  node id, its size, and "memory_expand to read").
* **Recall notes** kept since the last compaction (`Note`), each before the message it was
  recalled for (`memory.recall.recall_note`).

`State` is the row of `memory.schema.working_contexts`: what the prompt is rebuilt from, with
the stored messages. `render()` rebuilds it deterministically: the same state and the same
stored messages give the same messages, serialized to the same bytes (`canonical()`: fixed key
order, nested keys sorted), in every process. A turn adds its new messages (rendered
`canonical()` too, so the next prompt, reading them from storage, repeats them byte for byte)
and the note; the prompt changes before its end only when the state is rebuilt (a compaction,
or a branch: `version` then grows).

`load` reads the state (the caller holds the conversation's row lock when it means to change
it); `save` writes it back, and `advance` writes what a turn that kept the prefix changed (its
counts, how far it reaches, its notes) without rewriting the stable memory. `forget` drops a
context that a branch moved inside of on a turn that did not use it (one that fit its budget).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Final

from sqlalchemy import BigInteger, bindparam, case, func, null, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from memory import tokens
from memory.db import AnyRow
from memory.recall import tool_hints
from memory.schema import working_contexts
from memory.write import appends, chains, store

__all__ = [
    "MASK_MIN_TOKENS",
    "Item",
    "Note",
    "Policy",
    "Rendered",
    "StablePart",
    "State",
    "advance",
    "canonical",
    "forget",
    "load",
    "masked",
    "read_items",
    "render",
    "save",
]

MASK_MIN_TOKENS: Final = 64
"""Tool results this small are never masked: the placeholder would save next to nothing."""


KEPT_TOKENS: Final = 4_000_000
"""Most tokens of verbatim messages a process keeps decoded and counted (`read_items`), over all
conversations: a few tens of MB."""


@dataclass(frozen=True)
class Policy:
    """How the working context spends the budget (shares of it)."""

    high: float = 0.85
    """A turn whose prompt without its note (system prompt, context, new messages) would pass
    this share compacts first."""
    low: float = 0.45
    """A compaction rebuilds the context so that the prompt without its note takes this share."""
    note: float = 0.2
    """Most the recall note of a message that asks something (`memory.recall.query.asks`) may
    take, never more than the budget leaves; a statement gets none."""
    keep_notes: bool = False
    """Notes stay in the context until the next compaction (else: sent with their turn only)."""
    fresh: float = 0.15
    """The newest turns within this share are the fresh tail: their tool results stay whole."""
    stable: float = 0.25
    """Stable memory past this share is consolidated into one message."""
    tools_guide: str | None = None
    """How the stable memory tells the model to use the memory tools (None: not offered)."""
    cache_control: bool = False
    """Mark the last stable-memory message with an Anthropic-style `cache_control` breakpoint."""


@dataclass(frozen=True)
class StablePart:
    """One stable-memory message: the summaries of messages `start` to `end - 1`, and the
    milestones among them (`ids`: quoted verbatim, so a note need not recall them)."""

    text: str
    start: int
    end: int
    tokens: int
    ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Note:
    """A recall note kept in the context, before the message at seq `before`."""

    before: int
    text: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class State:
    """A conversation's working context (see the module docstring)."""

    tenant_id: int
    conversation_id: int
    model: str
    budget: int
    verbatim_from: int
    mask_before: int
    upto: int
    stable: tuple[StablePart, ...] = ()
    notes: tuple[Note, ...] = ()
    tokens: int = 0
    system_tokens: int = 0
    version: int = 1
    compactions: int = 0
    prepared: Mapping[str, Any] | None = None
    recall_after: int | None = None
    recall_vector: Sequence[float] | None = None
    recall_ids: tuple[int, ...] = ()

    def present(self) -> set[int]:
        """Messages the context quotes verbatim outside the verbatim turns (milestones, notes)."""
        found = {node for part in self.stable for node in part.ids}
        found.update(node for note in self.notes for node in note.ids)
        return found

    def rebuilt(self, **changes: Any) -> State:
        """This state with a new prefix: `version` grows, notes and prepared work are dropped."""
        return replace(
            self,
            **{"notes": (), "prepared": None, **changes, "version": self.version + 1},
        )


@dataclass(frozen=True)
class Item:
    """One stored message of the verbatim turns: as sent (`message`, `canonical()`) and what
    it costs whole."""

    node_id: int
    seq: int
    role: str
    name: str | None
    message: dict[str, Any]
    tokens: int

    @property
    def maskable(self) -> bool:
        return self.role == "tool" and self.tokens > MASK_MIN_TOKENS


@dataclass(frozen=True)
class Rendered:
    """The context's messages with a label each (`stable`, `verbatim`, `note`) and their
    tokens."""

    messages: list[dict[str, Any]]
    labels: list[str]
    counts: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.counts)


Read = dict[int, tuple[datetime, Item]]
"""A conversation's verbatim messages as read: by node id, the time it was stored and the item."""


class _Recent:
    """Each conversation's verbatim messages as last read, in an encoding, within `tokens` over
    all (the least recently read go first). The verbatim turns are read on every turn, and most
    of them were read on the one before; stored messages never change, and a node is known by
    its id and the time it was stored (ids restart in a recreated database)."""

    def __init__(self, tokens: int) -> None:
        self._most = tokens
        self._total = 0
        self._held: OrderedDict[tuple[int, str], tuple[int, Read]] = OrderedDict()

    def get(self, key: tuple[int, str]) -> Read:
        found = self._held.get(key)
        return {} if found is None else found[1]

    def put(self, key: tuple[int, str], read: Read) -> None:
        size = sum(item.tokens for _, item in read.values())
        replaced = self._held.pop(key, None)
        self._total += size - (0 if replaced is None else replaced[0])
        self._held[key] = (size, read)
        while self._total > self._most and len(self._held) > 1:
            _, (dropped, _) = self._held.popitem(last=False)
            self._total -= dropped

    def clear(self) -> None:
        self._held.clear()
        self._total = 0


_read = _Recent(KEPT_TOKENS)


# -- rendering ---------------------------------------------------------------------------------


def canonical(message: Mapping[str, Any]) -> dict[str, Any]:
    """`message` as the prompt sends it: role, content, then name, tool calls and tool call id
    when set, then any other field in name order; nested objects with their keys sorted. A
    message the client sends and the same message read back from storage (JSONB orders keys its
    own way) come out identical."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _sorted(message.get("content"))}
    for key in ("name", "tool_calls", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = _sorted(message[key])
    for key in sorted(k for k in message if k not in out and k not in appends.MESSAGE_FIELDS):
        out[key] = _sorted(message[key])
    return out


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted(item) for item in value]
    return value


def masked(item: Item) -> dict[str, Any]:
    """The one-line placeholder a masked tool result is sent as."""
    return {
        "role": "tool",
        "content": (
            f"[#{item.node_id} tool result, {item.tokens:,} tokens, masked{tool_hints.MASKED}]"
        ),
        "tool_call_id": item.message.get("tool_call_id"),
    }


def stable_message(part: StablePart, *, breakpoint: bool) -> dict[str, Any]:
    """A stable-memory message; with `breakpoint`, its text is one part carrying an
    Anthropic-style `cache_control` mark."""
    if not breakpoint:
        return {"role": "system", "content": part.text}
    return {
        "role": "system",
        "content": [{"cache_control": {"type": "ephemeral"}, "text": part.text, "type": "text"}],
    }


def note_message(note_text: str) -> dict[str, Any]:
    return {"role": "system", "content": note_text}


def render(state: State, items: Sequence[Item], *, policy: Policy, model: str) -> Rendered:
    """The context's messages: stable memory, then the verbatim turns from `verbatim_from` (old
    tool results masked) with the kept notes in their places."""
    messages: list[dict[str, Any]] = []
    labels: list[str] = []
    counts: list[int] = []

    def add(message: dict[str, Any], label: str, count: int | None = None) -> None:
        messages.append(message)
        labels.append(label)
        counts.append(count if count is not None else tokens.count_message(message, model=model))

    for index, part in enumerate(state.stable):
        breakpoint = policy.cache_control and index == len(state.stable) - 1
        add(stable_message(part, breakpoint=breakpoint), "stable", part.tokens)
    notes = {note.before: note for note in state.notes}
    for item in items:
        if item.seq < state.verbatim_from:
            continue
        if item.seq in notes:
            add(note_message(notes.pop(item.seq).text), "note")
        if item.maskable and item.seq < state.mask_before:
            add(masked(item), "verbatim")
        else:
            add(item.message, "verbatim", item.tokens)
    return Rendered(messages=messages, labels=labels, counts=counts)


# The current branch's turns of seq `start` to `end - 1` (a system prompt that replaced the
# conversation's is none: `store.latest_system_prompt`): first one row of their ids and
# stored times in seq order (all NULL when there are none), then a row for each not in `known`
# (not yet decoded and counted) with its stored message. Most of the range is known on every
# turn but the first, and two arrays cost a fraction of a row per message to send and decode.
_ITEMS = text(
    """
SELECT NULL::bigint AS id, NULL::integer AS seq, NULL::text AS role, NULL::text AS name,
       NULL::jsonb AS content, NULL::jsonb AS tool_calls, NULL::text AS tool_call_id,
       NULL::jsonb AS meta,
       array_agg(n.id ORDER BY n.seq) AS ids, array_agg(n.created_at ORDER BY n.seq) AS times
FROM nodes n
WHERE n.tenant_id = :tenant_id AND n.conversation_id = :conversation_id AND n.level = 0
  AND n.seq >= :start AND n.seq < :end AND n.superseded_at IS NULL AND NOT n.system_prompt
UNION ALL
SELECT n.id, n.seq, n.role, n.name, n.content, n.tool_calls, n.tool_call_id, n.meta, NULL, NULL
FROM nodes n
WHERE n.tenant_id = :tenant_id AND n.conversation_id = :conversation_id AND n.level = 0
  AND n.seq >= :start AND n.seq < :end AND n.superseded_at IS NULL AND NOT n.system_prompt
  AND NOT n.id = ANY(:known)
"""
).bindparams(bindparam("known", type_=ARRAY(BigInteger)))


async def read_items(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, start: int, end: int, model: str
) -> list[Item]:
    """The current branch's messages from seq `start` to `end - 1` as verbatim turns, as a
    prompt carries them (`store.prompt_message`; the system messages the conversation opens
    with left out: the request's own system prompt goes first), each
    counted in `model`'s encoding. Messages this process read last time for the conversation
    are not read, decoded or counted again (`_read`)."""
    if end <= start:
        return []
    encoding = tokens.encoding_name_for_model(model)
    key = (conversation_id, encoding)
    known = _read.get(key)
    params = {
        "tenant_id": tenant_id,
        "conversation_id": conversation_id,
        "start": start,
        "end": end,
        "known": list(known),
    }
    ids, times, fresh = _split(await conn.execute(_ITEMS, params))
    if any(known[i][0] != at for i, at in zip(ids, times, strict=True) if i in known):
        known = {}  # another database under the same ids: read them all
        ids, times, fresh = _split(await conn.execute(_ITEMS, {**params, "known": []}))
    read: Read = {}
    # The range's first system messages are the client's system prompt when it begins the
    # conversation; a later one (an instruction within the history) is a turn like any other.
    opening = start == 0
    for node_id, stored_at in zip(ids, times, strict=True):
        row = fresh.get(node_id)
        if row is None:
            read[node_id] = known[node_id]
            opening = False
        elif not (opening and row.role in chains.SYSTEM_ROLES):
            opening = False
            message = canonical(store.prompt_message(row))
            item = Item(
                node_id=row.id,
                seq=row.seq,
                role=row.role,
                name=row.name,
                message=message,
                tokens=tokens.count_message(message, model=model),
            )
            read[node_id] = (stored_at, item)
    _read.put(key, read)
    return [item for _, item in read.values()]


def _split(rows: Iterable[AnyRow]) -> tuple[list[int], list[datetime], dict[int, AnyRow]]:
    """`_ITEMS`'s rows as the range's ids and stored times, and the rows read whole by id."""
    ids: list[int] = []
    times: list[datetime] = []
    fresh: dict[int, AnyRow] = {}
    for row in rows:
        if row.id is None:
            ids, times = row.ids or [], row.times or []
        else:
            fresh[row.id] = row
    return ids, times, fresh


# -- persistence -------------------------------------------------------------------------------


# Read on every turn of a conversation past its budget: built once, as `_ADVANCE` is.
_LOAD = select(working_contexts).where(
    working_contexts.c.conversation_id == bindparam("conversation_id"),
    working_contexts.c.tenant_id == bindparam("tenant_id"),
)


async def load(conn: AsyncConnection, *, tenant_id: int, conversation_id: int) -> State | None:
    """The conversation's working context, or None when it has none."""
    row = (
        await conn.execute(_LOAD, {"conversation_id": conversation_id, "tenant_id": tenant_id})
    ).one_or_none()
    if row is None:
        return None
    return State(
        tenant_id=row.tenant_id,
        conversation_id=row.conversation_id,
        model=row.model,
        budget=row.budget,
        verbatim_from=row.verbatim_from,
        mask_before=row.mask_before,
        upto=row.upto,
        stable=tuple(parts(row.stable)),
        notes=tuple(
            Note(before=int(n["before"]), text=str(n["text"]), ids=tuple(n["ids"]))
            for n in row.notes
        ),
        tokens=row.tokens,
        system_tokens=row.system_tokens,
        version=row.version,
        compactions=row.compactions,
        prepared=row.prepared,
        recall_after=row.recall_after,
        recall_vector=None if row.recall_vector is None else [float(x) for x in row.recall_vector],
        recall_ids=tuple(row.recall_ids or ()),
    )


def parts(raw: Any) -> list[StablePart]:
    """Stable parts from their JSON form (`part_json`)."""
    return [
        StablePart(
            text=str(p["text"]),
            start=int(p["start"]),
            end=int(p["end"]),
            tokens=int(p["tokens"]),
            ids=tuple(int(i) for i in p.get("ids", ())),
        )
        for p in raw or ()
    ]


def part_json(part: StablePart) -> dict[str, Any]:
    return {
        "text": part.text,
        "start": part.start,
        "end": part.end,
        "tokens": part.tokens,
        "ids": list(part.ids),
    }


def _notes_json(notes: Sequence[Note]) -> list[dict[str, Any]]:
    return [{"before": n.before, "text": n.text, "ids": list(n.ids)} for n in notes]


async def save(conn: AsyncConnection, state: State) -> None:
    """Write the state (created or replaced). What the background job prepared stays: the
    recall always, the compaction while the version it was prepared for is current."""
    values = {
        "tenant_id": state.tenant_id,
        "model": state.model,
        "budget": state.budget,
        "tokens": state.tokens,
        "system_tokens": state.system_tokens,
        "version": state.version,
        "compactions": state.compactions,
        "stable": [part_json(part) for part in state.stable],
        "verbatim_from": state.verbatim_from,
        "mask_before": state.mask_before,
        "notes": _notes_json(state.notes),
        "upto": state.upto,
    }
    statement = pg_insert(working_contexts).values(conversation_id=state.conversation_id, **values)
    kept = case(
        (working_contexts.c.version == statement.excluded.version, working_contexts.c.prepared),
        else_=null(),
    )
    await conn.execute(
        statement.on_conflict_do_update(
            index_elements=[working_contexts.c.conversation_id],
            set_={**values, "prepared": kept, "updated_at": func.now()},
        )
    )


# Built once: every turn that keeps the prefix runs it. Its parameters are not the columns'
# names, which an UPDATE keeps for the values of its SET clause.
_ADVANCE = (
    update(working_contexts)
    .where(
        working_contexts.c.conversation_id == bindparam("the_conversation_id"),
        working_contexts.c.version == bindparam("the_version"),
    )
    .values(
        model=bindparam("new_model"),
        budget=bindparam("new_budget"),
        tokens=bindparam("new_tokens"),
        system_tokens=bindparam("new_system_tokens"),
        upto=bindparam("new_upto"),
        notes=bindparam("new_notes", type_=working_contexts.c.notes.type),
        updated_at=func.now(),
    )
)


async def advance(conn: AsyncConnection, state: State) -> None:
    """Write what a turn changed in a state whose prefix it kept (the version loaded, under
    the conversation's row lock): its counts, `upto`, model, budget and notes; the stable
    memory, the compaction point and what the background prepared stay as stored."""
    await conn.execute(
        _ADVANCE,
        {
            "the_conversation_id": state.conversation_id,
            "the_version": state.version,
            "new_model": state.model,
            "new_budget": state.budget,
            "new_tokens": state.tokens,
            "new_system_tokens": state.system_tokens,
            "new_upto": state.upto,
            "new_notes": _notes_json(state.notes),
        },
    )


async def forget(
    conn: AsyncConnection, *, tenant_id: int, conversation_id: int, branched_at: int
) -> None:
    """Drop the conversation's working context if it holds messages from seq `branched_at` on,
    for a turn that moved the current branch there without reading the context (it fit its
    budget): the next turn past the budget cannot tell, and would send stable memory and notes
    of the abandoned branch; without a context, it builds one over the current branch."""
    await conn.execute(
        working_contexts.delete().where(
            working_contexts.c.conversation_id == conversation_id,
            working_contexts.c.tenant_id == tenant_id,
            working_contexts.c.upto > branched_at,
        )
    )
