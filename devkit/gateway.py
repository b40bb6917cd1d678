"""memstrata's own processes for end-to-end tests and benchmarks: `serve` and `worker`.

`GatewayProcess(database_url=..., upstream_url=..., **settings)` starts `python -m gateway
serve` on a free loopback port (or one of `host`, an address of this machine) with the given
`MEMSTRATA_*` settings (keyword names without the
prefix; `log_level` is `info` unless given), waits until `/healthz` answers, and offers `.url`
(ending `/v1`), `.root_url`, `.stop()` and `.logs()`. `argv` runs another command configured
the same way (a benchmark's instrumented gateway); `name` names it in errors; `cwd`, another
checkout of the repository, runs that checkout's gateway (`python -m` imports from it first).

`WorkerProcess(database_url, **settings)` starts `python -m gateway worker`, which serves no
HTTP: it returns at once. `.owns(locked_by)` says whether a job's lock names it; `.kill()` sends
SIGKILL (no chance to finish the job in hand).

Both are `devkit.service.Service`s (context managers, `.pid`, `.running`): `stop()` sends
SIGTERM and SIGKILL after 20 s, time for a worker to finish its job.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from devkit.service import Service, child_env, free_port


class GatewayProcess(Service):
    """A `memstrata serve` subprocess."""

    def __init__(
        self,
        *,
        database_url: str,
        upstream_url: str,
        name: str = "gateway",
        argv: Sequence[str] | None = None,
        startup_timeout: float = 60.0,
        host: str = "127.0.0.1",
        cwd: Path | None = None,
        **settings: object,
    ) -> None:
        self.port = free_port(host)
        self.root_url = f"http://{host}:{self.port}"
        self.url = f"{self.root_url}/v1"
        values: dict[str, object] = {
            "database_url": database_url,
            "upstream_base_url": upstream_url,
            "host": host,
            "port": self.port,
            "log_level": "info",
            **settings,
        }
        super().__init__(
            name,
            argv or [sys.executable, "-m", "gateway", "serve"],
            env=child_env(values),
            ready_url=f"{self.root_url}/healthz",
            startup_timeout=startup_timeout,
            cwd=cwd,
        )


class WorkerProcess(Service):
    """A `memstrata worker` subprocess."""

    def __init__(self, database_url: str, **settings: object) -> None:
        super().__init__(
            "worker",
            [sys.executable, "-m", "gateway", "worker"],
            env=child_env({"database_url": database_url, "log_level": "info", **settings}),
        )

    def owns(self, locked_by: str | None) -> bool:
        """Whether a job's `locked_by` names this process (`host:pid:random`)."""
        return locked_by is not None and locked_by.split(":")[1] == str(self.pid)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        self.process.kill()
        self.process.wait(timeout=10)
