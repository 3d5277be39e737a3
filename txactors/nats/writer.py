"""`PipelinedWriter`: the coordinator's group-committed appends (halves, topics, discards).

With `sync_interval: always` (the durable default) nats-server flushes to disk once per write
it receives, so the number of writes, not of messages, sets the pace: appends queue while a
few writes await their acks, and the next write carries everything queued for one stream, as
an atomic batch (`allow_atomic`: stored all or nothing, one ack, consecutive sequences) where
the stream allows it and at least `ATOMIC_MIN_MESSAGES` are queued for it (fewer go each
alone, all in flight: cheaper and sooner than a small atomic batch). With a `linger`, appends
queued while a write is in flight wait up to that long for more to join them before taking a
free pipeline slot (Nagle, or Kafka's `linger.ms` while busy): at moderate rates a write then
carries several transactions instead of one, and an idle writer still sends at once.
Completions are reported in the order the appends were submitted. One connection delivers the
writes in issue order, so submit order is stream order: the table sees halves in TXN_HALF
order, as its checkpoint rule wants. (TXN_OP has its own writer, `oplog.py`.)

Faults (see `retry.classify`): when the connection drops, or an ack is overdue, or JetStream
answers with a transient error, *every* pending ack is given up at once and the unfinished
appends are issued again, in order and with the same `Nats-Msg-Id`, once the connection is
back. A lost ack thus costs one reconnect, not one ack timeout per append. JetStream refuses
a whole batch if any of its `Nats-Msg-Id`s is already stored (a re-sent batch whose first
attempt did land), or if one message is refused: then each append of it is written alone,
where a duplicate is answered with its first sequence and a bad one is refused by itself.
A permanent error (too large, stream gone or refusing the write) is not retried: the append
is handed to its job's `quarantine` and reported as `None`, so the partition goes on (the
partitions of a coordinator process share a writer per stream, `coordinator/writers.py`:
each job brings its own report and quarantine). A writer given `redeclare` (a topic's)
instead declares a stream that is gone again and retries: what it writes is committed, and
must not be put aside because an operator dropped the stream.
Nothing is reported before its append is settled. While a fault lasts, `trouble` says why,
so the partition can tell producers when to come back rather than queue more behind it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import Header, PubAck
from nats.nuid import NUID

from txactors.nats.link import (
    ACK_TIMEOUT,
    Ack,
    AckInbox,
    WriteNotAcked,
    await_ack,
    link_generation,
    linked,
    until_changed,
    wait_connected,
)
from txactors.nats.retry import (
    LINK_TROUBLE,
    RETRY_INITIAL,
    Fault,
    LinkLost,
    api_error_code,
    backoff,
    classify,
    describe,
)
from txactors.observe.logs import get_logger

log = get_logger(__name__)

_BATCH_ID, _BATCH_SEQUENCE = Header.BATCH_ID, Header.BATCH_SEQUENCE
_BATCH_COMMIT = Header.BATCH_COMMIT
"""Read per message: `Header.X` goes through `EnumType.__getattr__`'s hook on Python 3.11."""

MAX_WRITES_IN_FLIGHT = 2
"""Writes of a `PipelinedWriter` awaiting acks before appends wait to join the next one."""
BATCH_MESSAGES = 1000
"""JetStream's most messages in one atomic batch."""
BATCH_BYTES = 1024 * 1024
"""Most bytes in one atomic batch: the server holds a batch in memory until its commit."""
ATOMIC_MIN_MESSAGES = 16
"""Messages a write needs to go as one atomic batch; fewer go each alone, all in flight. An
atomic batch costs nats-server (2.15) a few ms of CPU however small it is, and its ack comes
5-10 ms later, against 0.2-0.4 ms and under 1 ms for a single publish, fsynced or not: below
about 16 messages the singles are both cheaper and sooner (docs/benchmarks.md, atomic
batches at concurrency 1)."""
ATOMIC_DISABLED = 10174
"""JetStream's error code for an atomic batch sent to a stream without `allow_atomic`."""


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
Redeclare = Callable[[Append], Awaitable[None]]
"""Declares the stream that should hold an append whose stream is gone (never raises)."""
Report = Callable[[list[PubAck | None]], Awaitable[None]]
"""Told a job's acks once all are settled (None: the append was quarantined)."""


@dataclass(slots=True)
class _Slot:
    append: Append
    quarantine: Quarantine
    """Where this append goes if JetStream refuses it for good (its submitter's)."""
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
        *,
        max_in_flight: int = MAX_WRITES_IN_FLIGHT,
        linger: float = 0.0,
        redeclare: Redeclare | None = None,
    ) -> None:
        self._nc = nc
        self._js = js
        self._redeclare = redeclare
        self._max_in_flight = max_in_flight
        self._linger = linger
        self._inbox = AckInbox(nc)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._queued: collections.deque[_Slot] = collections.deque()
        """Slots not yet issued, in submit order."""
        self._open: set[_Batch] = set()
        self._unbatched: set[str] = set()
        """Streams that refused an atomic batch as not allowed: written one by one."""
        self._wakeup = anyio.Event()
        """Set when there is a job to collect."""
        self._asked = anyio.Event()
        """Set when appends were queued or a write settled: the issuer sends if there is room."""
        self._issued: asyncio.Future[None] | None = None
        """Settled when a write went out: the collector may be waiting for its append's write."""
        self._oldest = 0.0
        """When the oldest queued append was queued: it lingers until `_linger` after it."""
        self._issuing = anyio.Lock(fast_acquire=True)
        """Taken without a loop turn when free (anyio's default yields one on every acquire):
        an idle writer's append goes out in the turn that woke the issuer."""
        self._gap = False
        """A write failed to go out: nothing more is issued until the collector re-issues."""
        self.trouble: str | None = None
        """Why the oldest job waits for a retry (None: writes are going through)."""
        self._troubled = anyio.Event()
        """Set while in `trouble`: what waits for the next fault wakes when it begins."""
        self._clear = anyio.Event()
        self._clear.set()
        """Set while not in `trouble`."""
        self.retry_after = RETRY_INITIAL
        """The wait before the next retry while in `trouble`: a hint for producers."""

    async def troubled(self) -> None:
        """Return once the writer is in `trouble` (at once if it is now)."""
        await self._troubled.wait()

    async def cleared(self) -> None:
        """Return once the writer is out of `trouble` (at once if it is now)."""
        await self._clear.wait()

    def submit(
        self,
        appends: list[Append],
        report: Callable[[list[PubAck | None]], Awaitable[None]],
        quarantine: Quarantine,
    ) -> None:
        """Queue the appends; `report(acks)` runs once all are settled (None: handed to
        `quarantine`). `report` must not raise: the writer serves every submitter.

        Never waits, so an actor may submit in the middle of a step. They go out at once
        (the issuer's next turn) if no write awaits its ack; if fewer than `max_in_flight`
        do, once the oldest queued append has lingered `linger` seconds; else with the next
        write. While the connection is down nothing is issued.
        """
        job = _Job([_Slot(a, quarantine) for a in appends], report)
        if not self._queued:
            self._oldest = time.monotonic()
        self._jobs.append(job)
        self._queued.extend(job.slots)
        self._asked.set()
        self._wakeup.set()

    async def run(self) -> None:
        """The issuer and the collector, until cancelled."""
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._issue_when_asked)
                await self._collect()
        finally:
            await self._inbox.close()

    async def _issue_when_asked(self) -> None:
        """The one place writes go out (but re-issues after a fault): when there is room, at
        once if nothing is in flight, else once the oldest queued append has lingered
        `linger` seconds or a batch is full."""
        while True:
            if not self._queued or self._gap or len(self._open) >= self._max_in_flight:
                self._asked = anyio.Event()
                await self._asked.wait()
                continue
            if not self._nc.is_connected:
                await until_changed(self._nc)  # the collector re-issues once it is back
                continue
            wait = self._oldest + self._linger - time.monotonic()
            if wait > 0 and self._open and len(self._queued) < BATCH_MESSAGES:
                self._asked = anyio.Event()
                with anyio.move_on_after(wait):
                    await self._asked.wait()  # more appends: a full batch goes at once
                continue
            await self._issue_queued()

    async def _collect(self) -> None:
        """Settles acks in issue order and reports each finished job."""
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
            except WriteNotAcked as trouble:
                if self.trouble is None:
                    self._troubled.set()
                    self._clear = anyio.Event()
                self.trouble, self.retry_after = str(trouble), delay
                await self._reissue(str(trouble), delay)
                delay = backoff(delay)
                continue
            delay = RETRY_INITIAL
            if self.trouble is not None:
                self.trouble = None
                self._troubled = anyio.Event()
                self._clear.set()
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
            if self._issued is not None and not self._issued.done():
                self._issued.set_result(None)

    def _next_batch(self) -> _Batch:
        """Take the first queued slot and the queued slots of its stream that may join it."""
        first = self._queued.popleft()
        taken = [first]
        stream = first.append.stream
        if (
            stream
            and stream not in self._unbatched
            and self._fits(first.append)
            and self._queued_of(stream) >= ATOMIC_MIN_MESSAGES - 1
        ):
            size = _size(first.append)
            kept: list[_Slot] = []
            while self._queued and len(taken) < BATCH_MESSAGES:
                slot = self._queued.popleft()
                a = slot.append
                if a.stream == stream and self._fits(a):
                    grown = size + _size(a)
                    if grown <= BATCH_BYTES:
                        taken.append(slot)
                        size = grown
                        continue
                kept.append(slot)
            self._queued.extendleft(reversed(kept))
        return _Batch(taken, link_generation(self._nc))

    def _queued_of(self, stream: str) -> int:
        """Queued slots of `stream`, counted up to `ATOMIC_MIN_MESSAGES`: fewer go alone."""
        count = 0
        for slot in self._queued:
            if slot.append.stream == stream:
                count += 1
                if count >= ATOMIC_MIN_MESSAGES:
                    break
        return count

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
                    headers = {**a.headers, _BATCH_ID: batch_id}
                    headers[_BATCH_SEQUENCE] = str(number)
                    await self._nc.publish(a.subject, a.payload, headers=headers)
                headers = {**last.append.headers, _BATCH_ID: batch_id}
                headers[_BATCH_SEQUENCE] = str(len(batch.slots))
                headers[_BATCH_COMMIT] = "1"
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
        while slot.batch is None:  # the issuer sends it once it has lingered
            if self._gap or not self._nc.is_connected:
                raise WriteNotAcked("not sent while the connection was down")
            self._issued = asyncio.get_running_loop().create_future()
            await until_changed(self._nc, self._issued)
        batch = slot.batch
        await self._settle_batch(batch)
        self._asked.set()  # room for the next write

    async def _settle_batch(self, batch: _Batch) -> None:
        future = batch.future
        assert future is not None
        outcome = await await_ack(self._nc, future, batch.generation, batch.issued_at)
        if outcome is Ack.LINK_LOST:
            raise WriteNotAcked("connection lost")
        if outcome is Ack.OVERDUE:
            future.cancel()
            self._open.discard(batch)
            await self._one_by_one(batch)
            return
        self._open.discard(batch)
        if future.cancelled():
            raise WriteNotAcked("cancelled")
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
            await slot.quarantine(slot.append, describe(error))
            slot.settled = True
            return
        raise WriteNotAcked(describe(error))

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
                raise WriteNotAcked(describe(error)) from error
            await slot.quarantine(a, describe(error))
        slot.settled = True

    async def _permanent(self, append: Append, error: BaseException) -> bool:
        if classify(error) is Fault.PERMANENT:
            return True
        if not isinstance(error, nats.js.errors.NoStreamResponseError):
            return False
        try:  # no responders: JetStream is down, or no stream holds the subject any more
            await self._js.find_stream_name_by_subject(append.subject)
        except nats.js.errors.NotFoundError:
            if self._redeclare is None:
                return True
            await self._redeclare(append)  # then tried again, after the backoff
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
    """About the bytes `append` takes in a batch (characters, not UTF-8 bytes), in C."""
    headers = append.headers
    names, values = sum(map(len, headers.keys())), sum(map(len, headers.values()))
    return len(append.payload) + names + values + 4 * len(headers)


def _atomic_disabled(error: BaseException) -> bool:
    return api_error_code(error) == ATOMIC_DISABLED


class PartitionWriter:
    """One partition's way into a `PipelinedWriter` shared by a process's partitions (see
    `coordinator/writers.py`): its own quarantine, and its failures its own."""

    __slots__ = ("_failed", "_quarantine", "_writer")

    def __init__(
        self,
        writer: PipelinedWriter,
        quarantine: Quarantine,
        failed: Callable[[Exception], None],
    ) -> None:
        self._writer = writer
        self._quarantine = quarantine
        self._failed = failed

    @property
    def trouble(self) -> str | None:
        """Why the stream's writes wait for a retry (None: they are going through)."""
        return self._writer.trouble

    @property
    def retry_after(self) -> float:
        return self._writer.retry_after

    async def troubled(self) -> None:
        """Return once the stream's writes are in `trouble` (at once if they are now)."""
        await self._writer.troubled()

    async def cleared(self) -> None:
        """Return once the stream's writes go through again (at once if they do now)."""
        await self._writer.cleared()

    def submit(self, appends: list[Append], report: Report) -> None:
        """`PipelinedWriter.submit`, with a report that raises failing this partition only."""
        self._writer.submit(appends, functools.partial(self._reported, report), self._quarantine)

    async def _reported(self, report: Report, acks: list[PubAck | None]) -> None:
        try:
            await report(acks)
        except Exception as error:
            self._failed(error)
