"""The checker of one partition: the actor that owns the table's timer and the check-backs.

It talks to its partition actor only by messages. The partition tells it `CheckWork`: the
table's next deadline (only when it is earlier than the one told before, so the commit path
sends nothing) and the `SendCheck` actions of a step. The checker answers `Due` once that
deadline has passed on the coordinator's clock (the partition then runs `table.tick(now)`),
and `Checked` with the table's own event (`CheckAnswered`, or `CheckFailed` for a timeout,
no responder or an error) for each check-back. Both carry the `epoch` of the partition
instance that started the checker: a restarted partition ignores what an earlier one asked.

The timer sleeps until the deadline it was told, and is woken by an earlier one: no ticks
while a deadline is pending (eight partitions in a process would wake it eighty times a
second). It follows the injectable clock: a `MovingClock` (a test's `ManualClock`) wakes it
when it moves, so a test that moves the clock is served at once; on any other clock but the
real time it looks every `tick_interval`. A fresh checker knows no deadline and reports due
at once, which is how a restarted one catches up.
A check-back's answer passes the same boundary as any request (protocol.Codec, then
validation): an answer that cannot be read or is about another check is inconclusive.
"""

from __future__ import annotations

import time

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from txactors.actors import Actor, LocalActorRef, RemoteActorRef
from txactors.coordinator.boundary import check_answer_problem
from txactors.coordinator.core.effects import CheckTarget, SendCheck
from txactors.coordinator.core.events import CheckAnswered, CheckFailed, CheckFailure
from txactors.coordinator.options import Clock, MovingClock
from txactors.coordinator.partition.halves import checked_message, half_in
from txactors.coordinator.partition.packs import read_raw_halves
from txactors.errors import ActorDeadError, ActorError, AskTimeout, CommandError
from txactors.nats.retry import describe
from txactors.observe.logs import get_logger
from txactors.observe.metrics import CoordinatorMetrics
from txactors.wire import layout
from txactors.wire.protocol import CheckResult, CheckTransaction, Decision, ErrorCode, encode

log = get_logger(__name__)


class CheckWork(msgspec.Struct, frozen=True, kw_only=True):
    """Partition → checker: check-backs to send now, and when the table next has work."""

    sends: tuple[SendCheck, ...] = ()
    deadline: float | None = None
    """The table's next deadline as last told (None: nothing scheduled)."""


class Due(msgspec.Struct, frozen=True):
    """Checker → partition: the deadline has come; tick the table and tell the next one."""

    epoch: int


class Checked(msgspec.Struct, frozen=True):
    """Checker → partition: what became of one check-back, as the table's own event."""

    epoch: int
    event: CheckAnswered | CheckFailed


class Checker(Actor):
    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        partition: int,
        owner: LocalActorRef,
        epoch: int,
        clock: Clock,
        tick_interval: float,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.partition = partition
        self._stream = layout.half_stream(partition)
        self.owner = owner
        self.epoch = epoch
        self.clock = clock
        self.metrics = metrics
        self._poll = tick_interval if _polled(clock) else float("inf")
        """The longest sleep: a clock that cannot say it moved is looked at every tick."""
        self._deadline: float | None = float("-inf")  # unknown: ask the partition at once
        self._changed = anyio.Event()
        self._in_flight: set[str] = set()

    async def on_start(self) -> None:
        self.start_task(self._timer)
        if isinstance(self.clock, MovingClock):
            self.start_task(self._follow, self.clock)

    async def receive(self, message: CheckWork) -> None:
        if not isinstance(message, CheckWork):
            raise ActorError(f"checker got an unexpected {type(message).__name__}")
        self._deadline = message.deadline
        self._changed.set()
        for send in message.sends:
            if send.txid in self._in_flight and self.metrics is not None:
                self.metrics.duplicate_checks.labels(self.partition).inc()
            self._in_flight.add(send.txid)
            self.start_task(self._check, send)

    async def _timer(self) -> None:
        while True:
            deadline = self._deadline
            remaining = None if deadline is None else deadline - self.clock()
            if remaining is not None and remaining <= 0:
                self._deadline = None  # until the partition tells the next one
                await self.owner.tell(Due(self.epoch))
                continue
            self._changed = anyio.Event()  # set by a deadline told, or the clock moving
            if remaining is None:
                await self._changed.wait()
                continue
            with anyio.move_on_after(min(remaining, self._poll)):
                await self._changed.wait()

    async def _follow(self, clock: MovingClock) -> None:
        """Wake the timer whenever the clock moves."""
        while True:
            await clock.moved()
            self._changed.set()

    async def _check(self, send: SendCheck) -> None:
        try:
            resolution, failure = await ask_producer(self.nc, self.js, send, self._stream)
        except Exception as error:  # JetStream, the connection or a half failed: inconclusive
            log.warning("check_back_failed", txid=send.txid, error=describe(error))
            resolution, failure = None, CheckFailure.ERROR
        self._in_flight.discard(send.txid)
        event: CheckAnswered | CheckFailed
        if resolution is not None:
            event = CheckAnswered(txid=send.txid, check_id=send.check_id, resolution=resolution)
        else:
            reason = failure or CheckFailure.ERROR
            event = CheckFailed(txid=send.txid, check_id=send.check_id, reason=reason)
        await self.owner.tell(Checked(self.epoch, event))


def _polled(clock: Clock) -> bool:
    """Whether the timer must look at `clock` every tick: it can neither be slept on (the
    real time) nor say when it moves (a `MovingClock`)."""
    return clock is not time.time and not isinstance(clock, MovingClock)


async def ask_producer(
    nc: Client, js: JetStreamContext, action: SendCheck, stream: str
) -> tuple[Decision | None, CheckFailure | None]:
    """The producer's answer, or why there is none (no responders, timeout, error); the
    halves are read from `stream`, their partition's."""
    # The table times this check out `timeout` after it was sent; ours must end first, so
    # that its outcome, not a second check, is what follows.
    deadline = time.monotonic() + action.timeout
    if action.target is CheckTarget.INSTANCE:
        subject = layout.check_instance_subject(action.group, action.producer)
    else:
        subject = layout.check_group_subject(action.group)
    resolution: Decision | None = None
    failure: CheckFailure | None = None
    try:
        command = await _check_command(js, action, stream)
        size = len(encode(command))
        if size > nc.max_payload:
            raise CommandError(
                ErrorCode.BAD_REQUEST,
                f"the check-back takes {size} bytes, more than max_payload {nc.max_payload}: "
                "the transaction's messages together are too large to be checked back",
            )
        result = await RemoteActorRef(nc, subject, CheckResult).ask(
            command, timeout=max(deadline - time.monotonic(), 0.001)
        )
        problem = check_answer_problem(result, txid=action.txid, check_id=action.check_id)
        if problem is not None:
            raise CommandError(ErrorCode.BAD_REQUEST, problem)
        resolution = result.resolution
    except ActorDeadError:
        failure = CheckFailure.NO_RESPONDERS
    except AskTimeout:
        failure = CheckFailure.TIMEOUT
    except (CommandError, nats.errors.Error) as error:
        # One check that cannot be made or answered is inconclusive; it never stops the
        # partition (its actor would restart into the same check, again and again).
        log.warning("check_back_error", txid=action.txid, error=str(error) or repr(error))
        failure = CheckFailure.ERROR
    log.info(
        "check_back",
        txid=action.txid,
        check_id=action.check_id,
        target=action.target.value,
        check_times=action.check_times,
        last=action.last,
        resolution=resolution,
        failure=failure,
    )
    return resolution, failure


async def _check_command(js: JetStreamContext, action: SendCheck, stream: str) -> CheckTransaction:
    """The check-back, its messages read from `stream`: each message there once, however
    many of the transaction's halves it holds (a pack holds many, all at its sequence)."""
    messages = {
        seq: read_raw_halves(await js.get_msg(stream, seq))
        for seq in dict.fromkeys(h.seq for h in action.halves)
    }
    stored = [half_in(messages[h.seq], action.txid, h.index) for h in action.halves]
    return CheckTransaction(
        txid=action.txid,
        group=action.group,
        check_id=action.check_id,
        check_times=action.check_times,
        messages=[checked_message(s) for s in stored],
        last=action.last,
    )
