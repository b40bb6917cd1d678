"""Tenants and their gateway keys: creation, listing, deletion, revocation, and key lookup.

A gateway key is `msk-` followed by 43 URL-safe random characters (256 bits). Only its SHA-256
hash is stored, with a short `prefix` to tell keys apart when listing them: the key itself is
returned once, by `create_key`, and can never be read back. `tenant_for_key` finds the tenant of
a presented key by its hash and ignores revoked keys, so a revocation takes effect on the very
next lookup (nothing here caches). Deleting a tenant deletes everything it owns (its keys,
conversations, nodes and jobs, by the schema's cascades). The default tenant, which owns
everything while authentication is off, cannot be deleted.

Every function takes the caller's connection and keyword-only arguments; another tenant's key
behaves as missing (`NotFound`).
"""

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from memory.db import AnyRow
from memory.errors import Conflict, InvalidInput, NotFound
from memory.schema import DEFAULT_TENANT, api_keys, conversations, tenants

KEY_PREFIX: Final = "msk-"
"""Every gateway key starts with this."""

DISPLAY_CHARS: Final = 12
"""How much of a key is kept in clear (`prefix`), to recognise it in a list."""

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class TenantRecord:
    """A tenant, with how much it holds."""

    id: int
    name: str
    created_at: datetime
    conversations: int
    active_keys: int


@dataclass(frozen=True)
class KeyRecord:
    """A gateway key as it can be shown after creation: never the key itself."""

    id: int
    tenant_id: int
    name: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class NewKey:
    """A key just created: `secret` is shown to its owner once and stored nowhere."""

    record: KeyRecord
    secret: str


def validate_name(name: str) -> str:
    """A tenant name: 1-64 characters of `A-Za-z0-9._-`."""
    if not _NAME.fullmatch(name):
        raise InvalidInput(
            "a tenant name must be 1-64 characters of A-Z a-z 0-9 . _ -", param="tenant"
        )
    return name


def hash_key(key: str) -> str:
    """The stored form of a gateway key."""
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    """A fresh gateway key."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def looks_like_key(value: str) -> bool:
    """Whether `value` has the shape of a gateway key (cheap check before a lookup)."""
    return value.startswith(KEY_PREFIX) and 16 <= len(value) <= 256 and value.isascii()


# -- tenants ---------------------------------------------------------------------------------


async def create_tenant(conn: AsyncConnection, *, name: str) -> TenantRecord:
    """A new tenant; `Conflict` if the name is taken."""
    validate_name(name)
    try:
        async with conn.begin_nested():
            row = (
                await conn.execute(
                    insert(tenants).values(name=name).returning(tenants.c.id, tenants.c.created_at)
                )
            ).one()
    except IntegrityError as exc:
        raise Conflict(f"tenant {name!r} already exists") from exc
    return TenantRecord(
        id=row.id, name=name, created_at=row.created_at, conversations=0, active_keys=0
    )


async def list_tenants(conn: AsyncConnection) -> list[TenantRecord]:
    """Every tenant, oldest first."""
    query = select(*_tenant_columns()).order_by(tenants.c.id)
    return [_tenant(row) for row in await conn.execute(query)]


async def get_tenant(conn: AsyncConnection, *, name: str) -> TenantRecord:
    """The tenant called `name`, or `NotFound`."""
    validate_name(name)
    row = (
        await conn.execute(select(*_tenant_columns()).where(tenants.c.name == name))
    ).one_or_none()
    if row is None:
        raise NotFound(f"tenant {name!r} does not exist")
    return _tenant(row)


async def tenant_id(conn: AsyncConnection, *, name: str) -> int:
    """The id of the tenant called `name`, or `NotFound`."""
    validate_name(name)
    found = await conn.scalar(select(tenants.c.id).where(tenants.c.name == name))
    if found is None:
        raise NotFound(f"tenant {name!r} does not exist")
    return int(found)


async def delete_tenant(conn: AsyncConnection, *, name: str) -> None:
    """Delete the tenant and everything it owns; the default tenant cannot be deleted."""
    validate_name(name)
    if name == DEFAULT_TENANT:
        raise Conflict("the default tenant cannot be deleted")
    deleted = await conn.scalar(
        delete(tenants).where(tenants.c.name == name).returning(tenants.c.id)
    )
    if deleted is None:
        raise NotFound(f"tenant {name!r} does not exist")


def _tenant_columns() -> list[Any]:
    conversation_count = (
        select(func.count())
        .where(conversations.c.tenant_id == tenants.c.id)
        .scalar_subquery()
        .label("conversations")
    )
    key_count = (
        select(func.count())
        .where(api_keys.c.tenant_id == tenants.c.id, api_keys.c.revoked_at.is_(None))
        .scalar_subquery()
        .label("active_keys")
    )
    return [tenants.c.id, tenants.c.name, tenants.c.created_at, conversation_count, key_count]


def _tenant(row: AnyRow) -> TenantRecord:
    return TenantRecord(
        id=row.id,
        name=row.name,
        created_at=row.created_at,
        conversations=int(row.conversations),
        active_keys=int(row.active_keys),
    )


# -- keys ------------------------------------------------------------------------------------


async def create_key(conn: AsyncConnection, *, tenant_id: int, name: str = "") -> NewKey:
    """A new key for the tenant; the secret is in the result and nowhere else."""
    if len(name) > 200:
        raise InvalidInput("a key name must be at most 200 characters", param="name")
    secret = generate_key()
    row = (
        await conn.execute(
            insert(api_keys)
            .values(
                tenant_id=tenant_id,
                name=name,
                prefix=secret[:DISPLAY_CHARS],
                key_hash=hash_key(secret),
            )
            .returning(*_KEY_COLUMNS)
        )
    ).one()
    return NewKey(record=_key(row), secret=secret)


async def list_keys(conn: AsyncConnection, *, tenant_id: int) -> list[KeyRecord]:
    """The tenant's keys, revoked ones included, oldest first."""
    rows = await conn.execute(
        select(*_KEY_COLUMNS).where(api_keys.c.tenant_id == tenant_id).order_by(api_keys.c.id)
    )
    return [_key(row) for row in rows]


async def revoke_key(conn: AsyncConnection, *, tenant_id: int, key_id: int) -> KeyRecord:
    """Revoke the tenant's key (at once: the next lookup refuses it); revoking twice keeps
    the first revocation time. `NotFound` for a key of another tenant."""
    await conn.execute(
        update(api_keys)
        .where(
            api_keys.c.id == key_id,
            api_keys.c.tenant_id == tenant_id,
            api_keys.c.revoked_at.is_(None),
        )
        .values(revoked_at=func.now())
    )
    row = (
        await conn.execute(
            select(*_KEY_COLUMNS).where(api_keys.c.id == key_id, api_keys.c.tenant_id == tenant_id)
        )
    ).one_or_none()
    if row is None:
        raise NotFound(f"key {key_id} does not exist")
    return _key(row)


async def tenant_for_key(conn: AsyncConnection, *, key: str) -> int | None:
    """The tenant of a live (not revoked) key, or None."""
    if not looks_like_key(key):
        return None
    found = await conn.scalar(
        select(api_keys.c.tenant_id).where(
            api_keys.c.key_hash == hash_key(key), api_keys.c.revoked_at.is_(None)
        )
    )
    return None if found is None else int(found)


_KEY_COLUMNS = (
    api_keys.c.id,
    api_keys.c.tenant_id,
    api_keys.c.name,
    api_keys.c.prefix,
    api_keys.c.created_at,
    api_keys.c.revoked_at,
)


def _key(row: AnyRow) -> KeyRecord:
    return KeyRecord(**row._mapping)
