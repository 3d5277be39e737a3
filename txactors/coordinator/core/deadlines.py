"""Deadlines keyed by transaction id, in a heap with lazy invalidation.

Rescheduling or cancelling does not search the heap: the old entry just stops matching the
key's live token and is skipped when it reaches the top. So that skipped entries cannot
pile up with the history of resolved transactions, the heap is rebuilt from the live
deadlines whenever stale entries outnumber live ones. A check cycle thus costs
O(due · log open), never O(history); `examined` counts heap entries looked at, so tests
(and the benchmark) can assert that without timing anything.
"""

from __future__ import annotations

import heapq
import itertools

_SLACK = 64  # stale entries tolerated before a rebuild, so tiny heaps are not rebuilt often


class Deadlines:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, tuple[float, int]] = {}
        self._tokens = itertools.count()
        self.examined = 0

    def __len__(self) -> int:
        """Live deadlines."""
        return len(self._live)

    @property
    def heap_size(self) -> int:
        """Heap entries, live and stale: at most 2 · live + a small slack."""
        return len(self._heap)

    def set(self, key: str, when: float) -> None:
        """Schedule `key` at `when`, replacing its previous deadline."""
        token = next(self._tokens)
        self._live[key] = (when, token)
        heap = self._heap
        heapq.heappush(heap, (when, token, key))
        if len(heap) > 2 * len(self._live) + _SLACK:  # `_compact_if_stale`, without its call
            self._compact()

    def cancel(self, key: str) -> None:
        if self._live.pop(key, None) is not None:
            self._compact_if_stale()

    def pop_due(self, now: float) -> list[str]:
        """Remove and return the keys due at `now`, earliest first."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            when, token, key = heapq.heappop(self._heap)
            self.examined += 1
            if self._live.get(key) == (when, token):
                del self._live[key]
                due.append(key)
        return due

    def earliest(self) -> float | None:
        """The next live deadline, if any."""
        while self._heap:
            when, token, key = self._heap[0]
            if self._live.get(key) == (when, token):
                return when
            heapq.heappop(self._heap)
            self.examined += 1
        return None

    def _compact_if_stale(self) -> None:
        if len(self._heap) > 2 * len(self._live) + _SLACK:
            self._compact()

    def _compact(self) -> None:
        self._heap = [(when, token, key) for key, (when, token) in self._live.items()]
        heapq.heapify(self._heap)
