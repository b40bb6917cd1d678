"""Run the fake OpenAI-compatible upstream (``devkit/upstream_server.py``) as a subprocess.

``UpstreamServer(chunk_delay=0.0, latency=0.0, responses=True)`` starts ``python -m
devkit.upstream_server`` on a free 127.0.0.1 port (``responses=False``: one without the
Responses API) as soon as it is constructed and returns once ``GET /v1/models`` answers
200 (within ``startup_timeout`` seconds, 20 by default; otherwise it stops the process and raises
:class:`devkit.service.ServiceStartError` with what the process wrote). The readiness probes are
then cleared from the recorded requests, so ``requests()`` starts empty.

* ``.url`` -- base URL ending in ``/v1`` (give it to ``openai.OpenAI(base_url=...)``).
* ``.root_url`` -- ``http://127.0.0.1:PORT`` (no ``/v1``).
* ``.script(*behaviours)`` -- append behaviours to the FIFO queue (see the server docstring).
* ``.set_default(behaviour)`` -- the persistent default behaviour; ``{}`` resets it.
* ``.pending()`` -- the behaviours still queued.
* ``.requests(path=None)`` -- recorded ``/v1`` requests (optionally only those on ``path``).
* ``.reset()`` -- clear recorded requests, the queue and the default.
* ``.stop()`` -- terminate, wait up to 5 s, kill if needed; idempotent.
* ``.pid``, ``.logs()`` -- as every :class:`devkit.service.Service` (benchmarks read its CPU).

It is a context manager (``with UpstreamServer() as upstream: ...`` stops it on exit). Control
calls use a synchronous ``httpx.Client``; they are local and fast, so calling them from async
tests is fine.
"""

from __future__ import annotations

import sys
from typing import Any

import httpx

from devkit.service import Service, child_env, free_port


class UpstreamServer(Service):
    """A running ``devkit.upstream_server`` subprocess plus a client for its control plane."""

    def __init__(
        self,
        *,
        chunk_delay: float = 0.0,
        latency: float = 0.0,
        host: str = "127.0.0.1",
        startup_timeout: float = 20.0,
        responses: bool = True,
    ) -> None:
        self.port = free_port(host)
        self.root_url = f"http://{host}:{self.port}"
        self.url = f"{self.root_url}/v1"
        self._client = httpx.Client(base_url=self.root_url, timeout=10.0, trust_env=False)
        argv = [sys.executable, "-m", "devkit.upstream_server", "--host", host]
        argv += ["--port", str(self.port), "--chunk-delay", str(chunk_delay)]
        argv += ["--latency", str(latency)]
        if not responses:  # an upstream without the Responses API
            argv.append("--no-responses")
        super().__init__(
            "the fake upstream",
            argv,
            env=child_env(),
            ready_url=f"{self.url}/models",
            startup_timeout=startup_timeout,
            stop_timeout=5.0,
        )
        try:
            self.reset()
        except BaseException:
            self.stop()
            raise

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
        super().stop()
        self._client.close()
