"""The pure bookkeeping of the producer's batched links (`producer/link.py`), without I/O:
which calls go out in the round being opened (`Coalescer`), how a round is cut into requests
(`chunks`), and what each item of a request is answered (`answers`)."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic, TypeVar

from txactors.errors import CommandError
from txactors.wire.protocol import EndedBatch, Error, ErrorCode, PreparedBatch

WINDOW: Final = 1
"""Rounds in flight per partition and verb. One: the coordinator group-commits what one
round brings, and what arrives meanwhile makes the next round bigger instead of another
request (and another write) of its own. Two measured no faster at 64 in flight, with more
CPU per transaction (docs/benchmarks.md)."""
W = TypeVar("W")


class Coalescer(Generic[W]):
    """Which calls of one partition and verb go in the round being opened, which wait in the
    queue for a round to end, and when a round opens.

    A round opened (`submit` or `finished` says so) is taken with `opened` once the
    event-loop turn is over: calls made meanwhile join it."""

    __slots__ = ("_opening", "_queue", "_rounds", "window")

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._queue: deque[W] = deque()
        self._opening: list[W] | None = None
        """The round opened and not yet taken: calls join it."""
        self._rounds = 0

    def __len__(self) -> int:
        """Calls queued for a round to end."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Rounds opened and not finished."""
        return self._rounds

    def submit(self, item: W) -> bool:
        """True: `item` opens a round (take it with `opened` once this turn is over); False: it
        joins the round being opened, or waits in the queue."""
        if self._opening is not None:
            self._opening.append(item)
            return False
        if self._rounds < self.window:
            self._rounds += 1
            self._opening = [item]
            return True
        self._queue.append(item)
        return False

    def opened(self) -> list[W]:
        """The round opened, with every call that joined it: in flight from now on. Empty
        when each of them was withdrawn (it still counts until `finished`)."""
        round_, self._opening = self._opening or [], None
        return round_

    def withdraw(self, item: W) -> bool:
        """Take out a call not yet taken for a request (its caller gave up); False when it was."""
        if self._opening is not None and item in self._opening:
            self._opening.remove(item)
            return True
        try:
            self._queue.remove(item)
        except ValueError:
            return False
        return True

    def finished(self) -> bool:
        """A round ended. True: the calls queued meanwhile open the next round (take it with
        `opened` once this turn is over); False: none were queued, or they joined a round
        being opened already (a wider window)."""
        self._rounds -= 1
        if not self._queue:
            return False
        queued = list(self._queue)
        self._queue.clear()
        if self._opening is not None:
            self._opening.extend(queued)
            return False
        self._rounds += 1
        self._opening = queued
        return True


def chunks(
    items: Sequence[W],
    max_items: int,
    encode: Callable[[Sequence[W]], bytes],
    limit: int,
    answer_size: Callable[[W], int],
) -> list[tuple[Sequence[W], bytes]]:
    """`items`, in order, as requests with their payloads: at most `max_items` each, whose
    answers (`answer_size` each, at their longest) and encoding (`encode`) fit in `limit`
    bytes; a request too large is halved until it fits. One item stays alone whatever its
    size: NATS or the coordinator refuses it as it would refuse it sent alone."""
    requests: list[tuple[Sequence[W], bytes]] = []
    start, answers = 0, 0
    for end, item in enumerate(items):
        size = answer_size(item)
        if end > start and (end - start == max_items or answers + size > limit):
            _fit(items[start:end], encode, limit, requests)
            start, answers = end, 0
        answers += size
    if start < len(items):
        _fit(items[start:], encode, limit, requests)
    return requests


def _fit(
    items: Sequence[W],
    encode: Callable[[Sequence[W]], bytes],
    limit: int,
    requests: list[tuple[Sequence[W], bytes]],
) -> None:
    payload = encode(items)
    if len(payload) <= limit or len(items) == 1:
        requests.append((items, payload))
        return
    half = len(items) // 2
    _fit(items[:half], encode, limit, requests)
    _fit(items[half:], encode, limit, requests)


def answers(reply: object, count: int, batch: type[Any] | None) -> list[object]:
    """What each of a request's `count` items gets: its reply, or the exception to raise.

    `reply` is the decoded reply (or the exception every item gets); `batch` the batch reply
    type when the request was a batch, None when it was a single verb."""
    if isinstance(reply, BaseException):
        return [copy.copy(reply) for _ in range(count)]
    if isinstance(reply, Error):
        return [_refusal(reply) for _ in range(count)]
    results = reply.results if isinstance(reply, PreparedBatch | EndedBatch) else None
    if batch is not None and isinstance(reply, batch) and len(results or ()) == count:
        return [_refusal(r) if isinstance(r, Error) else r for r in results or ()]
    if batch is None and count == 1 and results is None:
        return [reply]
    shape = type(reply).__name__ if results is None else f"{len(results)} results"
    problem = f"the coordinator answered {count} items with {shape}"
    return [CommandError(ErrorCode.INTERNAL, problem) for _ in range(count)]


def _refusal(error: Error) -> CommandError:
    return CommandError(error.code, error.message, error.retry_after)
