"""memstrata as it is deployed, for end-to-end tests: several `serve` processes on one database.

`Deployment(database_url, upstream, stack, **settings)` starts two `serve` processes (each with
its worker child, `MEMSTRATA_*` `settings` beside) in `stack`; `restart(i)` kills one (SIGKILL)
and starts another in its place; `failures(text)` gathers what the processes logged about the
requests a failure names. `Balanced(deployment, rng)` is an httpx client that sends each request
to one of them at random, as a load balancer would. `settled(http, conversation)` waits until
the workers have nothing left to build for a conversation and returns its statistics.
"""

import os
import random
import re
import signal
import time
from contextlib import ExitStack
from typing import Any

import httpx

from devkit.gateway import GatewayProcess
from devkit.upstream import UpstreamServer


class Deployment:
    """Two `serve` processes on one database, each with its worker (serve's default) and
    `settings`; one may be killed and started again (`restart`)."""

    def __init__(
        self, database_url: str, upstream: UpstreamServer, stack: ExitStack, **settings: Any
    ) -> None:
        self._database_url, self._upstream, self._stack = database_url, upstream, stack
        self._settings = settings
        self.started: list[GatewayProcess] = []
        self.gateways = [self._serve(), self._serve()]

    def _serve(self) -> GatewayProcess:
        gateway = self._stack.enter_context(
            GatewayProcess(
                database_url=self._database_url,
                upstream_url=self._upstream.url,
                workers=1,
                **self._settings,
            )
        )
        self.started.append(gateway)
        return gateway

    def failures(self, failure: str) -> str:
        """What the processes logged at error level or about the requests `failure` names by
        id (a 500 says only "failed unexpectedly" and its request id), or that they did not.
        A 500's traceback is logged once its answer is sent (the server logs what the app
        raised after the error handler answered): read at once, it was not there yet, so it
        is waited for, a few seconds at most."""
        ids = re.findall(r"request id ([0-9a-f]{32})", failure)
        for _ in range(50):
            found = [
                f"{gateway.name} {gateway.pid}: {line}"
                for gateway in self.started
                for line in gateway.logs().splitlines()
                if '"level": "error"' in line or "Traceback" in line or any(i in line for i in ids)
            ]
            if all(any(i in line and "Traceback" in line for line in found) for i in ids):
                break
            time.sleep(0.1)
        return "\n".join(found) or f"no line of {len(self.started)} processes names {ids}"

    def restart(self, index: int) -> None:
        """The process killed (SIGKILL: it finishes nothing) and another started in its place."""
        os.kill(self.gateways[index].pid, signal.SIGKILL)
        self.gateways[index].stop()
        self.gateways[index] = self._serve()


class Balanced(httpx.Client):
    """A client of a deployment's `serve` processes: each request goes to one of them at
    random."""

    def __init__(self, deployment: Deployment, rng: random.Random) -> None:
        super().__init__(base_url=deployment.gateways[0].root_url, timeout=30)
        self._deployment = deployment
        self._rng = rng

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        gateway = self._rng.choice(self._deployment.gateways)
        request.url = request.url.copy_with(port=gateway.port)
        return super().send(request, **kwargs)


def settled(http: httpx.Client, conversation: str, root: str = "") -> dict[str, Any]:
    """The conversation's statistics once its workers have nothing left to build for it."""
    for _ in range(600):
        stats: dict[str, Any] = http.get(f"{root}/admin/conversations/{conversation}").json()
        if not stats["pending_jobs"]:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"still building: {stats}")
