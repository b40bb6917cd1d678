"""The one exception hierarchy of memstrata's domain.

    MemstrataError
    ├── InvalidInput          the caller sent something we refuse (→ 4xx at the edge)
    │   ├── InvalidConversationId
    │   ├── ContextOverflow   a turn that no memory could fit into its budget
    │   └── PatternRejected   a regex that is too costly or malformed
    ├── NotFound              a conversation, node or job that does not exist *for this tenant*
    ├── Conflict              an operation that collides with stored state
    ├── StorageUnavailable    Postgres cannot be reached or refused us
    │   └── SchemaMismatch    pgvector missing, migrations not applied, wrong vector dimension
    └── ProviderError         an embedding or summarization backend failed
        └── ProviderUnavailable   ... for now: unreachable, timed out, rate-limited or 5xx

`memory/` raises only these; lower-level errors (asyncpg, SQLAlchemy, httpx, onnxruntime) are
translated where they happen with ``raise X(...) from exc``. The HTTP edge maps each class to
one status code and OpenAI's error shape, in one place.
"""


class MemstrataError(Exception):
    """Base class of every error memstrata raises on purpose."""


class InvalidInput(MemstrataError):
    """The input is malformed or out of range; nothing was written."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InvalidConversationId(InvalidInput):
    """A conversation id outside 1-128 characters of ``A-Za-z0-9._:-``."""


class PatternRejected(InvalidInput):
    """A regular expression that is malformed, too long, or took too long to run."""


class ContextOverflow(InvalidInput):
    """The system prompt and the new messages alone exceed the budget: no memory could make
    such a turn fit (OpenAI's `context_length_exceeded`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages")


class NotFound(MemstrataError):
    """The thing does not exist, or belongs to another tenant (indistinguishable on purpose)."""


class Conflict(MemstrataError):
    """The operation collides with stored state."""


class StorageUnavailable(MemstrataError):
    """Postgres is unreachable or failed."""


class SchemaMismatch(StorageUnavailable):
    """The database lacks pgvector, the migrations, or has an unexpected vector dimension."""


class ProviderError(MemstrataError):
    """An embedding or summarization backend failed."""


class ProviderUnavailable(ProviderError):
    """The backend could not answer for now (unreachable, timed out, HTTP 408, 409, 429 or 5xx):
    the same request may well succeed later, unlike a refused or malformed one. `endpoint`
    names the upstream's endpoint that failed (`chat`, `embeddings`)."""

    def __init__(self, message: str, *, endpoint: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint
