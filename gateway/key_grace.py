"""Gateway keys verified recently, kept so that degraded forwarding keeps serving known clients.

While the database is down a key cannot be checked; with `MEMSTRATA_FAIL_OPEN=on`, a key this
process verified within `MEMSTRATA_KEY_GRACE_SECONDS` is still accepted (`gateway.auth`). The
entries are in memory, per process, by the key's hash; nothing here reads the database.
"""

import time
from collections import OrderedDict


class KeyGrace:
    """Keys verified recently, by hash, for use only while the database cannot be reached."""

    def __init__(self, *, seconds: float, size: int = 10_000) -> None:
        self._seconds = seconds
        self._size = size
        self._verified: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def remember(self, key_hash: str, tenant_id: int) -> None:
        if self._seconds <= 0:
            return
        self._verified[key_hash] = (tenant_id, time.monotonic())
        self._verified.move_to_end(key_hash)
        while len(self._verified) > self._size:
            self._verified.popitem(last=False)

    def forget(self, key_hash: str) -> None:
        self._verified.pop(key_hash, None)

    def forget_tenant(self, tenant_id: int) -> None:
        for key_hash in [k for k, (t, _) in self._verified.items() if t == tenant_id]:
            del self._verified[key_hash]

    def tenant(self, key_hash: str) -> int | None:
        """The tenant of a key verified within the grace period, else None."""
        found = self._verified.get(key_hash)
        if found is None or time.monotonic() - found[1] > self._seconds:
            return None
        return found[0]
