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

Admins (`/admin`, `/ui`)
    With `MEMSTRATA_ADMIN_TOKEN` set, every admin request needs `Authorization: Bearer <token>`
    (401 otherwise, from anywhere, loopback included). Without one, the admin API answers
    loopback clients only (403 to others), and only when they name a loopback `Host`
    (`localhost`, `127.0.0.1` or `[::1]`, any port): a web page the operator visits could
    otherwise reach it through DNS rebinding (its own name resolving to 127.0.0.1), since the
    browser then sends that page's name as the `Host`. The client is the connection's peer;
    proxy headers (`Forwarded`, `X-Forwarded-For`, `X-Real-IP`) name it instead only when that
    peer is one of `MEMSTRATA_TRUSTED_PROXIES`. A request from loopback that carries proxy
    headers from an untrusted peer is refused: it is probably a local proxy's, whose client is
    not known.

Metrics (`/metrics`)
    Readable with `MEMSTRATA_METRICS_TOKEN` (a scraper's token that opens nothing else), or as
    an admin request. They hold no tenant's data, only totals; still, only operators read them.

`tenant_from_headers` is the one entry point for both the HTTP dependency
(`gateway.deps.TenantDep`) and MCP; `check_admin` is behind `gateway.deps.require_admin`.
"""

import hmac
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from ipaddress import IPv4Network, IPv6Network

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


_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
_PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(value: str) -> str:
    """The name of a `Host` header, its port left out (`[::1]:8080` → `[::1]`)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def client_address(
    connection: HTTPConnection, trusted: Sequence[IPv4Network | IPv6Network]
) -> str | None:
    """The client's address: the peer's, or, when the peer is a trusted proxy, the one its
    headers name (`Forwarded: for=`, the last `X-Forwarded-For` hop, `X-Real-IP`); None when
    a loopback peer relays proxy headers it is not trusted for."""
    peer = connection.client.host if connection.client else ""
    headers = connection.headers
    if not _within(peer, trusted):
        if _is_loopback(peer) and any(name in headers for name in _PROXY_HEADERS):
            return None
        return peer
    if forwarded := headers.get("forwarded"):
        last = forwarded.split(",")[-1]
        for pair in last.split(";"):
            key, _, value = pair.strip().partition("=")
            if key.lower() == "for":
                return value.strip().strip('"').removeprefix("[").split("]")[0]
    if chain := headers.get("x-forwarded-for"):
        return chain.split(",")[-1].strip()
    return headers.get("x-real-ip", peer).strip()


def _within(address: str, networks: Sequence[IPv4Network | IPv6Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def check_admin(state: State, connection: HTTPConnection) -> None:
    """Let an admin request through, or refuse it (see the module's docstring)."""
    expected = state.settings.admin_token
    if expected is None:
        client = client_address(connection, state.settings.trusted_proxies or ())
        host = _host_name(connection.headers.get("host", ""))
        if client is None or not _is_loopback(client) or host not in _LOOPBACK_HOSTS:
            raise GatewayError(
                403,
                "while MEMSTRATA_ADMIN_TOKEN is unset, the admin API answers loopback clients "
                "only, addressed as localhost, 127.0.0.1 or [::1] (set a token to reach it "
                "otherwise, or MEMSTRATA_TRUSTED_PROXIES behind a proxy)",
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
