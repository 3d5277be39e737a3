"""Answering the coordinator's check-backs with the user's `checker`.

A check asks "what became of transaction X?" when its end never arrived (or said UNKNOWN).
It comes on this instance's own subject first, and on the group's queue subject when the
instance that prepared X is gone, so any live member of the group answers.

Checks for different transactions must not queue behind one slow checker (a database
under load, say), so an `ActorPool` of `CheckWorker` actors answers them, served with
`serve()` like every endpoint of ours: a check goes only to an idle worker, and while every
worker is busy the subscriptions wait (backpressure). It answers only inbox reply subjects (a
check whose reply subject is anything else, or missing, is dropped unexecuted; the guard logs
such refusals at most once a minute per pattern, with the count it suppressed) and stops with
`NatsConnectionLost` when its connection is closed for good.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Self, TypeVar

import anyio
import anyio.abc
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from txactors.actors import Actor, ActorPool, ActorSystem, serve
from txactors.actors.replies import ReplyGuard
from txactors.errors import ConfigError, NatsConnectionLost
from txactors.nats.client import raising_connection_lost, watch_connection
from txactors.observe.logs import get_logger
from txactors.producer.failed_sends import FailedSends
from txactors.producer.inflight import InFlight
from txactors.producer.outcomes import UnconfirmedOutcomes
from txactors.wire.inbox import DEFAULT_INBOX_PREFIX
from txactors.wire.layout import check_group_subject, check_instance_subject
from txactors.wire.protocol import (
    CheckResult,
    CheckTransaction,
    Decision,
    Error,
    ErrorCode,
    decode_payload,
)

T = TypeVar("T")

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class MessageView:
    """One half message of the transaction being checked, as the producer sent it."""

    index: int
    topic: str
    body: bytes
    keys: tuple[str, ...]
    tag: str | None
    properties: Mapping[str, str]

    def decode(self, type_: type[T]) -> T:
        """The body as `type_` (e.g. a msgspec Struct): msgpack, or JSON when the producer
        marked it `Content-Type: application/json`, as a consumer decodes it."""
        return decode_payload(self.body, self.properties, type_)


@dataclass(frozen=True, slots=True)
class CheckView:
    """What the checker is asked about: enough to look the transaction up locally."""

    txid: str
    group: str
    check_times: int
    """Inconclusive checks before this one."""
    messages: tuple[MessageView, ...]
    last: bool = False
    """The coordinator's last check: UNKNOWN now discards the transaction."""

    @classmethod
    def of(cls, check: CheckTransaction) -> CheckView:
        return cls(
            txid=check.txid,
            group=check.group,
            check_times=check.check_times,
            last=check.last,
            messages=tuple(
                MessageView(
                    index=m.index,
                    topic=m.topic,
                    body=m.body,
                    keys=tuple(m.keys),
                    tag=m.tag,
                    properties=m.properties,
                )
                for m in check.messages
            ),
        )


Checker = Callable[[CheckView], Awaitable[Decision] | Decision]
"""The user's answer to a check-back: COMMIT or ROLLBACK if the local transaction is known
to have committed or not, UNKNOWN to be asked again later. Async or plain."""


class CheckWorker(Actor):
    """Answers one check at a time; several run side by side in a `CheckResponder`.

    What the producer itself knows comes first: UNKNOWN while the transaction is still in
    flight here (at the last check, the claim of a local commit not begun yet: ROLLBACK; see
    `inflight`), ROLLBACK once one of its sends failed (committing would publish only part
    of it, whatever the checker thinks), then a decision it could not deliver; only then is
    the checker asked."""

    def __init__(
        self,
        checker: Checker,
        group: str,
        outcomes: UnconfirmedOutcomes,
        in_flight: InFlight,
        failed_sends: FailedSends,
        timeout: float,
    ) -> None:
        self._checker = checker
        self._group = group
        self._outcomes = outcomes
        self._in_flight = in_flight
        self._failed_sends = failed_sends
        self._timeout = timeout

    async def receive(self, message: CheckTransaction) -> CheckResult | Error:
        with structlog.contextvars.bound_contextvars(txid=message.txid, group=message.group):
            if message.group != self._group:
                return Error(
                    ErrorCode.BAD_REQUEST,
                    f"this producer answers for group {self._group!r}, not {message.group!r}",
                )
            source, resolution = await self._resolve(message)
            if isinstance(resolution, Error):
                return resolution
            log.info(
                "check_answered",
                resolution=resolution,
                check_id=message.check_id,
                check_times=message.check_times,
                last=message.last,
                source=source,
            )
            return CheckResult(txid=message.txid, check_id=message.check_id, resolution=resolution)

    async def _resolve(self, message: CheckTransaction) -> tuple[str, Decision | Error]:
        if message.txid in self._in_flight:
            claimed = self._in_flight.claim(message.txid) if message.last else None
            if claimed:
                log.warning(
                    "check_claimed_in_flight",
                    hint="its local transaction outlived the coordinator's check schedule: "
                    "rolled back, and its local commit will be refused",
                )
                return "claimed in flight", Decision.ROLLBACK
            if claimed is None:
                return "in flight", Decision.UNKNOWN
            # Its local commit began: the checker (the log) waits for that commit's outcome.
        failure = self._failed_sends.reason(message.txid)
        if failure is not None:
            log.warning(
                "check_rolled_back_after_failed_send",
                reason=failure,
                hint="a send of this transaction failed: committing it would publish only "
                "part of its messages, so the checker is not asked",
            )
            return "failed send", Decision.ROLLBACK
        remembered = self._outcomes.get(message.txid)
        if remembered is not None:
            return "unconfirmed end", remembered
        return "checker", await self._ask_checker(CheckView.of(message))

    async def _ask_checker(self, view: CheckView) -> Decision | Error:
        outcome: object = None
        with anyio.move_on_after(self._timeout) as scope:
            try:
                outcome = self._checker(view)
                if inspect.isawaitable(outcome):
                    outcome = await outcome
            except Exception as error:
                log.exception("checker_failed")
                return Error(
                    ErrorCode.INTERNAL, f"the checker raised {type(error).__name__}: {error}"
                )
        if scope.cancelled_caught:
            log.error("checker_timed_out", timeout=self._timeout)
            return Error(ErrorCode.TIMEOUT, f"the checker did not answer within {self._timeout}s")
        if not isinstance(outcome, Decision):
            log.error("checker_bad_result", result=repr(outcome))
            return Error(
                ErrorCode.INTERNAL,
                f"the checker returned {outcome!r}; it must return a Decision",
            )
        return outcome


class CheckResponder:
    """The check-back side of a producer: a pool of `concurrency` workers, served on the
    instance subject (plain subscription) and the group subject (queue group named after
    the group). Checks are answered only on reply subjects under `inbox_prefix`."""

    def __init__(
        self,
        nc: Client,
        *,
        group: str,
        instance: str,
        worker: Callable[[], CheckWorker],
        concurrency: int,
        inbox_prefix: str = DEFAULT_INBOX_PREFIX,
    ) -> None:
        if concurrency < 1:
            raise ConfigError("checker_concurrency must be at least 1")
        self._nc = nc
        self._replies = ReplyGuard(inbox_prefix)
        self._watch: anyio.abc.TaskGroup | None = None
        self._group = group
        self._instance = instance
        self._worker = worker
        self._concurrency = concurrency
        self._system = ActorSystem(f"producer-{group}-{instance}")
        self._subscriptions: list[Subscription] = []

    async def __aenter__(self) -> Self:
        await self._system.__aenter__()
        try:
            pool = await ActorPool.spawn(
                self._system, self._worker, self._concurrency, name=f"check-{self._group}"
            )
            endpoints = (
                (check_instance_subject(self._group, self._instance), ""),
                (check_group_subject(self._group), self._group),
            )
            for subject, queue in endpoints:
                # A check without a reply subject answers nobody: refused, never executed.
                self._subscriptions.append(
                    await serve(
                        self._nc,
                        pool,
                        subject,
                        CheckTransaction,
                        queue=queue,
                        replies=self._replies,
                        tells=False,
                    )
                )
            self._watch = anyio.create_task_group()
            await self._watch.__aenter__()
            self._watch.start_soon(watch_connection, self._nc)
        except BaseException as error:
            await self.__aexit__(type(error), error, error.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lost = await self._stop_watching()
        for subscription in self._subscriptions:
            with contextlib.suppress(nats.errors.Error):  # the connection may be closed
                await subscription.unsubscribe()
        self._subscriptions = []
        await self._system.__aexit__(exc_type, exc, tb)  # workers finish the check in hand
        if lost is not None:  # the producer's user sees why it stopped
            raise lost

    async def _stop_watching(self) -> NatsConnectionLost | None:
        """End the connection watch; the error it stopped with, if any."""
        watch, self._watch = self._watch, None
        if watch is None:
            return None
        watch.cancel_scope.cancel()
        try:
            with raising_connection_lost():
                # Not the caller's exception: handed in, the group would raise it here, and the
                # actor system below would never be left (its cancel scope stuck on the task).
                await watch.__aexit__(None, None, None)
        except NatsConnectionLost as lost:
            return lost
        return None
