"""Requests whose answer waits for the table, and the task that sends every answer.

The table answers a request by its id (`Acknowledge`, `Refuse`) once what it stands for is
durable. A step of the partition never waits, so answers are queued here; whoever ran the
step sends them right after it (`flush`), in the order they were given. Sending from the
step's own task rather than a task of its own saves the event-loop turn that waking such a
task costs, on every answer. The commit latency metric is observed here: from the request's
arrival to its `committed` answer.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from txactors.actors import Request
from txactors.coordinator.core.effects import Acknowledge, Refuse
from txactors.coordinator.core.states import TxnState
from txactors.coordinator.partition.batches import ItemSlot
from txactors.observe.metrics import CoordinatorMetrics
from txactors.wire.protocol import Error


@dataclass(slots=True)
class _Waiting:
    request: Request | None
    """None: the coordinator's own request (a rollback of refused halves), nobody to answer."""
    reply: Callable[[TxnState], Any]
    since: float = field(default_factory=time.perf_counter)


class Answers:
    def __init__(self, partition: int, metrics: CoordinatorMetrics | None) -> None:
        self._latency = None if metrics is None else metrics.commit_latency.labels(str(partition))
        """The partition's child, looked up once (`labels` per answer costs a lock and a
        dict lookup of the label tuple)."""
        self._waiting: dict[str, _Waiting] = {}
        self._ids = 0
        self._queue: collections.deque[tuple[Request, Any]] = collections.deque()
        self._flushing = False

    def wait(self, request: Request | None, reply: Callable[[TxnState], Any]) -> str:
        """A request id for the table; `reply(state)` is the answer when it is acknowledged."""
        self._ids += 1
        request_id = str(self._ids)
        self._waiting[request_id] = _Waiting(request, reply)
        return request_id

    def settle(self, action: Acknowledge | Refuse) -> None:
        """Answer the request the table acknowledged or refused."""
        waiting = self._waiting.pop(action.request_id)
        if isinstance(action, Refuse):
            answer: Any = Error(action.code, action.message)
        else:
            answer = waiting.reply(action.state)
            if self._latency is not None and action.state is TxnState.COMMITTED:
                self._latency.observe(time.perf_counter() - waiting.since)
        if waiting.request is not None:
            self.send(waiting.request, answer)

    def give_up(self, answer: Error) -> None:
        """Answer every request still waiting for the table with `answer` (its partition's
        instance ends before the table could)."""
        waiting, self._waiting = self._waiting, {}
        for entry in waiting.values():
            if entry.request is not None:
                self.send(entry.request, answer)

    def send(self, request: Request, answer: Any) -> None:
        """Queue an answer; the next `flush` sends it after every answer queued before it."""
        self._queue.append((request, answer))

    async def flush(self) -> None:
        """Send the queued answers in order. If a flush is already under way (its publish
        waiting for room in the connection's buffer), that one sends them, so answers never
        overtake each other."""
        if self._flushing:
            return
        self._flushing = True
        try:
            while self._queue:
                request, answer = self._queue.popleft()
                reply = request.reply
                if type(reply) is ItemSlot:  # `request.answer`, without its coroutines
                    batch = reply.fill(answer) if request.settle() else None
                    if batch is not None:
                        await batch.send()
                    continue
                await request.answer(answer)
        finally:
            self._flushing = False
