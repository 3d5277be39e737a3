"""The timeouts of one link's callers on one timer (`CallTimeouts`): a heap of deadlines, so a
call arms and cancels no timer of its own."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class Waiting(Protocol):
    """A caller waiting for its answer: done once answered or gone."""

    @property
    def future(self) -> asyncio.Future[Any]: ...


C = TypeVar("C", bound=Waiting)


class CallTimeouts(Generic[C]):
    """The deadlines of one link's callers, on one timer: each caller still fails at its own
    deadline (`expire`, unless answered or gone by then), but arms and cancels no timer of
    its own (a `call_at` and its cancel cost more than the rest of a call's bookkeeping).

    The timer is armed for the earliest deadline; when it fires, what is due expires and it
    is armed again for the next. Callers answered stay until they reach the front (timeouts
    are alike, so that is soon): whoever adds a deadline drops them there."""

    __slots__ = ("_at", "_expire", "_heap", "_order", "_timer")

    def __init__(self, expire: Callable[[C, float], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, C, float]] = []
        """(deadline, order of the call, waiter, its timeout): the earliest first."""
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0
        """When the timer fires (while there is one)."""

    def __len__(self) -> int:
        """Callers not yet dropped (some may be answered already)."""
        return len(self._heap)

    def add(
        self, loop: asyncio.AbstractEventLoop, deadline: float, waiter: C, timeout: float
    ) -> None:
        """`waiter` fails at `deadline` (of `loop.time()`) unless its future is done by then."""
        heap = self._heap
        while heap and heap[0][2].future.done():
            heapq.heappop(heap)
        heapq.heappush(heap, (deadline, next(self._order), waiter, timeout))
        if self._timer is None or deadline < self._at:
            if self._timer is not None:  # a shorter timeout than those before it
                self._timer.cancel()
            self._arm(loop, deadline)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._at = when
        self._timer = loop.call_at(when, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        heap, due = self._heap, max(self._at, loop.time())  # fired late: all that is overdue
        while heap:
            deadline, _, waiter, timeout = heap[0]
            if not waiter.future.done():
                if deadline > due:
                    self._arm(loop, deadline)
                    return
                self._expire(waiter, timeout)
            heapq.heappop(heap)
