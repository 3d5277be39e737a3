"""What one partition's coordinator speaks (batches, protocol version), learnt from its
answers and relearnt after a while: the producer's protocol-version fallback, without I/O."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

from txactors.wire.protocol import OLDEST_VERSION, PROTOCOL_VERSION, ErrorCode

RELEARN_AFTER: Final = 60.0
"""Seconds a partition's coordinator is spoken to in the older form it asked for before the
newest form is tried again (a rolling upgrade may have replaced it meanwhile)."""


class Dialect:
    """What one partition's coordinator speaks, learnt from its answers: batches and protocol
    version 3 until it refuses them (an older coordinator); shared by the partition's links.

    A downgrade is not forever: a rolling upgrade replaces the old coordinator with a new one.
    `RELEARN_AFTER` seconds (on `clock`) after a refusal, one request (`probe`) tries the newest
    form again: refused, the dialect stays downgraded for another interval (the refused items go
    again alone, nothing of them executed); answered, the newest form is spoken again. A probe
    never answered (lost, timed out) is tried again an interval later.

    A one-way end has no answer to learn from, and an older coordinator would drop a batch of
    them unseen: one-way ends go as a batch only once a batch was answered (`served`) since
    the last downgrade."""

    __slots__ = ("_clock", "_relearn_after", "_retry_at", "batches", "served", "version")

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, relearn_after: float = RELEARN_AFTER
    ) -> None:
        self.batches = True
        self.served = False
        self.version = PROTOCOL_VERSION
        self._clock = clock
        self._relearn_after = relearn_after
        self._retry_at: float | None = None
        """Downgraded: when the newest form may be tried again."""

    def probe_due(self) -> bool:
        """Downgraded, and the newest form may be tried again: the next request may probe."""
        return self._retry_at is not None and self._clock() >= self._retry_at

    def probe(self) -> bool:
        """True when the caller's next request is to try the newest form (batches, version 3):
        one probe per interval, so one at a time."""
        if self._retry_at is None:  # the usual case, without reading the clock
            return False
        now = self._clock()
        if now < self._retry_at:
            return False
        self._retry_at = now + self._relearn_after
        return True

    def refused(self, code: str, *, batch: bool, version: int, probe: bool = False) -> bool:
        """A command (a batch or not, in `version`; the `probe` or not) was refused whole with
        `code`. True when nothing of it was executed and its items are to go again alone, as
        this dialect says from now on: an older coordinator's refusal of the version or of
        batches, or a batch refused `bad_request` (more items, or longer answers, than that
        coordinator takes in one; alone, each item gets its own answer: a probe so refused
        was understood, the newest form is spoken)."""
        if code == ErrorCode.UNSUPPORTED_VERSION and version > OLDEST_VERSION:
            self._downgrade(OLDEST_VERSION)
            return True
        if code == ErrorCode.UNKNOWN_COMMAND and batch:
            self._downgrade(self.version)
            return True
        if code == ErrorCode.BAD_REQUEST and batch:
            self.answered(batch=False, probe=probe)
            return True
        return False

    def answered(self, *, batch: bool, probe: bool) -> None:
        """A command was answered, not refused for its form (`batch`: a batch, with a batch's
        answer). An answered probe: the coordinator speaks the newest form again."""
        if probe:
            self.batches, self.version, self._retry_at = True, PROTOCOL_VERSION, None
        if batch and self._retry_at is None:
            self.served = True

    def _downgrade(self, version: int) -> None:
        self.batches, self.version, self.served = False, version, False
        self._retry_at = self._clock() + self._relearn_after
