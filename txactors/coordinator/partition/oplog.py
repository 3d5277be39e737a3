"""`OpWriter`: group-committed, fenced appends to a partition's TXN_LOG_<p>.

A partition appends to its op subject through its `OpLog`. Each partition has an `OpWriter`
of its own (`coordinator/writers.py`): its stream stands alone, so a stream electing a leader
holds up only its own partition's decisions. A writer has one write in flight at a time,
carrying every op record its logs queued meanwhile. The first message of each log in it
carries `Nats-Expected-Last-Subject-Sequence`, so that a second coordinator writing the same
partition is detected instead of interleaving decisions. Fewer than `ATOMIC_MIN_MESSAGES`
messages (the usual case: a group commit fits one message) go each alone, all in flight at
once: nats-server spends more on a small atomic batch than on the same messages one by one,
and answers it several ms later (see `nats/writer.py`). More go as an atomic batch (stored all
or nothing, at consecutive sequences: one flush to disk; nats-server checks each message's
own expectation; nothing can come between a log's messages in one batch, so the later ones
need none). A batch JetStream refuses (fenced out, or any other answer) is refused whole:
unless it was our own earlier attempt that landed (its ack lost, recognised by reading the
subject's last message back), its messages are written again one at a time, each with its
fence, so a log fenced out fails alone (`FencedOut`: its instance stops). A message sent
alone that is refused or loses its ack is written again alone the same way.

Records nobody waits for (`done`, `checked`: `DEFERRABLE`) wait up to `DEFER` for a decision
of their partition to share its message, so that at moderate rates a commit costs one TXN_OP
message, not two. Another partition's decision does not take them along: their flush would
hold its ack back.
A partition's log is opened once no write of its previous instance is in flight, and closed
(what it still queued dropped) when its instance ends: an instance that lost its lease
writes nothing more, so it cannot fence its successor out; one giving its lease back waits
for its write in flight first (`idle`, see `coordinator/service.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import Header, PubAck
from nats.nuid import NUID

from txactors.coordinator.core.records import OpKind, OpRecord
from txactors.coordinator.partition.checkpoints import encode_ops
from txactors.errors import TxActorsError
from txactors.nats.link import (
    Ack,
    AckInbox,
    WriteNotAcked,
    await_ack,
    link_generation,
    wait_connected,
)
from txactors.nats.retry import (
    LINK_TROUBLE,
    RETRY_INITIAL,
    Fault,
    api_error_code,
    backoff,
    classify,
    describe,
)
from txactors.nats.writer import ATOMIC_MIN_MESSAGES, BATCH_BYTES, BATCH_MESSAGES
from txactors.observe.logs import get_logger
from txactors.wire import layout

log = get_logger(__name__)

WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code when `Nats-Expected-Last-Subject-Sequence` does not match."""
DEFERRABLE = frozenset({OpKind.DONE, OpKind.CHECKED})
"""Records off every answer's path: a done closes a commit already published, a checked count
is advisory. Lost in a crash, they cost a re-publish (deduplicated) or one more check."""
DEFER = 0.02
"""Seconds deferrable records wait for a decision to share their write."""
READ_BACK_TIMEOUT = 1.0
"""Seconds a read-back of the subject's last message may take. A request sent while TXN_OP
has no leader is never answered: waiting out the JetStream API timeout (5 s) would hold the
partition's decisions that long after a new leader is elected."""
OP_BATCH_BYTES = 256 * 1024
"""Most bytes of op records in one TXN_OP message: a group commit never nears `max_payload`."""


Report = Callable[[list[int], int], Awaitable[None]]
"""Told the op ids whose records are stored, and the seq of the last message holding them."""


class FencedOut(TxActorsError):
    """Another coordinator appended to this partition's TXN_OP: stop writing at once."""


class OpLog:
    """One partition's TXN_OP subject: what it queued, and the fence of its next write."""

    __slots__ = (
        "_failed",
        "_report",
        "_writer",
        "last_seq",
        "op_ids",
        "open",
        "partition",
        "records",
        "since",
        "stream",
        "subject",
        "urgent",
    )

    def __init__(
        self,
        writer: OpWriter,
        partition: int,
        last_seq: int,
        report: Report,
        failed: Callable[[Exception], None],
    ) -> None:
        self._writer = writer
        self.partition = partition
        self.subject = layout.op_subject(partition)
        self.stream = layout.op_stream(partition)
        self.last_seq = last_seq
        """The subject's last sequence as far as we know: what the next write expects."""
        self._report = report
        self._failed = failed
        self.op_ids: list[int] = []
        self.records: list[OpRecord] = []
        self.urgent = False
        """Some queued record is a decision: the next write takes them at once."""
        self.since = 0.0
        """When the oldest queued record was queued."""
        self.open = True

    def append(self, op_id: int, records: tuple[OpRecord, ...]) -> None:
        """Queue records for the next write; they share it with everything queued meanwhile."""
        if not self.op_ids:
            self.since = time.monotonic()
        self.op_ids.append(op_id)
        self.records.extend(records)
        if not self.urgent and any(r.kind not in DEFERRABLE for r in records):
            self.urgent = True
        self._writer.queued(self.urgent, self.since)

    def close(self) -> None:
        """Write nothing more for this instance (what is in flight may still land)."""
        self._writer.close(self)

    async def reported(self, op_ids: list[int], seq: int) -> None:
        """`report`; what it raises fails this partition's instance, not the shared writer."""
        try:
            await self._report(op_ids, seq)
        except Exception as error:
            self._failed(error)

    def fenced(self, error: nats.js.errors.APIError) -> None:
        """Another coordinator wrote this subject: nothing more from here, the instance stops."""
        self.close()
        fenced = FencedOut(
            f"{self.subject} was written by someone else after seq {self.last_seq}: "
            "another coordinator owns this partition; this one stops"
        )
        fenced.__cause__ = error
        self._failed(fenced)


class _Taken:
    """What a log queued, taken for a write (the log queues anew meanwhile)."""

    __slots__ = ("log", "op_ids", "records", "urgent")

    def __init__(self, log: OpLog) -> None:
        self.log = log
        self.op_ids, self.records, self.urgent = log.op_ids, log.records, log.urgent
        log.op_ids, log.records, log.urgent = [], [], False


@dataclass(slots=True)
class _Message:
    log: OpLog
    payload: bytes
    seq: int = 0
    """Where it was stored (0: not stored, its partition fenced out or closed)."""


class OpWriter:
    """Group-committed, fenced appends to the op streams of its logs (one partition's, as
    `coordinator/writers.py` uses it; several share one write when given several).

    An op record is never quarantined: the table waits for it. So a write JetStream refuses
    for good (the stream gone or sealed) is logged as an error and tried again with backoff
    until an operator repairs the stream; the partitions' other work is not blocked meanwhile
    (`PipelinedWriter`s and the actor loops run beside it).
    """

    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self._nc = nc
        self._js = js
        self._inbox = AckInbox(nc)
        self._logs: dict[int, OpLog] = {}
        self._wakeup = anyio.Event()
        """Set when records are queued."""
        self._pending = False
        """Some log may have queued records."""
        self._urgent = False
        """Some queued record is a decision: the next write goes at once."""
        self._oldest = 0.0
        """When the oldest queued record was queued."""
        self._writing: frozenset[int] = frozenset()
        """The partitions whose records the write in flight carries."""
        self._settled = anyio.Event()
        """Set when a write settled."""

    async def idle(self, partition: int) -> None:
        """Until no write carrying `partition`'s records (a previous instance's) is in
        flight: its last sequence read from now on is the one the next write must expect."""
        while partition in self._writing:
            await self._settled.wait()

    def open(
        self, partition: int, last_seq: int, report: Report, failed: Callable[[Exception], None]
    ) -> OpLog:
        """The log of `partition`, whose subject's last sequence is `last_seq`; `report(op_ids,
        seq)` once their records are stored, `failed(error)` when the partition must stop."""
        log = self._logs[partition] = OpLog(self, partition, last_seq, report, failed)
        return log

    def close(self, log: OpLog) -> None:
        if self._logs.get(log.partition) is log:
            del self._logs[log.partition]
        log.open = False
        log.op_ids, log.records = [], []

    def queued(self, urgent: bool, since: float) -> None:
        if not self._pending:
            self._oldest = since  # the oldest of the logs' `since` (none queued before)
            self._pending = True
        self._urgent = self._urgent or urgent
        self._wakeup.set()

    async def run(self) -> None:
        try:
            await self._write_forever()
        finally:
            await self._inbox.close()

    async def _write_forever(self) -> None:
        while True:
            if not self._pending:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                continue
            now = time.monotonic()
            wait = self._oldest + DEFER - now
            if not self._urgent and wait > 0:
                self._wakeup = anyio.Event()
                with anyio.move_on_after(wait):
                    await self._wakeup.wait()  # a decision to join, or only more of the same
                continue
            logs = [log for log in self._logs.values() if log.op_ids]
            taken = [_Taken(log) for log in logs if log.urgent or log.since + DEFER <= now]
            left = [log.since for log in logs if log.op_ids]
            self._pending, self._urgent = bool(left), False
            self._oldest = min(left, default=0.0)
            if not taken:
                continue
            self._writing = frozenset(t.log.partition for t in taken)
            try:
                await self._write_all(taken)
            finally:
                self._writing = frozenset()
                self._settled.set()
                self._settled = anyio.Event()

    async def _write_all(self, taken: list[_Taken]) -> None:
        """Write what each log queued, then report: as atomic batches when there are many
        messages; else each alone, each log reported as soon as its message is stored, and
        the logs with a decision first: the others follow once those are acked, so that a
        decision's ack does not wait for their flushes as well."""
        messages = [_Message(t.log, p) for t in taken for p in _payloads(t.records)]
        if len(messages) < ATOMIC_MIN_MESSAGES and _distinct(messages):
            urgent = [(m, t.op_ids) for m, t in zip(messages, taken, strict=True) if t.urgent]
            await self._write_each(urgent)
            rest = [(m, t.op_ids) for m, t in zip(messages, taken, strict=True) if not t.urgent]
            await self._write_each(rest)
            return
        for chunk in _chunks(messages):
            await self._write(chunk)
        for t in taken:
            seqs = [m.seq for m in messages if m.log is t.log]
            if all(seqs):
                await t.log.reported(t.op_ids, seqs[-1])

    async def _write(self, chunk: list[_Message]) -> None:
        """Store the chunk, or what of it belongs to partitions still open and not fenced."""
        delay = RETRY_INITIAL
        while True:
            chunk = [m for m in chunk if m.log.open]
            if not chunk:
                return
            try:
                await wait_connected(self._nc)
                first = await self._send(chunk)
            except nats.js.errors.APIError as error:
                # Our own earlier attempt may have landed (its ack lost): then the fence
                # refuses the retry, and the records are already where they belong.
                if await self._landed(chunk):
                    return
                if len(chunk) > 1:  # refused whole: each alone, so a refusal is its own
                    for message in chunk:
                        await self._write([message])
                    return
                if api_error_code(error) == WRONG_LAST_SEQUENCE:
                    chunk[0].log.fenced(error)
                    return
                level = log.error if classify(error) is Fault.PERMANENT else log.warning
                level("op_append_refused", subject=chunk[0].log.subject, error=describe(error))
            except (*LINK_TROUBLE, WriteNotAcked) as error:
                log.warning("op_append_retry", subject=chunk[0].log.subject, error=describe(error))
                # No stream took the write (no responders: TXN_LOG_<p> electing a leader), so
                # nothing landed; otherwise its ack may be what was lost.
                nothing = isinstance(error, nats.js.errors.NoStreamResponseError)
                if not nothing and await self._landed(chunk):
                    return
            else:
                for offset, message in enumerate(chunk):
                    message.seq = message.log.last_seq = first + offset
                return
            await anyio.sleep(delay)
            delay = backoff(delay)

    async def _write_each(self, messages: list[tuple[_Message, list[int]]]) -> None:
        """Each message (one per log, with the op ids it stores) a write of its own, all in
        flight at once, its log reported once it is stored; one that was not sent, was
        refused or lost its ack is written again alone by `_write`."""
        generation = link_generation(self._nc)
        sent: list[asyncio.Future[PubAck] | None] = []
        for message, _ in messages:
            future = None
            if len(messages) > 1 and message.log.open and self._nc.is_connected:
                with contextlib.suppress(*LINK_TROUBLE):
                    future = await self._issue([message])
            sent.append(future)
        for (message, ids), future in zip(messages, sent, strict=True):
            if future is not None:
                try:
                    ack = await self._await(future, generation)
                except (nats.js.errors.APIError, *LINK_TROUBLE, WriteNotAcked):
                    future = None
                else:
                    message.seq = message.log.last_seq = ack.seq
            if future is None:
                await self._write([message])
            if message.seq:
                await message.log.reported(ids, message.seq)

    async def _send(self, chunk: list[_Message]) -> int:
        """One write (an atomic batch if it has several messages); the first one's seq."""
        generation = link_generation(self._nc)
        ack = await self._await(await self._issue(chunk), generation)
        if len(chunk) > 1 and ack.batch_size != len(chunk):
            raise WriteNotAcked(f"batch ack for {ack.batch_size} of {len(chunk)} messages")
        return ack.seq - len(chunk) + 1

    async def _issue(self, chunk: list[_Message]) -> asyncio.Future[PubAck]:
        """Publish the chunk (an atomic batch if it has several messages); the future of
        its ack."""
        fenced: set[int] = set()
        batch_id = _nuid.next().decode() if len(chunk) > 1 else None
        future: asyncio.Future[PubAck] | None = None
        for number, message in enumerate(chunk, 1):
            headers = {}
            if message.log.partition not in fenced:
                fenced.add(message.log.partition)
                headers[layout.EXPECTED_LAST_SUBJECT_SEQ_HEADER] = str(message.log.last_seq)
            if batch_id is not None:
                headers[Header.BATCH_ID] = batch_id
                headers[Header.BATCH_SEQUENCE] = str(number)
            if number < len(chunk):
                await self._nc.publish(message.log.subject, message.payload, headers=headers)
                continue
            if batch_id is not None:
                headers[Header.BATCH_COMMIT] = "1"
            future = await self._inbox.publish(message.log.subject, message.payload, headers)
        assert future is not None
        return future

    async def _await(self, future: asyncio.Future[PubAck], generation: int) -> PubAck:
        outcome = await await_ack(self._nc, future, generation, time.monotonic())
        if outcome is not Ack.SETTLED:
            future.cancel()
            raise WriteNotAcked("connection lost" if outcome is Ack.LINK_LOST else "no ack")
        return future.result()

    async def _landed(self, chunk: list[_Message]) -> bool:
        """Whether the chunk is stored (a lost ack): each partition's last message in it is
        its subject's last message, past the fence. Sets the seqs if so. Unreadable within
        `READ_BACK_TIMEOUT`: logged, and False (asked again after the next attempt)."""
        lasts = {m.log.partition: m for m in chunk}
        seqs: dict[int, int] = {}
        try:
            await wait_connected(self._nc)
            for partition, message in lasts.items():
                with anyio.fail_after(READ_BACK_TIMEOUT):
                    last = await self._js.get_last_msg(message.log.stream, message.log.subject)
                if last.seq is None or last.seq <= message.log.last_seq:
                    return False
                if last.data != message.payload:
                    return False
                seqs[partition] = last.seq
        except LINK_TROUBLE as unread:  # ours or a successor's? Ask again after a retry
            log.warning("op_append_retry", subject=chunk[0].log.subject, error=describe(unread))
            return False
        for message in chunk:  # only each partition's last seq is ever reported or expected
            message.seq = message.log.last_seq = seqs[message.log.partition]
        return True


def _payloads(records: list[OpRecord]) -> list[bytes]:
    """The group commit as TXN_OP messages of at most OP_BATCH_BYTES each (one record at least)."""
    whole = encode_ops(records)
    if len(whole) <= OP_BATCH_BYTES or len(records) == 1:
        return [whole]
    half = len(records) // 2
    return _payloads(records[:half]) + _payloads(records[half:])


def _distinct(messages: list[_Message]) -> bool:
    """Whether no partition has two of the messages: each message's fence is then its
    partition's last sequence, so they may all be in flight at once."""
    return len({m.log.partition for m in messages}) == len(messages)


def _chunks(messages: list[_Message]) -> list[list[_Message]]:
    """The messages in order, as writes of at most BATCH_MESSAGES and BATCH_BYTES each, each
    to one stream (an atomic batch cannot span streams)."""
    chunks: list[list[_Message]] = []
    size = 0
    for message in messages:
        if (
            not chunks
            or chunks[-1][0].log.stream != message.log.stream
            or len(chunks[-1]) >= BATCH_MESSAGES
            or size + len(message.payload) > BATCH_BYTES
        ):
            chunks.append([])
            size = 0
        chunks[-1].append(message)
        size += len(message.payload)
    return chunks


_nuid = NUID()
