"""Where the request path's time goes: wall time per named stage of one request.

`recording()` opens a record for the current task (and the tasks it starts: the record is a
context variable's value, which they inherit); `stage(name)` and the `staged(name)` decorator
add their wall time to it under `name`. Outside a recording they cost one context-variable
lookup. Stages may overlap (the query is embedded while the full-text leg runs), so their
sum can exceed the request's time. The gateway reports each record as a histogram per stage in
`/metrics` and at DEBUG in its log.
"""

import functools
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar, cast

Record = dict[str, float]
"""Seconds by stage name."""

_current: ContextVar[Record | None] = ContextVar("memstrata_stages", default=None)

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def recording() -> Iterator[Record]:
    """A record of the stages run inside the block (and in tasks started inside it)."""
    record: Record = {}
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Add the block's wall time to the current record's `name`."""
    record = _current.get()
    if record is None:
        yield
        return
    began = time.perf_counter()
    try:
        yield
    finally:
        record[name] = record.get(name, 0.0) + time.perf_counter() - began


def staged(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: every call of the function (sync or async) is timed as `name`."""

    def decorate(function: Callable[P, R]) -> Callable[P, R]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def timed_async(*args: P.args, **kwargs: P.kwargs) -> Any:
                with stage(name):
                    return await function(*args, **kwargs)

            return cast(Callable[P, R], timed_async)

        @functools.wraps(function)
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            with stage(name):
                return function(*args, **kwargs)

        return timed

    return decorate
