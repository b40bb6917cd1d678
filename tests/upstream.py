"""Run the fake OpenAI-compatible upstream (``tests/upstream_server.py``) as a subprocess.

``UpstreamServer(chunk_delay=0.0, latency=0.0)`` starts ``python -m tests.upstream_server`` on
a free 127.0.0.1 port as soon as it is constructed and returns once ``GET /v1/models`` answers
200 (within ``startup_timeout`` seconds, 20 by default; otherwise it kills the process and raises
:class:`UpstreamStartError` carrying the process's stderr). The readiness probes are then
cleared from the recorded requests, so ``requests()`` starts empty.

* ``.url`` -- base URL ending in ``/v1`` (give it to ``openai.OpenAI(base_url=...)``).
* ``.root_url`` -- ``http://127.0.0.1:PORT`` (no ``/v1``).
* ``.script(*behaviours)`` -- append behaviours to the FIFO queue (see the server docstring).
* ``.set_default(behaviour)`` -- the persistent default behaviour; ``{}`` resets it.
* ``.pending()`` -- the behaviours still queued.
* ``.requests(path=None)`` -- recorded ``/v1`` requests (optionally only those on ``path``).
* ``.reset()`` -- clear recorded requests, the queue and the default.
* ``.stop()`` -- terminate, wait up to 5 s, kill if needed; idempotent.
* ``.pid`` -- the server process's id (benchmarks read its CPU time).

It is a context manager (``with UpstreamServer() as upstream: ...`` stops it on exit). Control
calls use a synchronous ``httpx.Client``; they are local and fast, so calling them from async
tests is fine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


class UpstreamStartError(RuntimeError):
    """The fake upstream did not come up."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class UpstreamServer:
    """A running ``tests.upstream_server`` subprocess plus a client for its control plane."""

    def __init__(
        self,
        *,
        chunk_delay: float = 0.0,
        latency: float = 0.0,
        host: str = "127.0.0.1",
        startup_timeout: float = 20.0,
    ) -> None:
        self.host = host
        self.port = free_port(host)
        self.root_url = f"http://{host}:{self.port}"
        self.url = f"{self.root_url}/v1"
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        env["PYTHONUNBUFFERED"] = "1"
        self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.upstream_server",
                "--host",
                host,
                "--port",
                str(self.port),
                "--chunk-delay",
                str(chunk_delay),
                "--latency",
                str(latency),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
        self._client = httpx.Client(base_url=self.root_url, timeout=10.0, trust_env=False)
        try:
            self._wait_ready(startup_timeout)
            self.reset()
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the upstream server is stopped")
        return self._process.pid

    def _wait_ready(self, timeout: float) -> None:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        last_error = "no attempt made"
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise UpstreamStartError(
                    f"upstream server exited with code {self._process.returncode}:\n{self.stderr()}"
                )
            try:
                response = self._client.get("/v1/models", timeout=1.0)
                if response.status_code == 200:
                    return
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.TransportError as exc:
                last_error = repr(exc)
            time.sleep(0.05)
        raise UpstreamStartError(
            f"upstream server did not answer GET /v1/models within {timeout}s "
            f"(last: {last_error}):\n{self.stderr()}"
        )

    def stderr(self) -> str:
        """Everything the server process has written to stderr so far."""
        if self._stderr.closed:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.is_error:
            raise RuntimeError(
                f"upstream control call {response.request.method} {response.request.url.path} "
                f"failed: HTTP {response.status_code}: {response.text}"
            )
        return response

    def script(self, *behaviours: dict[str, Any]) -> None:
        """Append behaviours to the FIFO queue (one is consumed per ``/v1`` request)."""
        self._check(self._client.post("/_control/script", json=list(behaviours)))

    def set_default(self, behaviour: dict[str, Any]) -> None:
        """Set the persistent default behaviour (``{}`` resets it)."""
        self._check(self._client.post("/_control/default", json=behaviour))

    def pending(self) -> list[dict[str, Any]]:
        """Behaviours still waiting in the queue."""
        queue: list[dict[str, Any]] = self._check(self._client.get("/_control/script")).json()[
            "queue"
        ]
        return queue

    def requests(self, path: str | None = None) -> list[dict[str, Any]]:
        """Recorded ``/v1`` requests, oldest first, optionally only those on ``path``."""
        params = {"path": path} if path is not None else None
        recorded: list[dict[str, Any]] = self._check(
            self._client.get("/_control/requests", params=params)
        ).json()
        return recorded

    def reset(self) -> None:
        """Clear recorded requests, the behaviour queue and the default behaviour."""
        self._check(self._client.delete("/_control/requests"))

    def stop(self) -> None:
        """Terminate the server (kill it if it does not exit within 5 s). Idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._client.close()
        self._stderr.close()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
