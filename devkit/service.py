"""A subprocess for tests and benchmarks: started, waited for, stopped, its output kept.

`Service(name, argv, env=..., ready_url=...)` starts `argv` in the repository root (or `cwd`)
with stdin closed and stdout and stderr together in a temporary file, and returns once a GET of
`ready_url` answers 200 (at once without `ready_url`). A process that exits first, or is not
ready within `startup_timeout` seconds, is stopped and `ServiceStartError` raised with what it
wrote. `stop()` sends SIGTERM, then SIGKILL after `stop_timeout` seconds; it is idempotent, and
`logs()` still answers afterwards. A `Service` is a context manager that stops it on exit.

`free_port()` finds a port for a server to listen on, `own_address()` an address of this machine
that is not loopback (a client there is a remote one); `child_env(settings)` is the environment a
child gets: this process's without any `MEMSTRATA_*` variable, the repository on `PYTHONPATH`,
unbuffered output, and `settings` as `MEMSTRATA_<NAME>` variables. `memstrata(*args, env=...)`
runs the command `memstrata ARGS` to its end and returns what it wrote.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


class ServiceStartError(RuntimeError):
    """A process exited or was not ready in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def own_address() -> str | None:
    """An IPv4 address of this machine other than loopback (the one its default route leaves
    from), or None. Connecting a UDP socket sends nothing: it only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # TEST-NET-1: never answered, only routed
        except OSError:
            return None
        address: str = sock.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def child_env(settings: Mapping[str, object] | None = None) -> dict[str, str]:
    """This environment minus `MEMSTRATA_*`, plus the repository on `PYTHONPATH`, unbuffered
    output and `settings` (lower-case names without the prefix) as `MEMSTRATA_*` variables."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEMSTRATA_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update({f"MEMSTRATA_{key.upper()}": str(value) for key, value in (settings or {}).items()})
    return env


def memstrata(
    *args: str, env: Mapping[str, str], timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """`memstrata ARGS` run in a process of its own with `env` (see `child_env`) to its end,
    with its exit status and what it wrote to stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=REPO_ROOT,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class Service:
    """One subprocess; see the module docstring."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        ready_url: str | None = None,
        startup_timeout: float = 60.0,
        stop_timeout: float = 20.0,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.stop_timeout = stop_timeout
        self._output: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self._final_output: str | None = None
        started = time.perf_counter()
        self.process = subprocess.Popen(
            list(argv),
            cwd=cwd or REPO_ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
        )
        try:
            if ready_url is not None:
                self._wait_ready(ready_url, startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - started

    def _wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServiceStartError(
                    f"{self.name} exited with code {self.process.returncode}:\n{self.logs()}"
                )
            try:
                response = httpx.get(url, timeout=1.0, trust_env=False)
            except httpx.HTTPError as exc:
                last = repr(exc)
            else:
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            time.sleep(0.05)
        raise ServiceStartError(
            f"{self.name} not ready after {timeout}s (GET {url}: {last}):\n{self.logs()}"
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def logs(self) -> str:
        """Everything the process wrote (stdout and stderr) so far, also after `stop()`."""
        if self._final_output is not None:
            return self._final_output
        # pread leaves the file offset alone: the child shares it and writes at it.
        descriptor = self._output.fileno()
        return os.pread(descriptor, os.fstat(descriptor).st_size, 0).decode(errors="replace")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after `stop_timeout` seconds; keep the output. Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._final_output is None:
            self._final_output = self.logs()
            self._output.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
