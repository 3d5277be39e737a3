"""Requests without a reply subject (one-way ends): carried out, never answered.

A producer may publish its `EndTransaction` without a reply subject (RocketMQ's
`endTransactionOneway`) and not wait for the coordinator: if the end is lost or refused, the
check-back settles the transaction. Such a request passes the same boundary and table as any
other; only its answer goes nowhere. An error it would have been answered with is counted
(`txactors_oneway_errors_total`) and logged at most once a minute per partition and code, with
the number left out, so a client flooding bad one-way ends cannot flood the log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from txactors.actors import Request
from txactors.actors.envelope import NO_REPLY
from txactors.observe.logs import RateLimited, get_logger
from txactors.wire.protocol import Error

log = get_logger(__name__)


class OneWayErrors:
    """Counts and (rate-limited) logs the errors of one partition's one-way requests."""

    def __init__(
        self,
        partition: int,
        *,
        on_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.partition = partition
        self._on_error = on_error
        self._logged = RateLimited(clock=clock)
        """One line per error code and minute."""

    def wrap(self, request: Request) -> Request:
        """`request` as is when it has a reply subject; otherwise one whose answers are
        reported here instead of published."""
        one_way = request.reply is None or request.reply is NO_REPLY
        return _OneWayRequest(request.message, self, request.subject) if one_way else request

    def report(self, command: Any, error: Error) -> None:
        if self._on_error is not None:
            self._on_error(error.code)
        suppressed = self._logged.suppressed(error.code)
        if suppressed is None:
            return
        log.warning(
            "oneway_request_failed",
            partition=self.partition,
            command=type(command).__name__,
            txid=getattr(command, "txid", None),
            code=error.code,
            error=error.message[:300],
            suppressed=suppressed,
        )


class _OneWayRequest(Request):
    """A request nobody waits for: an `Error` answer is reported, any other answer dropped."""

    __slots__ = ("_errors",)

    def __init__(self, message: Any, errors: OneWayErrors, subject: str | None) -> None:
        super().__init__(message, None, subject)
        self._errors = errors

    async def answer(self, value: Any) -> None:
        if isinstance(value, Error):
            self._errors.report(self.message, value)
