"""The coordinator's two ways of writing to JetStream, both group commits surviving broker faults.

With `sync_interval: always` (the durable default) nats-server flushes to disk once per write
it receives, so the number of writes, not of messages, sets the pace; both writers therefore
carry as many records as are waiting in each write.

- `PipelinedWriter` (TXN_HALF, topic streams, TXN_DISCARD): appends queue while a few writes
  await their acks; the next write carries everything queued for one stream, as an atomic
  batch (`allow_atomic`: stored all or nothing, one ack, consecutive sequences) where the
  stream allows it. Completions are reported in the order the appends were submitted. One
  connection delivers the writes in issue order, so submit order is stream order: the state
  machine sees halves in TXN_HALF order, as its checkpoint rule wants.
- `OpLog` (TXN_OP): one append in flight, carrying every op record queued meanwhile, fenced
  with `Nats-Expected-Last-Subject-Sequence` so a second coordinator writing the same
  partition is detected instead of interleaving decisions.

Faults (see `classify`): when the connection drops, or an ack is overdue, or JetStream
answers with a transient error, *every* pending ack is given up at once and the unfinished
appends are issued again, in order and with the same `Nats-Msg-Id`, once the connection is
back. A lost ack thus costs one reconnect, not one ack timeout per append. JetStream refuses
a whole batch if any of its `Nats-Msg-Id`s is already stored (a re-sent batch whose first
attempt did land), or if one message is refused: then each append of it is written alone,
where a duplicate is answered with its first sequence and a bad one is refused by itself.
A permanent error (too large, stream gone or refusing the write) is not retried: the append
is handed to `quarantine` and reported as `None`, so the partition goes on. Nothing is
reported before its append is settled.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import Header, PubAck
from nats.nuid import NUID

from txactors import layout
from txactors.coordinator.core.records import OpRecord
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

MAX_WRITES_IN_FLIGHT = 2
"""Writes of a `PipelinedWriter` awaiting acks before appends wait to join the next one."""
BATCH_MESSAGES = 1000
"""JetStream's most messages in one atomic batch."""
BATCH_BYTES = 1024 * 1024
"""Most bytes in one atomic batch: the server holds a batch in memory until its commit."""
ATOMIC_DISABLED = 10174
"""JetStream's error code for an atomic batch sent to a stream without `allow_atomic`."""

NO_RESPONDERS = "503"

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


class AckInbox:
    """Acks of our writes, on a reply subject of our own.

    nats-py 2.16's `publish_async` loses JetStream's refusal of a write (its reply handler
    raises instead of failing the future), which would leave a refused batch waiting for an
    ack until `ACK_TIMEOUT`; here every answer settles its future: an ack, an `APIError`, or
    `NoStreamResponseError` when no stream took the subject.
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._subscribed = False
        self._futures: dict[str, asyncio.Future[PubAck]] = {}
        self._tokens = itertools.count()

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> asyncio.Future[PubAck]:
        """Send the write now; the future settles with JetStream's answer."""
        if not self._subscribed:
            await self._nc.subscribe(f"{self._prefix}.*", cb=self._answered)
            self._subscribed = True
        token = str(next(self._tokens))
        future: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._futures[token] = future
        future.add_done_callback(lambda _: self._futures.pop(token, None))
        try:
            await self._nc.publish(
                subject, payload, reply=f"{self._prefix}.{token}", headers=headers
            )
        except BaseException:
            future.cancel()
            raise
        return future

    async def _answered(self, msg: Msg) -> None:
        future = self._futures.get(msg.subject[len(self._prefix) + 1 :])
        if future is None or future.done():
            return
        if (msg.headers or {}).get(Header.STATUS) == NO_RESPONDERS:
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            answer = json.loads(msg.data)
            if "error" in answer:
                nats.js.errors.APIError.from_error(answer["error"])  # raises the typed error
            future.set_result(PubAck.from_response(answer))
        except Exception as error:  # the typed refusal, or an answer we cannot read
            future.set_exception(error)


@dataclass(frozen=True, slots=True)
class Append:
    subject: str
    payload: bytes
    headers: dict[str, str]
    stream: str = ""
    """The stream holding `subject` if it takes atomic batches (`allow_atomic`): appends to
    it issued together go as one batch. Empty: each append is a publish of its own."""


Quarantine = Callable[[Append, str], Awaitable[None]]
"""Keeps an append JetStream refused for good (with the reason) where an operator sees it."""


class _Troubled(Exception):
    """An ack is lost or refused for now: give up every pending ack and issue again."""


@dataclass(slots=True)
class _Slot:
    append: Append
    batch: _Batch | None = None
    """The write that carries this append, once issued."""
    settled: bool = False
    ack: PubAck | None = None


@dataclass(eq=False, slots=True)
class _Batch:
    """One write: a single publish, or an atomic batch (one ack, for its last message)."""

    slots: list[_Slot]
    generation: int
    issued_at: float = field(default_factory=time.monotonic)
    future: asyncio.Future[PubAck] | None = None


@dataclass(slots=True)
class _Job:
    slots: list[_Slot]
    report: Callable[[list[PubAck | None]], Awaitable[None]]


class PipelinedWriter:
    """Appends written in few, large writes, reported in issue order (see the module docstring).

    Appends queue up while `max_in_flight` writes wait for their acks; the next write then
    carries everything queued to one stream, as an atomic batch where the stream allows it.
    """

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        quarantine: Quarantine,
        *,
        max_in_flight: int = MAX_WRITES_IN_FLIGHT,
    ) -> None:
        self._nc = nc
        self._js = js
        self._quarantine = quarantine
        self._max_in_flight = max_in_flight
        self._inbox = AckInbox(nc)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued: collections.deque[_Slot] = collections.deque()
        """Slots not yet issued, in submit order."""
        self._open: set[_Batch] = set()
        self._unbatched: set[str] = set()
        """Streams that refused an atomic batch as not allowed: written one by one."""
        self._wakeup = anyio.Event()
        self._issuing = anyio.Lock()
        self._gap = False
        """A write failed to go out: nothing more is issued until the collector re-issues."""

    async def submit(
        self, appends: list[Append], report: Callable[[list[PubAck | None]], Awaitable[None]]
    ) -> None:
        """Queue the appends; `report(acks)` runs once all are settled (None: quarantined).

        They go out at once if fewer than `max_in_flight` writes await their acks, else with
        the next write. While the connection is down nothing is issued.
        """
        job = _Job([_Slot(a) for a in appends], report)
        self._jobs.append(job)
        self._queued.extend(job.slots)
        if len(self._open) < self._max_in_flight:
            await self._issue_queued()
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

    # -- issuing ----------------------------------------------------------------------------

    async def _issue_queued(self) -> None:
        """Issue every queued slot: one write per stream (batches bounded by size)."""
        async with self._issuing:
            while self._queued and not self._gap and self._nc.is_connected:
                batch = self._next_batch()
                if not await self._issue(batch):
                    self._queued.extendleft(reversed(batch.slots))
                    self._gap = True

    def _next_batch(self) -> _Batch:
        """Take the first queued slot and the queued slots of its stream that may join it."""
        first = self._queued.popleft()
        taken = [first]
        stream = first.append.stream
        if stream and stream not in self._unbatched and self._fits(first.append):
            size = _size(first.append)
            kept: list[_Slot] = []
            while self._queued and len(taken) < BATCH_MESSAGES:
                slot = self._queued.popleft()
                a = slot.append
                if a.stream == stream and self._fits(a) and size + _size(a) <= BATCH_BYTES:
                    taken.append(slot)
                    size += _size(a)
                else:
                    kept.append(slot)
            self._queued.extendleft(reversed(kept))
        return _Batch(taken, link_generation(self._nc))

    def _fits(self, append: Append) -> bool:
        """Whether nats-py will send it: a refused message must not leave a batch unfinished."""
        return len(append.payload) <= self._nc.max_payload

    async def _issue(self, batch: _Batch) -> bool:
        """Send one write; False if the connection refused it (nothing of it counts as sent)."""
        *head, last = batch.slots
        try:
            if head:
                batch_id = _nuid.next().decode()
                for number, slot in enumerate(head, 1):
                    a = slot.append
                    headers = {**a.headers, Header.BATCH_ID: batch_id}
                    headers[Header.BATCH_SEQUENCE] = str(number)
                    await self._nc.publish(a.subject, a.payload, headers=headers)
                headers = {**last.append.headers, Header.BATCH_ID: batch_id}
                headers[Header.BATCH_SEQUENCE] = str(len(batch.slots))
                headers[Header.BATCH_COMMIT] = "1"
            else:
                headers = last.append.headers
            a = last.append
            batch.future = await self._inbox.publish(a.subject, a.payload, headers)
        except nats.errors.MaxPayloadError as error:  # permanent: settled as refused
            batch.future = asyncio.get_running_loop().create_future()
            batch.future.set_exception(error)
        except LINK_TROUBLE:
            return False
        for slot in batch.slots:
            slot.batch = batch
        self._open.add(batch)
        return True

    # -- settling ---------------------------------------------------------------------------

    async def _settle(self, slot: _Slot) -> None:
        if slot.settled:
            return
        if slot.batch is None:
            if self._gap or not self._nc.is_connected:
                raise _Troubled("not sent while the connection was down")
            await self._issue_queued()  # everything before it is settled: room to issue
            if slot.batch is None:
                raise _Troubled("not sent while the connection was down")
        batch = slot.batch
        await self._settle_batch(batch)
        if self._queued and len(self._open) < self._max_in_flight:
            await self._issue_queued()

    async def _settle_batch(self, batch: _Batch) -> None:
        future = batch.future
        assert future is not None
        while not future.done():
            if not self._nc.is_connected or link_generation(self._nc) != batch.generation:
                raise _Troubled("connection lost")
            if time.monotonic() - batch.issued_at > ACK_TIMEOUT:
                future.cancel()
                self._open.discard(batch)
                await self._one_by_one(batch)
                return
            await asyncio.wait({future}, timeout=LINK_POLL)
        self._open.discard(batch)
        if future.cancelled():
            raise _Troubled("cancelled")
        error = future.exception()
        if error is None:
            ack = future.result()
            if len(batch.slots) == 1:
                batch.slots[0].ack = ack
                batch.slots[0].settled = True
                return
            if ack.batch_size == len(batch.slots):
                first = ack.seq - len(batch.slots) + 1
                for offset, slot in enumerate(batch.slots):
                    slot.ack = PubAck(stream=ack.stream, seq=first + offset, domain=ack.domain)
                    slot.settled = True
                return
            error = ValueError(f"batch ack for {ack.batch_size} of {len(batch.slots)} messages")
        if len(batch.slots) > 1:
            # Refused as a whole (not allowed on the stream, one message refused or already
            # stored, the stream gone): each append alone gets its own answer.
            if _atomic_disabled(error):
                self._unbatched.add(batch.slots[0].append.stream)
            log.warning("batch_refused", appends=len(batch.slots), error=describe(error))
            await self._one_by_one(batch)
            return
        slot = batch.slots[0]
        if await self._permanent(slot.append, error):
            await self._quarantine(slot.append, describe(error))
            slot.settled = True
            return
        raise _Troubled(describe(error))

    async def _one_by_one(self, batch: _Batch) -> None:
        for slot in batch.slots:
            if not slot.settled:
                await self._ask_again(slot)

    async def _ask_again(self, slot: _Slot) -> None:
        """Settle an append of an overdue or refused write with a plain request (same
        `Nats-Msg-Id`): a duplicate is answered with the sequence of the stored copy."""
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
        for batch in self._open:
            if batch.future is not None and not batch.future.done():
                batch.future.cancel()  # frees its place in nats-py's window
        self._open.clear()
        pending = [s for j in self._jobs for s in j.slots if not s.settled]
        for slot in pending:
            slot.batch = None
        self._queued = collections.deque(pending)
        log.warning("appends_reissued", reason=reason, appends=len(pending), delay=delay)
        await anyio.sleep(delay)
        await wait_connected(self._nc)
        self._gap = False
        await self._issue_queued()


_nuid = NUID()


def _size(append: Append) -> int:
    return len(append.payload) + sum(len(k) + len(v) + 4 for k, v in append.headers.items())


def _atomic_disabled(error: BaseException) -> bool:
    return isinstance(error, nats.js.errors.APIError) and error.err_code == ATOMIC_DISABLED


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
        self._inbox = AckInbox(nc)
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
                future = await self._inbox.publish(self._subject, payload, headers)
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
