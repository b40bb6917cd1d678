"""Who is calling: the tenant of a client request, and whether an admin request may proceed.

Clients (`/v1`, `/mcp`)
    `MEMSTRATA_AUTH=off`: every request belongs to the default tenant, and the client's own
    `Authorization` is what the upstream sees. `MEMSTRATA_AUTH=on`: the client presents a
    gateway key, `Authorization: Bearer msk-…`; its tenant is looked up by the key's hash on
    every request (`memory.write.tenants`), so a revoked key is refused from the next request on. A
    missing, unknown or revoked key gets 401 `invalid_api_key`, the key never echoed.
    While the database is down a key cannot be checked: the request fails with 503, except with
    `MEMSTRATA_FAIL_OPEN=on`, where a key this process verified within
    `MEMSTRATA_KEY_GRACE_SECONDS` is still accepted (`KeyGrace`) so that degraded forwarding
    keeps serving known clients (`gateway.key_grace`). Revoking a key or deleting a tenant here
    forgets its entries.

Admins (`/admin`)
    With `MEMSTRATA_ADMIN_TOKEN` set, every admin request needs `Authorization: Bearer <token>`
    (401 otherwise, from anywhere, loopback included). Without one, the admin API answers
    loopback clients only (403 to others), whatever they send.

Metrics (`/metrics`)
    Readable with `MEMSTRATA_METRICS_TOKEN` (a scraper's token that opens nothing else), or as
    an admin request. They hold no tenant's data, only totals; still, only operators read them.

`tenant_from_headers` is the one entry point for both the HTTP dependency
(`gateway.deps.TenantDep`) and MCP; `check_admin` is behind `gateway.deps.require_admin`.
"""

import hmac
import ipaddress
import logging
from collections.abc import Mapping

from starlette.requests import HTTPConnection

from gateway.errors import GatewayError
from gateway.state import State
from memory.db import transaction
from memory.errors import StorageUnavailable
from memory.write import tenants

log = logging.getLogger(__name__)


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an `Authorization: Bearer …` header, if any."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _invalid_key(message: str) -> GatewayError:
    return GatewayError(
        401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


async def tenant_from_headers(state: State, headers: Mapping[str, str]) -> int:
    """The tenant a client request acts for (see the module's docstring)."""
    if state.settings.auth == "off":
        return state.default_tenant_id
    key = bearer(headers)
    if key is None:
        raise _invalid_key(
            "a gateway key is required: send `Authorization: Bearer msk-…` (MEMSTRATA_AUTH is on)"
        )
    if not tenants.looks_like_key(key):
        raise _invalid_key("the key is not a gateway key (they start with `msk-`)")
    key_hash = tenants.hash_key(key)
    try:
        async with transaction(state.engine) as conn:
            tenant_id = await tenants.tenant_for_key(conn, key=key)
    except StorageUnavailable:
        remembered = state.key_grace.tenant(key_hash)
        if state.settings.fail_open == "on" and remembered is not None:
            return remembered
        raise
    if tenant_id is None:
        state.key_grace.forget(key_hash)
        raise _invalid_key("the gateway key is unknown or revoked")
    state.key_grace.remember(key_hash, tenant_id)
    return tenant_id


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_admin(state: State, connection: HTTPConnection) -> None:
    """Let an admin request through, or refuse it (see the module's docstring)."""
    expected = state.settings.admin_token
    if expected is None:
        host = connection.client.host if connection.client else ""
        if not _is_loopback(host):
            raise GatewayError(
                403,
                "the admin API answers loopback clients only while MEMSTRATA_ADMIN_TOKEN is unset",
                type="permission_error",
                code="admin_forbidden",
            )
        return
    token = bearer(connection.headers)
    if token is None or not hmac.compare_digest(
        token.encode(), expected.get_secret_value().encode()
    ):
        raise GatewayError(
            401,
            "the admin API needs `Authorization: Bearer $MEMSTRATA_ADMIN_TOKEN`",
            code="invalid_admin_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


def check_metrics(state: State, connection: HTTPConnection) -> None:
    """Let a scrape through with the metrics token, else as an admin request."""
    expected = state.settings.metrics_token
    token = bearer(connection.headers)
    if (
        expected is not None
        and token is not None
        and hmac.compare_digest(token.encode(), expected.get_secret_value().encode())
    ):
        return
    check_admin(state, connection)
