"""The upstream provider's API as background work calls it: embeddings and summaries.

Calls go through the official `openai` SDK, which retries what is worth retrying (connection
errors, 408, 409, 429 and 5xx) up to `max_retries` times with exponential backoff and jitter,
waiting what a `Retry-After` (or `retry-after-ms`) header asks when it is reasonable. A short
burst of 429s is thus absorbed instead of failing a summary over to the extractive summarizer
(`memory.build.summarize.FallbackSummarizer`). With no API key configured, no `Authorization`
header is sent at all (local servers such as Ollama or vLLM need none).

`post` returns the answer's JSON as the server sent it, so the callers keep parsing it
themselves (and stay indifferent to the SDK's own models); every failure becomes a
`ProviderError` whose message names the status and the error's type or code, never the
request's text (a `ProviderUnavailable` when a later try may succeed: unreachable, timed out,
408, 409, 429 or 5xx, once the SDK's own retries are spent, naming the endpoint that failed);
`refused_parameter` reads which request parameter a 400 answer named, so that a caller may send
the request again without it.

Every answer (a 2xx) is noted, with its endpoint and time, in the `Answers` that `noting` set
for the current task and the tasks it starts, if any: a worker sets one per job
(`memory.build.worker`), to learn that the upstream answers without knowing which providers
its handlers use.
"""

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

import openai

from memory.errors import ProviderError, ProviderUnavailable

DEFAULT_MAX_RETRIES = 2
# Statuses of an upstream that is down or busy rather than refusing the request.
_PASSING_STATUSES = frozenset({408, 409, 429})
_PLACEHOLDER_KEY = "memstrata-no-key"  # the SDK needs one; its header is left out (`_headers`)


class Answers:
    """When each endpoint (`chat`, `embeddings`) last answered, by `time.monotonic()`."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def note(self, endpoint: str) -> None:
        self.at[endpoint] = time.monotonic()


_NOTING: ContextVar[Answers | None] = ContextVar("memstrata_upstream_answers", default=None)


@contextmanager
def noting(answers: Answers) -> Iterator[Answers]:
    """Note in `answers` every answer a `Provider` gets within the block, in this task and in
    the tasks it starts meanwhile (they copy the context)."""
    token = _NOTING.set(answers)
    try:
        yield answers
    finally:
        _NOTING.reset(token)


class Provider:
    """One OpenAI-compatible server (`base_url`), reached with the SDK's retries."""

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        timeout: float = 60.0,
        http_client: Any = None,
    ) -> None:
        """`http_client`: the SDK's own HTTP client to use (its type follows the SDK's version);
        None: the SDK makes one, closed by `aclose`."""
        self._client = openai.AsyncOpenAI(
            api_key=api_key or _PLACEHOLDER_KEY,
            base_url=base_url,
            max_retries=max_retries,
            timeout=timeout,
            http_client=http_client,
        )
        self._headers: dict[str, Any] = {} if api_key else {"Authorization": openai.Omit()}

    async def post(
        self,
        endpoint: Literal["chat", "embeddings"],
        payload: dict[str, Any],
        *,
        what: str,
        seconds: float | None = None,
    ) -> Any:
        """The JSON answer of `endpoint` to `payload`; `what` names the call in errors,
        `seconds` bounds each attempt (the client's timeout when None)."""
        options: dict[str, Any] = {"extra_headers": self._headers}
        if seconds is not None:
            options["timeout"] = seconds
        try:
            if endpoint == "chat":
                raw = await self._client.chat.completions.with_raw_response.create(
                    **payload, **options
                )
            else:
                raw = await self._client.embeddings.with_raw_response.create(**payload, **options)
            text = raw.text
        except openai.APIStatusError as exc:
            status = exc.status_code
            message = f"{what} upstream answered HTTP {status}{_error_kind(exc.body)}"
            if status in _PASSING_STATUSES or status >= 500:
                raise ProviderUnavailable(message, endpoint=endpoint) from exc
            raise ProviderError(message) from exc
        except openai.APITimeoutError as exc:
            raise ProviderUnavailable(f"{what} upstream timed out", endpoint=endpoint) from exc
        except openai.APIConnectionError as exc:
            raise ProviderUnavailable(
                f"{what} upstream unreachable ({type(exc).__name__})", endpoint=endpoint
            ) from exc
        except openai.OpenAIError as exc:
            raise ProviderError(f"{what} upstream failed ({type(exc).__name__})") from exc
        answers = _NOTING.get()
        if answers is not None:
            answers.note(endpoint)
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ProviderError(f"{what} upstream sent a body that is not JSON") from exc
        except RecursionError as exc:
            raise ProviderError(f"{what} upstream sent JSON nested too deeply") from exc

    async def aclose(self) -> None:
        await self._client.close()


def refused_parameter(error: ProviderError) -> str | None:
    """The request parameter a 400 answer named (OpenAI's `error.param`: `temperature` from a
    reasoning model), or None."""
    cause = error.__cause__
    if not isinstance(cause, openai.BadRequestError):
        return None
    body = cause.body
    detail = body.get("error", body) if isinstance(body, dict) else None
    param = detail.get("param") if isinstance(detail, dict) else None
    return param if isinstance(param, str) else None


def _error_kind(body: object) -> str:
    """` (type, code)` of an OpenAI-shaped error body; an upstream may quote the request in its
    message, so the message itself is left out."""
    error = body.get("error", body) if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return ""
    kind = [str(error[k]) for k in ("type", "code") if isinstance(error.get(k), str | int)]
    return f" ({', '.join(kind)})" if kind else ""
