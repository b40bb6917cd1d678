"""Every setting of memstrata, read from the environment and `.env` with the prefix `MEMSTRATA_`.

`Settings` is built where the process starts (the CLI, `create_app`, a test) and passed down;
nothing reads the environment at import time. Validators refuse unsafe or meaningless values
at start rather than deep inside a request. README's settings table is checked against this
class by a test, so a field added here must be documented there.
"""

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AnyHttpUrl, Field, IPvAnyNetwork, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.upstream import KEEPALIVE_SECONDS
from memory import db

OnOff = Literal["on", "off"]


class Settings(BaseSettings):
    """memstrata's configuration; see README's settings table for each field."""

    model_config = SettingsConfigDict(
        env_prefix="MEMSTRATA_", env_file=".env", extra="ignore", frozen=True
    )

    # Serving
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=1, le=65535)
    keep_alive_seconds: int = Field(default=75, ge=1)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_messages: int = Field(default=10_000, ge=1)

    # Storage
    data_dir: Path = Path(".memstrata")
    database_url: str | None = None
    db_pool_size: int = Field(default=10, ge=1, le=200)

    # Upstream
    upstream_base_url: AnyHttpUrl = AnyHttpUrl("https://api.openai.com/v1")
    upstream_api_key: str | None = None
    upstream_timeout: float = Field(default=600.0, gt=0)
    upstream_connect_timeout: float = Field(default=10.0, gt=0)
    upstream_keep_alive_seconds: float = Field(default=KEEPALIVE_SECONDS, gt=0)
    background_retries: int = Field(default=2, ge=0, le=10)
    # Whether the upstream serves `POST /responses` (`gateway.openai.responses`).
    upstream_responses: Literal["auto", "on", "off"] = "auto"

    # Background work
    workers: int = Field(default=1, ge=0, le=64)
    worker_process: OnOff = "on"
    # How much lower the worker process's CPU priority is than serve's (Linux nice).
    worker_nice: int = Field(default=10, ge=0, le=19)
    job_lease_seconds: float = Field(default=60.0, gt=0)
    # How long a stopping worker lets its jobs in hand finish before giving them back.
    worker_grace_seconds: float = Field(default=30.0, ge=0)
    # How long a done job stays in the queue's table before a worker deletes it.
    job_retention_seconds: float = Field(default=7 * 86400.0, gt=0)

    # Embeddings
    embedding_provider: Literal["local", "upstream"] = "local"
    embedding_model: str = "text-embedding-3-small"
    embedding_model_path: Path | None = None
    embedding_tokenizer_path: Path | None = None
    embedding_quantization: Literal["dynamic", "off"] = "dynamic"
    embedding_cache_dir: Path | None = None

    # The summary tree
    summary_mode: Literal["auto", "llm", "extractive"] = "auto"
    summary_model: str = "gpt-4o-mini"
    summary_tokens: int = Field(default=256, ge=32, le=4096)
    shift_threshold: float = Field(default=0.30, ge=0.0, le=2.0)
    segment_token_cap: int = Field(default=2048, ge=64)
    segment_min_tokens: int = Field(default=256, ge=0)
    fanout: int = Field(default=8, ge=2, le=64)
    # Each message's sentences embedded on their own too (`memory.build.passages`).
    passages: OnOff = "on"

    # Prompt assembly
    context_budget: int = Field(default=8000, ge=256)
    context_window: int = Field(default=32768, ge=1024)
    output_reserve: int = Field(default=4096, ge=0)
    cross_conversation: OnOff = "on"
    # Recall (the prompt's memory and the memory tools) also draws on messages that left
    # their conversation's current branch (an edited message, a regenerated answer).
    recall_abandoned_branches: OnOff = "off"
    # How long an `Idempotency-Key` names the request that first carried it (0: not at all).
    idempotency_window_seconds: float = Field(default=86400.0, ge=0)
    # The working context (`memory.recall.working_context`): shares of the budget.
    context_mode: Literal["working", "rebuild"] = "working"
    context_high_water: float = Field(default=0.85, gt=0.0, le=1.0)
    context_low_water: float = Field(default=0.45, gt=0.0, lt=1.0)
    note_share: float = Field(default=0.6, ge=0.0, le=0.6)
    keep_notes: OnOff = "off"

    # Provider caching and usage
    prompt_cache_key: Literal["auto", "on", "off"] = "auto"
    cache_control: OnOff = "off"
    stream_usage: OnOff = "on"

    # Memory tools
    memory_tools: Literal["always", "auto", "never"] = "auto"
    max_tool_rounds: int = Field(default=4, ge=1, le=32)
    regex_timeout: float = Field(default=1.0, gt=0, le=60)
    tool_result_chars: int = Field(default=16000, ge=1000)

    # Tenants and admin
    auth: OnOff = "off"
    admin_token: SecretStr | None = None
    metrics_token: SecretStr | None = None
    key_grace_seconds: float = Field(default=300.0, ge=0)
    trusted_proxies: Annotated[tuple[IPvAnyNetwork, ...] | None, NoDecode] = None
    relay_open_paths: Annotated[tuple[str, ...], NoDecode] = (
        "models",
        "moderations",
        "audio",
        "images",
        "completions",
        "responses/input_tokens",
        "rerank",
        "score",
        "tokenize",
        "detokenize",
    )

    # Operations
    fail_open: OnOff = "off"
    log_format: Literal["json", "text"] = "json"
    metrics_refresh_seconds: float = Field(default=5.0, ge=0)

    @field_validator("trusted_proxies", "relay_open_paths", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """A comma-separated list (`10.0.0.5, 172.16.0.0/12`; `models, audio`)."""
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("database_url")
    @classmethod
    def _asyncpg_url(cls, value: str | None) -> str | None:
        """Accept the usual `postgres://` and `postgresql://` forms; we drive asyncpg. A URL
        the driver cannot read (a port that is no number, or out of range: one the system would
        wrap to another) is refused here, not as a traceback when the first connection opens."""
        if value is None or value == "":
            return None
        for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
            if value.startswith(prefix):
                url = "postgresql+asyncpg://" + value[len(prefix) :]
                break
        else:
            raise ValueError("MEMSTRATA_DATABASE_URL must be a postgresql:// URL")
        try:
            db.port_of(url)
        except ValueError as exc:
            raise ValueError(f"MEMSTRATA_DATABASE_URL: {exc}") from exc
        return url

    @field_validator("admin_token", "metrics_token")
    @classmethod
    def _strong_token(cls, value: SecretStr | None) -> SecretStr | None:
        """An empty token means none; a short one is refused (it would be guessable)."""
        if value is None or value.get_secret_value() == "":
            return None
        if len(value.get_secret_value()) < 16:
            raise ValueError("tokens (MEMSTRATA_ADMIN_TOKEN, ...) must be at least 16 characters")
        return value

    @model_validator(mode="after")
    def _marks_in_order(self) -> "Settings":
        if self.context_low_water >= self.context_high_water:
            raise ValueError(
                "MEMSTRATA_CONTEXT_LOW_WATER must be below MEMSTRATA_CONTEXT_HIGH_WATER"
            )
        return self

    @property
    def sends_cache_key(self) -> bool:
        """Whether requests carry a conversation-scoped `prompt_cache_key` (`auto`: only to
        OpenAI's own API, where it routes a conversation's prompts to the same cache)."""
        if self.prompt_cache_key == "auto":
            return self.upstream_base_url.host == "api.openai.com"
        return self.prompt_cache_key == "on"

    @property
    def upstream_url(self) -> str:
        """The upstream base URL without a trailing slash."""
        return str(self.upstream_base_url).rstrip("/")
