"""How long a job that did not get through waits before it runs again.

* `backoff_seconds` -- after a failed attempt: exponential in the job's attempts, capped, with
  jitter. A job that keeps failing thus reaches the dead letter (`memory.build.jobs.fail`)
  within about `BACKOFF_BASE * 2^max_attempts` seconds.
* `Outage` -- after a transient upstream failure (`memory.errors.ProviderUnavailable`) that
  costs the job no attempt (`memory.build.jobs.requeue`): exponential in the failures this
  worker has met on that endpoint since the endpoint last answered, capped lower, so that a job
  waits out an outage of any length and runs again soon after it ends. Only an answer of the
  upstream ends an outage: jobs that got through without calling it (cutting segments, local
  embeddings) say nothing of it.
"""

import random
from typing import Final

BACKOFF_BASE: Final = 1.0
"""Seconds before the first retry; each further failure doubles it."""
BACKOFF_CAP: Final = 300.0
"""No retry waits longer than this many seconds."""
OUTAGE_BACKOFF_CAP: Final = 60.0
"""No job deferred by an outage waits longer than this many seconds: it is also how long the
queue may lag behind an upstream that has come back."""


def backoff_seconds(
    attempts: int, *, base: float = BACKOFF_BASE, cap: float = BACKOFF_CAP
) -> float:
    """The wait before retrying a job that failed its `attempts`-th attempt.

    `base * 2^(attempts-1)`, capped at `cap`, with "equal jitter": uniformly in [d/2, d], so that
    jobs which failed together (an outage) do not all come back at the same instant.
    """
    delay = min(cap, base * 2.0 ** min(max(attempts - 1, 0), 62))
    return delay / 2 + random.uniform(0, delay / 2)


class Outage:
    """The upstream as one worker has met it lately: per endpoint (`chat`, `embeddings`), how
    many transient failures since it last answered."""

    def __init__(self, *, base: float = BACKOFF_BASE, cap: float = OUTAGE_BACKOFF_CAP) -> None:
        self._base = base
        self._cap = cap
        self._failures: dict[str, int] = {}

    def failures(self, endpoint: str) -> int:
        """The transient failures met on `endpoint` since it last answered."""
        return self._failures.get(endpoint, 0)

    def failed(self, endpoint: str) -> float:
        """Count one more transient failure of `endpoint`; the wait before its job runs again."""
        failures = self._failures[endpoint] = self.failures(endpoint) + 1
        return backoff_seconds(failures, base=self._base, cap=self._cap)

    def answered(self, endpoint: str) -> None:
        """`endpoint` answered: its next failure starts a new outage."""
        self._failures.pop(endpoint, None)
