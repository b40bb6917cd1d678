"""`memstrata import`: messages from a file into a conversation, in batches, resumable.

A file is UTF-8 text (a leading byte order mark is skipped): JSONL (one OpenAI-format message a
line) or JSON (a list of messages, or an object with `messages`); each message may carry
`created_at` (ISO 8601; UTC without a zone), and a system message `"system_prompt": true` (a
system prompt that replaced the conversation's, as an export writes one: stored so, never a
turn of the history). A `.jsonl` file is JSONL; any other is JSON
unless it holds more than one value. A file that cannot be read so is refused with
`InvalidInput` saying why (a malformed JSONL line by its number), and so is JSON Postgres
cannot hold (`NaN`, `Infinity`, `1e400`). Every message is validated before anything is
written. The import continues after the messages the conversation already holds (same hash
chain, from its start or after messages the conversation held before the file was imported:
`memory.write.imports`), so running it twice, or again after a failure, stores nothing twice.
"""

import json
import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.errors import validation_param
from gateway.schemas import ImportMessage
from memory.db import transaction
from memory.errors import InvalidInput
from memory.write import imports, store


class ImportFile(NamedTuple):
    """A file's messages as OpenAI dicts, their `created_at` (None where absent), and which
    are a replaced system prompt."""

    messages: list[dict[str, Any]]
    created_at: list[datetime | None]
    system_prompts: list[bool]


def read_messages(path: Path) -> ImportFile:
    """The messages of `path` (see the module docstring)."""
    try:
        # "utf-8-sig": the byte order mark some Windows tools write before UTF-8 is skipped.
        raw = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{path}: not UTF-8 text: {exc}") from exc
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    items: Any
    if path.suffix == ".jsonl":
        items = _jsonl(path, raw)
    else:
        try:
            items = _loads(raw)
        except json.JSONDecodeError as exc:
            # A whole value, then more: one a line (JSONL by another name).
            if exc.msg != "Extra data":
                raise InvalidInput(f"{path}: not valid JSON or JSONL: {exc}") from exc
            items = _jsonl(path, raw)
        except ValueError as exc:
            raise InvalidInput(f"{path}: not valid JSON or JSONL: {exc}") from exc
    if isinstance(items, dict):
        items = items.get("messages")
    if not isinstance(items, list) or not items:
        raise InvalidInput(f"{path}: expected a non-empty list of messages")
    read = ImportFile([], [], [])
    for number, item in enumerate(items, start=1):
        try:
            message = ImportMessage.model_validate(item)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = validation_param(error["loc"], item, missing=error["type"] == "missing")
            reason = f"{field}: {error['msg']}" if field else error["msg"]
            raise InvalidInput(f"{path}: message {number}: {reason}") from exc
        read.messages.append(
            message.model_dump(exclude={"created_at", "system_prompt"}, exclude_none=True)
        )
        read.created_at.append(_utc(message.created_at))
        read.system_prompts.append(message.system_prompt)
    return read


def _utc(moment: datetime | None) -> datetime | None:
    """A time without a zone is UTC, as the admin API's bulk import reads it (the database
    driver would take it for this machine's local time)."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def _jsonl(path: Path, raw: str) -> list[Any]:
    """One JSON value a line (blank lines skipped); a malformed one is named by its line."""
    items = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(_loads(line))
        except ValueError as exc:
            raise InvalidInput(f"{path}: line {number} is not valid JSON: {exc}") from exc
    return items


def _loads(text: str) -> Any:
    """JSON that Postgres can hold: `NaN`, `Infinity` and numbers no double can hold (`1e400`)
    are refused, as in a request to the gateway; the database refused them mid-import."""
    return json.loads(text, parse_constant=_not_a_number, parse_float=_finite)


def _not_a_number(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number JSON can hold")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is a number too large for a double")
    return value


def conversation_id_for(path: Path) -> str:
    """A conversation id made from the file's name."""
    return re.sub(r"[^A-Za-z0-9._:-]", "-", path.stem)[:128] or "import"


async def import_messages(
    engine: AsyncEngine,
    *,
    tenant_id: int | None = None,
    external_id: str,
    messages: Sequence[dict[str, Any]],
    created_at: Sequence[datetime | None],
    model: str,
    batch: int,
    system_prompts: Sequence[bool] = (),
    progress: Callable[[int], object] = lambda _: None,
) -> int:
    """Append what the conversation lacks of `messages`, `batch` per transaction (each queues
    the summary tree's build), those `system_prompts` marks stored as replaced system prompts;
    returns how many messages were stored."""
    async with transaction(engine) as conn:
        tenant = tenant_id if tenant_id is not None else await store.tenant_id_by_name(conn)
        ref, _ = await store.open_conversation(conn, tenant_id=tenant, external_id=external_id)
        start = await imports.resume_point(
            conn, tenant_id=tenant, conversation_id=ref.id, messages=messages
        )
    progress(start)
    marked = [
        offset < len(system_prompts) and system_prompts[offset] for offset in range(len(messages))
    ]
    offset = start
    while offset < len(messages):
        # A replaced system prompt leads its batch: `store.append` marks the leading ones.
        leading = next((n for n in range(offset, len(messages)) if not marked[n]), len(messages))
        end = min(max(offset + batch, leading), len(messages))
        end = next((n for n in range(leading, end) if marked[n]), end)
        async with transaction(engine) as conn:
            await store.append(
                conn,
                tenant_id=tenant,
                conversation_id=ref.id,
                messages=messages[offset:end],
                created_at=created_at[offset:end],
                model=model,
                system_prompts=leading - offset,
            )
        progress(end - offset)
        offset = end
    return len(messages) - start
