"""Waiting in tests: for a condition under a deadline, or for an event.

Tests watch real servers and processes, and a loaded machine makes every outcome late; a
fixed `sleep` either wastes time or, under load, looks too early. `eventually` (the one the
`txactors.testing` plugin gives users) polls a condition until it holds and `within` bounds a
wait on an event; both fail with an `AssertionError` naming what was awaited (and, for a
condition, the last value seen), so a test that waits still fails when its condition is never
met.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from txactors.testing import eventually

__all__ = ["eventually", "within"]


@contextmanager
def within(timeout: float, what: str) -> Iterator[None]:
    """Bound the waits inside (on an event, a stream, a process) and name them on timeout."""
    with anyio.move_on_after(timeout) as scope:
        yield
    if scope.cancelled_caught:
        raise AssertionError(f"not within {timeout:g} s: {what}")
