"""Rebuilding a partition's table on start: its log's halves, then its op records, from the
checkpoint (TXN_LOG_<p>).

Reads only from the checkpointed offsets, so the cost follows what was still open at the
last checkpoint, not the whole history (RocketMQ keeps the same two consume offsets).
What it reads decides which transactions are open, so it reads a stream only once that stream
is current (`current.wait_current`: a leader, no replica behind; after a whole cluster
restarts, a node serves its copy while still rebuilding it from its raft log), and reads on
until the subject's last message as the stream's leader names it (a read that stopped short
is a gap, read again). Halves that appear later still are `late.LateHalves`' work; op
records that appear later are read by `take_fence` before the partition's first op write
is fenced, so that the fence is never past a record the table has not applied.
A record that cannot be read (a half without its headers, a pack or an op message that
does not decode, a record the table refuses) is quarantined and skipped: one bad record in
the coordinator's own streams must not keep a partition from starting. A read JetStream cannot
answer now (a timeout, a leader election) is retried with backoff from where it stopped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from txactors.coordinator.core.errors import CoordinatorStateError
from txactors.coordinator.core.events import OpReplayed
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.core.transactions import Checkpoint
from txactors.coordinator.partition.checkpoints import decode_ops
from txactors.coordinator.partition.discard import quarantine
from txactors.coordinator.partition.halves import StoredHalf, by_transaction, halves_stored
from txactors.coordinator.partition.packs import read_halves
from txactors.nats.acks import ack_fields
from txactors.nats.current import CURRENT_DEADLINE, wait_current
from txactors.nats.retry import (
    LINK_TROUBLE,
    RETRY_INITIAL,
    backoff,
    describe,
    retry_transient,
    transient,
)
from txactors.observe.logs import get_logger
from txactors.wire import layout

FETCH_BATCH = 512
GAP_READS = 3
"""Times a subject is read again when its last message lies beyond what was read."""

log = get_logger(__name__)


async def read_subject(
    js: JetStreamContext,
    stream: str,
    subject: str,
    start_seq: int,
    *,
    follow: Callable[[], Awaitable[None]] | None = None,
    headers_only: bool = False,
) -> AsyncIterator[Msg]:
    """Every message of `subject` from `start_seq` to the current end, in stream order;
    with `follow`, on and on: at the end, it reads again once `follow()` returns.

    A transient failure (`retry.transient`) drops the consumer and reads on from the message
    after the last one yielded, after a backoff; a permanent one is raised. `headers_only`
    messages have an empty body (the server's `Nats-Msg-Size` header says how long it is).
    """
    next_seq = max(start_seq, 1)
    delay = RETRY_INITIAL
    sub: JetStreamContext.PullSubscription | None = None
    remaining = 0
    try:
        while True:
            try:
                if sub is None:
                    config = ConsumerConfig(
                        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                        opt_start_seq=next_seq,
                        ack_policy=AckPolicy.NONE,
                        inactive_threshold=60.0,
                        headers_only=headers_only or None,
                    )
                    sub = await js.pull_subscribe(subject, stream=stream, config=config)
                    remaining = (await sub.consumer_info()).num_pending or 0
                if remaining <= 0:
                    if follow is None:
                        return
                    await follow()
                    remaining = FETCH_BATCH  # whatever came meanwhile (the fetch waits for one)
                try:
                    msgs = await sub.fetch(min(FETCH_BATCH, remaining), timeout=2.0)
                except nats.errors.TimeoutError:
                    if follow is None:
                        remaining = (await sub.consumer_info()).num_pending or 0
                    else:
                        remaining = 0  # the next look fetches anyway: no need to ask
                    continue
            except LINK_TROUBLE as error:
                if not transient(error):
                    raise
                log.warning(
                    "recovery_read_retry", subject=subject, error=describe(error), delay=delay
                )
                if sub is not None:
                    with contextlib.suppress(*LINK_TROUBLE):
                        await sub.unsubscribe()
                    sub = None
                await anyio.sleep(delay)
                delay = backoff(delay)
                continue
            delay = RETRY_INITIAL
            for msg in msgs:
                next_seq = ack_fields(msg).seq + 1
                yield msg
            remaining = ack_fields(msgs[-1]).pending if msgs else remaining
    finally:
        if sub is not None:
            await sub.unsubscribe()


class Recovered(NamedTuple):
    halves: int
    """TXN_HALF messages read (a pack counts once)."""
    ops: int
    """Op messages read."""
    half_end: int
    """The last TXN_HALF sequence read (or the one before the checkpoint's): whatever lies
    beyond it was written after recovery read the stream."""
    op_end: int
    """The last TXN_OP sequence read (or the one before the checkpoint's): `take_fence` reads
    on from there."""


class Fence(NamedTuple):
    seq: int
    """What the partition's first op write expects as its subject's last sequence."""
    ops: int
    """Op messages read and applied past recovery's read to reach it."""


class Read(NamedTuple):
    end: int
    """The last sequence read (`start_seq - 1` if none)."""
    last: int
    """The subject's last sequence as the leader named it after the last read (0: none)."""

    @property
    def fence(self) -> int:
        """The op fence this read makes: the subject's last sequence once nothing lies
        beyond what was read; else (the reads stopped short of a later last message) the
        last one read, which the first write finds stale: never a fence past an unread
        record."""
        return min(self.last, self.end)


async def recover(
    js: JetStreamContext,
    table: TransactionTable,
    partition: int,
    checkpoint: Checkpoint,
    remember: Callable[[StoredHalf], None],
    now: float,
    *,
    streams: layout.LogStreams | None = None,
) -> Recovered:
    """Replay into a fresh `table`, each stream once it is current: the partition's own
    (`streams`: others, e.g. the shared layout's when upgrading).

    `remember` sees every replayed half (the actor keeps the bodies of open transactions).
    The caller then takes the op fence with `take_fence` (which may replay more op records),
    calls `table.finish_recovery(now)` and carries out its actions.
    """
    table.begin_recovery(
        half_from=checkpoint.half_seq, op_from=checkpoint.op_seq, discarded=checkpoint.discarded
    )
    half_stream, op_stream = streams or layout.LogStreams.of(partition)
    halves = 0

    async def half(msg: Msg) -> None:
        """The halves of one half-stream message (a pack's, or one stored alone), fed per
        transaction in order. A transaction the table refuses is skipped, the others of its
        pack are kept, and the message is quarantined whole once."""
        nonlocal halves
        halves += 1
        try:
            stored = read_halves(ack_fields(msg).seq, msg.headers or {}, msg.data)
        except UNREADABLE as error:
            await _unreadable(js, table, partition, msg, half_stream, error)
            return
        refused: Exception | None = None
        for run in by_transaction(stored):
            try:
                table.handle(halves_stored(run), now)
            except UNREADABLE as error:
                refused = refused or error
                continue
            for one in run:
                remember(one)
        if refused is not None:
            await _unreadable(js, table, partition, msg, half_stream, refused)

    half_subject = layout.half_subject(partition)
    half_read = await read_whole(js, half_stream, half_subject, checkpoint.half_seq, half)
    ops = _OpReplay(js, table, partition, now, op_stream)
    op_read = await read_whole(
        js, op_stream, layout.op_subject(partition), checkpoint.op_seq, ops.replay
    )
    return Recovered(halves, ops.read, half_read.end, op_read.end)


async def take_fence(
    js: JetStreamContext, table: TransactionTable, partition: int, op_end: int, now: float
) -> Fence:
    """The fence of the partition's first op write (`Nats-Expected-Last-Subject-Sequence`),
    once the recovering `table` holds every op record up to it: the records that landed
    after recovery read TXN_OP up to `op_end` are read and applied first.

    Why: a predecessor's write can land after recovery's read (a leaver's last write still
    in flight when it gave the lease back, an instance of this process whose write settled
    meanwhile, a stalled owner's). A fence taken as the subject's last sequence alone would
    lie past such a record, which the table never applied: its transaction stays as it was
    (prepared though committed: checked back; a `done` missed: published again), and no
    write of the new owner is refused for it. So the fence is never past what the table
    applied.
    Reading the gap here rather than taking `op_end` as the fence: the usual case costs one
    look at the subject's last message either way, but a record in the gap is then applied
    instead of costing the new owner a refused first write (`FencedOut`: it stops, gives the
    lease back, and the partition is taken and recovered again). A record that lands after
    the fence still takes that way, as one from a second owner must.
    """
    last = await last_op_seq(js, partition)
    if last <= op_end:
        return Fence(last, 0)
    log.warning("recovery_op_gap", partition=partition, read_to=op_end, last=last)
    op_stream = layout.op_stream(partition)
    ops = _OpReplay(js, table, partition, now, op_stream)
    read = await read_whole(js, op_stream, layout.op_subject(partition), op_end + 1, ops.replay)
    return Fence(read.fence, ops.read)


class _OpReplay:
    """Op messages fed to a recovering table as `OpReplayed`; one it cannot read is
    quarantined and skipped."""

    def __init__(
        self, js: JetStreamContext, table: TransactionTable, partition: int, now: float, stream: str
    ) -> None:
        self._js, self._table, self._partition, self._now = js, table, partition, now
        self._stream = stream
        self.read = 0
        """Op messages read."""

    async def replay(self, msg: Msg) -> None:
        self.read += 1
        seq = ack_fields(msg).seq
        try:
            self._table.handle(OpReplayed(seq=seq, records=tuple(decode_ops(msg.data))), self._now)
        except UNREADABLE as error:
            await _unreadable(self._js, self._table, self._partition, msg, self._stream, error)


async def _unreadable(
    js: JetStreamContext,
    table: TransactionTable,
    partition: int,
    msg: Msg,
    stream: str,
    error: Exception,
) -> None:
    table.counters.quarantined += 1
    await quarantine(
        js,
        partition=partition,
        subject=msg.subject,
        headers=msg.headers or {},
        body=msg.data,
        reason=f"unreadable in recovery: {type(error).__name__}: {error}",
        stream=stream,
        seq=ack_fields(msg).seq,
    )


async def read_whole(
    js: JetStreamContext,
    stream: str,
    subject: str,
    start_seq: int,
    handle: Callable[[Msg], Awaitable[None]],
) -> Read:
    """Hand every message of `subject` from `start_seq` on to `handle`, once `stream` is
    current, and again from where it stopped while the leader names a later last message;
    returns the last sequence read and the last one the leader named. Waiting for the
    stream to be current takes `CURRENT_DEADLINE` at most, all reads together."""
    end = max(start_seq, 1) - 1
    last = 0
    delay = RETRY_INITIAL
    waiting_until = time.monotonic() + CURRENT_DEADLINE
    for _ in range(GAP_READS):
        await wait_current(js, stream, deadline=max(0.0, waiting_until - time.monotonic()))
        async for msg in read_subject(js, stream, subject, end + 1):
            end = ack_fields(msg).seq
            await handle(msg)
        last = await last_seq(js, stream, subject)
        if last <= end:
            return Read(end, last)
        log.warning("recovery_read_gap", stream=stream, subject=subject, read_to=end, last=last)
        await anyio.sleep(delay)
        delay = backoff(delay)
    return Read(end, last)


UNREADABLE = (KeyError, ValueError, TypeError, msgspec.DecodeError, CoordinatorStateError)
"""What reading a garbage record raises: a missing header, a bad number, bytes that do not
decode, or a record the table refuses (it leaves the table as it was)."""


async def last_op_seq(js: JetStreamContext, partition: int) -> int:
    """The stream sequence of the partition's newest op record (0: none), from the leader."""
    return await last_seq(js, layout.op_stream(partition), layout.op_subject(partition))


async def last_seq(js: JetStreamContext, stream: str, subject: str) -> int:
    """The stream sequence of the newest message on `subject` (0: none), from the leader."""
    try:
        last = await retry_transient(js.get_last_msg, stream, subject)
    except nats.js.errors.NotFoundError:
        return 0
    return last.seq or 0
