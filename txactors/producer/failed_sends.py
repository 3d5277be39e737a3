"""Transactions with a failed send: the check-back for them is answered ROLLBACK.

A send that failed (refused, unconfirmed, cancelled while its prepare was out) leaves the
transaction with only part of what the caller meant to send, and maybe a half nobody was
told about. Committing it would publish that part: all-or-nothing is broken. The caller
cannot commit it (`Transaction.end` refuses), but a transaction that is dropped, abandoned
or whose end never arrives is decided by the check-back, and the user's checker, which
looks at the local database, may well answer COMMIT. So while this process remembers the
failed send, it answers the check-back ROLLBACK itself, whatever the checker would say.

Kept apart from the in-flight registry, which forgets a transaction as soon as work on it
stops, the very moment the check-back becomes the checker's. Bounded twice, so memory
cannot grow without bound: at most `capacity` txids (the oldest forgotten first) and each
for at most `max_age` seconds, which covers the coordinator's whole default check schedule
(a first check after at most `max_immunity`, 1 h, then `check_max` checks over about another
hour) with room for an operator resuming a discarded transaction. Once forgotten, or in
another process (a restart, another member of the group), the checker answers.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from txactors.errors import ConfigError

DEFAULT_CAPACITY = 10_000
DEFAULT_MAX_AGE = 24 * 3600.0
MAX_REASON_LENGTH = 300
"""A reason is an error's text, which may quote what was sent: kept short, it stays small."""


class FailedSends:
    """txid → why one of its sends failed, oldest forgotten first."""

    __slots__ = ("_capacity", "_clock", "_failed", "_max_age")

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        max_age: float = DEFAULT_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1 or max_age <= 0:
            raise ConfigError("capacity must be at least 1 and max_age positive")
        self._capacity = capacity
        self._max_age = max_age
        self._clock = clock
        self._failed: OrderedDict[str, tuple[float, str]] = OrderedDict()
        """In the order they failed: the first entry is always the oldest."""

    def __len__(self) -> int:
        self._expire()
        return len(self._failed)

    def add(self, txid: str, reason: str) -> None:
        """A send of `txid` failed: its check-back must roll it back. The first reason stays
        (later sends are refused before they go out)."""
        self._expire()
        if txid not in self._failed:
            self._failed[txid] = (self._clock(), reason[:MAX_REASON_LENGTH])
        while len(self._failed) > self._capacity:
            self._failed.popitem(last=False)

    def forget(self, txid: str) -> None:
        """The coordinator confirmed the rollback: no check-back will ask any more."""
        self._failed.pop(txid, None)

    def reason(self, txid: str) -> str | None:
        """Why a send of `txid` failed, or None if none did (or it is forgotten)."""
        self._expire()
        entry = self._failed.get(txid)
        return None if entry is None else entry[1]

    def _expire(self) -> None:
        oldest = self._clock() - self._max_age
        while self._failed and next(iter(self._failed.values()))[0] <= oldest:
            self._failed.popitem(last=False)
