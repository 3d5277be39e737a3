"""The coordinator's two ways of writing to JetStream, both surviving broker faults.

- `PipelinedWriter` (TXN_HALF, topic streams, TXN_DISCARD): many appends in flight at once,
  completions reported in the order the appends were issued. One connection delivers them
  to the server in that order, so issue order is stream order: the state machine sees
  halves in TXN_HALF order, as its checkpoint rule wants.
- `OpLog` (TXN_OP): one append in flight, carrying every op record queued meanwhile (group
  commit), fenced with `Nats-Expected-Last-Subject-Sequence` so a second coordinator
  writing the same partition is detected instead of interleaving decisions.

Faults (see `classify`): when the connection drops, or an ack is overdue, or JetStream
answers with a transient error, *every* pending ack is given up at once and the unfinished
appends are issued again, in order and with the same `Nats-Msg-Id`, once the connection is
back (so JetStream drops a copy whose first attempt did land). A lost ack thus costs one
reconnect, not one ack timeout per append. A permanent error (too large, stream gone or
refusing the write) is not retried: the append is handed to `quarantine` and reported as
`None`, so the partition goes on. Nothing is reported before its append is settled.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck

from txactors import layout
from txactors.coordinator.records import OpRecord
from txactors.coordinator.streams import encode_ops
from txactors.errors import TxActorsError
from txactors.logs import get_logger

log = get_logger(__name__)

T = TypeVar("T")

RETRY_INITIAL = 0.05
RETRY_MAX = 2.0
ACK_TIMEOUT = 5.0
"""An ack not back this long after its append, on a live connection, counts as lost."""
LINK_POLL = 0.05
"""How often a writer waiting for acks looks at the connection: a drop is noticed this fast."""
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code when `Nats-Expected-Last-Subject-Sequence` does not match."""
OP_BATCH_BYTES = 256 * 1024
"""Most bytes of op records in one TXN_OP message: a group commit never nears `max_payload`."""

LINK_TROUBLE = (nats.errors.Error, TimeoutError, OSError)
"""What a NATS or JetStream call raises when the broker, not our code, is the problem."""


class FencedOut(TxActorsError):
    """Another coordinator appended to this partition's TXN_OP: stop writing at once."""


class Fault(enum.Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"


def classify(error: BaseException) -> Fault:
    """Whether trying the same append again can succeed.

    Timeouts, lost connections, "no responders" (JetStream restarting or electing a leader)
    and 503/500 answers pass; anything else JetStream answers (too large, wrong expected
    sequence, stream sealed or misconfigured) will be answered the same way every time.
    A stream that is really gone answers "no responders" too: `PipelinedWriter` tells it
    apart by asking JetStream which stream holds the subject.
    """
    if isinstance(error, nats.js.errors.ServiceUnavailableError | nats.js.errors.ServerError):
        return Fault.TRANSIENT
    if isinstance(error, nats.js.errors.APIError | nats.errors.MaxPayloadError):
        return Fault.PERMANENT
    return Fault.TRANSIENT


async def retry_transient(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`await fn(*args)`, tried again with backoff while it fails transiently (`classify`)."""
    delay = RETRY_INITIAL
    while True:
        try:
            return await fn(*args)
        except LINK_TROUBLE as error:
            if classify(error) is Fault.PERMANENT:
                raise
            log.warning("jetstream_retry", call=fn.__name__, error=describe(error), delay=delay)
        await anyio.sleep(delay)
        delay = min(delay * 2, RETRY_MAX)


def link_generation(nc: Client) -> int:
    """Counts the connection's reconnects: an ack awaited since an older one is lost."""
    return int(nc.stats["reconnects"])


class LinkLost(TxActorsError):
    """The connection dropped while a JetStream call was waiting for its answer."""


async def linked(nc: Client, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`await fn(*args)`, given up with `LinkLost` as soon as the connection drops.

    A request sent to a server that then died is never answered; without this, the caller
    waits out the request's whole timeout even after the server is back.
    """
    generation = link_generation(nc)

    async def watch(scope: anyio.CancelScope) -> None:
        # nats-py offers callbacks only at connect time, which belong to the application
        while nc.is_connected and link_generation(nc) == generation:  # noqa: ASYNC110
            await anyio.sleep(LINK_POLL)
        scope.cancel()

    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch, tasks.cancel_scope)
        try:
            outcome.append(await fn(*args))
        except Exception as error:  # raised below as itself, not wrapped in a group
            failure.append(error)
        tasks.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if outcome:
        return outcome[0]
    raise LinkLost("the connection to NATS dropped while waiting for JetStream")


async def wait_connected(nc: Client) -> None:
    while not nc.is_connected:
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        await anyio.sleep(LINK_POLL)


@dataclass(frozen=True, slots=True)
class Append:
    subject: str
    payload: bytes
    headers: dict[str, str]


Quarantine = Callable[[Append, str], Awaitable[None]]
"""Keeps an append JetStream refused for good (with the reason) where an operator sees it."""


class _Troubled(Exception):
    """An ack is lost or refused for now: give up every pending ack and issue again."""


@dataclass(slots=True)
class _Slot:
    append: Append
    future: asyncio.Future[PubAck] | None = None
    generation: int = -1
    issued_at: float = 0.0
    settled: bool = False
    ack: PubAck | None = None


@dataclass(slots=True)
class _Job:
    slots: list[_Slot]
    report: Callable[[list[PubAck | None]], Awaitable[None]]


class PipelinedWriter:
    """Appends issued at once, reported in issue order (see the module docstring)."""

    def __init__(self, nc: Client, js: JetStreamContext, quarantine: Quarantine) -> None:
        self._nc = nc
        self._js = js
        self._quarantine = quarantine
        self._jobs: collections.deque[_Job] = collections.deque()
        self._wakeup = anyio.Event()
        self._issuing = anyio.Lock()
        self._gap = False
        """Some slot was left unissued: later ones wait for the collector to issue it first."""

    async def submit(
        self, appends: list[Append], report: Callable[[list[PubAck | None]], Awaitable[None]]
    ) -> None:
        """Issue the appends now; `report(acks)` runs once all are settled (None: quarantined).

        Waits only when nats-py's window of pending async publishes is full (backpressure).
        While the connection is down nothing is issued; the collector does it on reconnect.
        """
        job = _Job([_Slot(a) for a in appends], report)
        async with self._issuing:
            self._jobs.append(job)
            if self._nc.is_connected and not self._gap:
                for slot in job.slots:
                    if not await self._issue(slot):
                        break
        self._wakeup.set()

    async def run(self) -> None:
        """The collector: settles acks in issue order and reports each finished job."""
        delay = RETRY_INITIAL
        while True:
            if not self._jobs:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                continue
            job = self._jobs[0]
            try:
                for slot in job.slots:
                    await self._settle(slot)
            except _Troubled as trouble:
                await self._reissue(str(trouble), delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            delay = RETRY_INITIAL
            self._jobs.popleft()
            await job.report([slot.ack for slot in job.slots])

    async def _issue(self, slot: _Slot) -> bool:
        """Send one append; False (and a gap) if the connection refused it."""
        slot.generation = link_generation(self._nc)
        slot.issued_at = time.monotonic()
        a = slot.append
        try:
            slot.future = await self._js.publish_async(a.subject, a.payload, headers=a.headers)
        except nats.errors.MaxPayloadError as error:  # permanent: settled as refused
            slot.future = asyncio.get_running_loop().create_future()
            slot.future.set_exception(error)
        except LINK_TROUBLE:
            slot.future = None
            self._gap = True
            return False
        return True

    async def _settle(self, slot: _Slot) -> None:
        if slot.settled:
            return
        future = slot.future
        if future is None:
            raise _Troubled("not sent while the connection was down")
        while not future.done():
            if not self._nc.is_connected or link_generation(self._nc) != slot.generation:
                raise _Troubled("connection lost")
            if time.monotonic() - slot.issued_at > ACK_TIMEOUT:
                future.cancel()
                await self._ask_again(slot)
                return
            await asyncio.wait({future}, timeout=LINK_POLL)
        if future.cancelled():
            raise _Troubled("cancelled")
        error = future.exception()
        if error is None:
            slot.ack = future.result()
        elif await self._permanent(slot.append, error):
            await self._quarantine(slot.append, describe(error))
        else:
            raise _Troubled(describe(error))
        slot.settled = True

    async def _ask_again(self, slot: _Slot) -> None:
        """Settle an overdue append with a plain request (same `Nats-Msg-Id`).

        nats-py 2.16 loses JetStream's refusal of an async publish (its reply handler raises
        instead of failing the future), so an overdue ack may be an error nobody reported.
        """
        a = slot.append
        try:
            slot.ack = await linked(
                self._nc,
                functools.partial(
                    self._js.publish, a.subject, a.payload, timeout=ACK_TIMEOUT, headers=a.headers
                ),
            )
        except (*LINK_TROUBLE, LinkLost) as error:
            if not await self._permanent(a, error):
                raise _Troubled(describe(error)) from error
            await self._quarantine(a, describe(error))
        slot.settled = True

    async def _permanent(self, append: Append, error: BaseException) -> bool:
        if classify(error) is Fault.PERMANENT:
            return True
        if not isinstance(error, nats.js.errors.NoStreamResponseError):
            return False
        try:  # no responders: JetStream is down, or no stream holds the subject any more
            await self._js.find_stream_name_by_subject(append.subject)
        except nats.js.errors.NotFoundError:
            return True
        except LINK_TROUBLE:
            return False
        return False

    async def _reissue(self, reason: str, delay: float) -> None:
        """Give up every pending ack at once, then issue every unsettled append again."""
        pending = [s for j in self._jobs for s in j.slots if not s.settled]
        for slot in pending:
            if slot.future is not None and not slot.future.done():
                slot.future.cancel()  # frees its place in nats-py's window
            slot.future = None
        log.warning("appends_reissued", reason=reason, appends=len(pending), delay=delay)
        await anyio.sleep(delay)
        await wait_connected(self._nc)
        async with self._issuing:
            self._gap = False
            for job in self._jobs:
                for slot in job.slots:
                    if not slot.settled and slot.future is None and not await self._issue(slot):
                        return


def describe(error: BaseException) -> str:
    """One line naming the error, for logs and the quarantine header."""
    if isinstance(error, nats.js.errors.APIError):
        return f"{type(error).__name__} {error.code}/{error.err_code}: {error.description}"
    return f"{type(error).__name__}: {error}".rstrip(": ")


@dataclass(slots=True)
class _PendingOps:
    op_ids: list[int] = field(default_factory=list)
    records: list[OpRecord] = field(default_factory=list)


class OpLog:
    """Group-committed, fenced appends to one partition's TXN_OP subject.

    An op record is never quarantined: the table waits for it. So a write JetStream refuses
    for good (the stream gone or sealed) is logged as an error and tried again with backoff
    until an operator repairs the stream; the partition's other work is not blocked meanwhile
    (`PipelinedWriter`s and the actor loop run beside it).
    """

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        partition: int,
        last_seq: int,
        report: Callable[[list[int], int], Awaitable[None]],
    ) -> None:
        self._nc = nc
        self._js = js
        self._subject = layout.op_subject(partition)
        self._last_seq = last_seq
        self._report = report
        self._pending = _PendingOps()
        self._wakeup = anyio.Event()

    def append(self, op_id: int, records: tuple[OpRecord, ...]) -> None:
        """Queue records for the next write; they share it with everything queued meanwhile."""
        self._pending.op_ids.append(op_id)
        self._pending.records.extend(records)
        self._wakeup.set()

    async def run(self) -> None:
        while True:
            if not self._pending.op_ids:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                continue
            batch, self._pending = self._pending, _PendingOps()
            seq = 0
            for payload in _payloads(batch.records):
                seq = await self._write(payload)
            await self._report(batch.op_ids, seq)

    async def _write(self, payload: bytes) -> int:
        delay = RETRY_INITIAL
        headers = {layout.EXPECTED_LAST_SUBJECT_SEQ_HEADER: str(self._last_seq)}
        while True:
            try:
                await wait_connected(self._nc)
                generation = link_generation(self._nc)
                future = await self._js.publish_async(self._subject, payload, headers=headers)
                ack = await self._await(future, generation)
            except nats.js.errors.APIError as error:
                # Our own earlier attempt may have landed (its ack lost): then the fence
                # refuses the retry, and the record is already where it belongs.
                landed = await self._landed(payload)
                if landed is not None:
                    self._last_seq = landed
                    return landed
                if error.err_code == WRONG_LAST_SEQUENCE:
                    raise FencedOut(
                        f"{self._subject} was written by someone else after seq "
                        f"{self._last_seq}: another coordinator owns this partition; this one stops"
                    ) from error
                level = log.error if classify(error) is Fault.PERMANENT else log.warning
                level("op_append_refused", subject=self._subject, error=describe(error))
            except (*LINK_TROUBLE, _Troubled) as error:
                log.warning("op_append_retry", subject=self._subject, error=describe(error))
                landed = await self._landed(payload)
                if landed is not None:
                    self._last_seq = landed
                    return landed
            else:
                self._last_seq = ack.seq
                return ack.seq
            await anyio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _await(self, future: asyncio.Future[PubAck], generation: int) -> PubAck:
        started = time.monotonic()
        while not future.done():
            lost = not self._nc.is_connected or link_generation(self._nc) != generation
            if lost or time.monotonic() - started > ACK_TIMEOUT:
                future.cancel()
                raise _Troubled("connection lost" if lost else "no ack")
            await asyncio.wait({future}, timeout=LINK_POLL)
        return future.result()

    async def _landed(self, payload: bytes) -> int | None:
        """The seq of our own write if it is the subject's last message (a lost ack)."""
        try:
            await wait_connected(self._nc)
            last = await self._js.get_last_msg(layout.OP_STREAM, self._subject)
        except LINK_TROUBLE:
            return None
        if last.seq is not None and last.seq > self._last_seq and last.data == payload:
            return last.seq
        return None


def _payloads(records: list[OpRecord]) -> list[bytes]:
    """The group commit as TXN_OP messages of at most OP_BATCH_BYTES each (one record at least)."""
    whole = encode_ops(records)
    if len(whole) <= OP_BATCH_BYTES or len(records) == 1:
        return [whole]
    half = len(records) // 2
    return _payloads(records[:half]) + _payloads(records[half:])
