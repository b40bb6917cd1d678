"""PLACEHOLDER written by the lead so the app imports; the summarize author replaces this whole file."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol


@dataclass(frozen=True)
class SummaryInput:
    node_id: int
    level: int
    role: str | None
    text: str
    facts: Mapping[str, list[str]] | None
    created_at: datetime | None
    seq_start: int
    seq_end: int


@dataclass(frozen=True)
class Summary:
    text: str
    facts: dict[str, list[str]]
    method: str
    model: str | None


class Summarizer(Protocol):
    async def summarize(
        self, items: Sequence[SummaryInput], *, level: int, target_tokens: int
    ) -> Summary: ...


def make_summarizer(mode: str, **kwargs: Any) -> Summarizer:
    raise NotImplementedError
