"""Waiting in tests: for a condition under a deadline, or for an event.

Tests watch real servers and processes, and a loaded machine makes every outcome late; a
fixed `sleep` either wastes time or, under load, looks too early. `eventually` polls a
condition until it holds and `within` bounds a wait on an event; both fail with an
`AssertionError` naming what was awaited (and, for a condition, the last value seen), so a
test that waits still fails when its condition is never met.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import anyio

T = TypeVar("T")

POLL_INTERVAL = 0.02
"""Seconds between two looks at a condition: short against any test's timeout."""


async def eventually(
    probe: Callable[[], T] | Callable[[], Awaitable[T]],
    *,
    what: str | None = None,
    timeout: float = 10.0,
    until: Callable[[T], object] = bool,
    ignoring: tuple[type[BaseException], ...] = (),
    interval: float = POLL_INTERVAL,
    explain: Callable[[], str] | None = None,
) -> T:
    """Call `probe` (sync or async) until `until(value)` holds, and return that value.

    A probe raising one of `ignoring` counts as "not yet" (a stream not declared so far);
    any other error fails the test at once. On timeout, raises `AssertionError` with `what`
    (by default the probe's name, or a lambda's source), the last value (or error) seen and
    what `explain` says then (a process's log tail).
    """
    last: object = "(no answer yet)"
    with anyio.move_on_after(timeout):
        while True:
            try:
                value = probe()
                if inspect.isawaitable(value):
                    value = await value
            except ignoring as error:
                last = error
            else:
                last = value
                if until(cast(T, value)):
                    return cast(T, value)
            await anyio.sleep(interval)
    awaited = what or _described(probe)
    message = f"not within {timeout:g} s: {awaited} (last seen: {_short(last)})"
    raise AssertionError(message if explain is None else f"{message}\n{explain()}")


@contextmanager
def within(timeout: float, what: str) -> Iterator[None]:
    """Bound the waits inside (on an event, a stream, a process) and name them on timeout."""
    with anyio.move_on_after(timeout) as scope:
        yield
    if scope.cancelled_caught:
        raise AssertionError(f"not within {timeout:g} s: {what}")


def _described(probe: Callable[..., object]) -> str:
    """A lambda's source line, or a function's name: what a test waited for, unless it said."""
    name = getattr(probe, "__qualname__", repr(probe))
    if not name.endswith("<lambda>"):
        return name
    try:
        return inspect.getsource(probe).strip()
    except (OSError, TypeError):
        return name


def _short(value: Any, limit: int = 500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
