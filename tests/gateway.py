"""Run `memstrata serve` as a real process for end-to-end tests.

`GatewayProcess(database_url=..., upstream_url=..., **settings)` starts the gateway on a free
loopback port with the given `MEMSTRATA_*` settings (keyword names without the prefix), waits
until `/healthz` answers, and offers `.url` (ending `/v1`), `.root_url`, `.stop()` and
`.logs()`. It is a context manager.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx

from tests.upstream import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


class GatewayStartError(RuntimeError):
    """The gateway did not come up."""


class GatewayProcess:
    """A `memstrata serve` subprocess."""

    def __init__(
        self,
        *,
        database_url: str,
        upstream_url: str,
        startup_timeout: float = 60.0,
        **settings: object,
    ) -> None:
        self.port = free_port()
        self.root_url = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.root_url}/v1"
        env = {key: value for key, value in os.environ.items() if not key.startswith("MEMSTRATA_")}
        env.update(
            {
                "MEMSTRATA_DATABASE_URL": database_url,
                "MEMSTRATA_UPSTREAM_BASE_URL": upstream_url,
                "MEMSTRATA_HOST": "127.0.0.1",
                "MEMSTRATA_PORT": str(self.port),
                "MEMSTRATA_LOG_LEVEL": "info",
            }
        )
        env.update({f"MEMSTRATA_{key.upper()}": str(value) for key, value in settings.items()})
        self._log: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self._final_logs: str | None = None
        self._process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "serve"],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self.stop()
                raise GatewayStartError(f"gateway exited early:\n{self.logs()}")
            try:
                if httpx.get(f"{self.root_url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise GatewayStartError(f"gateway not ready after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        """Everything the process wrote (stdout and stderr), also after `stop()`."""
        if self._final_logs is not None:
            return self._final_logs
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self) -> None:
        """Terminate the process (kill it after 15 s) and close its log. Idempotent."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._final_logs is None:
            self._final_logs = self.logs()
            self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
