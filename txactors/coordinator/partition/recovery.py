"""Rebuilding a partition's table on start: TXN_HALF, then TXN_OP, from the checkpoint.

Reads only from the checkpointed offsets, so the cost follows what was still open at the
last checkpoint, not the whole history (RocketMQ keeps the same two consume offsets).
What it reads decides which transactions are open, so it reads a stream only once that stream
is current (`current.wait_current`: a leader, no replica behind; after a whole cluster
restarts, a node serves its copy while still rebuilding it from its raft log), and reads on
until the subject's last message as the stream's leader names it (a read that stopped short
is a gap, read again). Halves that appear later still are `late.LateHalves`' work.
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
from txactors.coordinator.partition.discard import quarantine
from txactors.coordinator.partition.store import (
    StoredHalf,
    by_transaction,
    decode_ops,
    halves_stored,
    read_halves,
)
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


async def recover(
    js: JetStreamContext,
    table: TransactionTable,
    partition: int,
    checkpoint: Checkpoint,
    remember: Callable[[StoredHalf], None],
    now: float,
) -> Recovered:
    """Replay into a fresh `table`, each stream once it is current.

    `remember` sees every replayed half (the actor keeps the bodies of open transactions).
    The caller then calls `table.finish_recovery(now)` and carries out its actions.
    """
    table.begin_recovery(
        half_from=checkpoint.half_seq, op_from=checkpoint.op_seq, discarded=checkpoint.discarded
    )
    halves = ops = 0

    async def unreadable(msg: Msg, stream: str, error: Exception) -> None:
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

    async def half(msg: Msg) -> None:
        """The halves of one TXN_HALF message (a pack's, or one stored alone), fed per
        transaction in order. A transaction the table refuses is skipped, the others of its
        pack are kept, and the message is quarantined whole once."""
        nonlocal halves
        halves += 1
        try:
            stored = read_halves(ack_fields(msg).seq, msg.headers or {}, msg.data)
        except UNREADABLE as error:
            await unreadable(msg, layout.HALF_STREAM, error)
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
            await unreadable(msg, layout.HALF_STREAM, refused)

    async def op(msg: Msg) -> None:
        nonlocal ops
        ops += 1
        seq = ack_fields(msg).seq
        try:
            table.handle(OpReplayed(seq=seq, records=tuple(decode_ops(msg.data))), now)
        except UNREADABLE as error:
            await unreadable(msg, layout.OP_STREAM, error)

    half_subject = layout.half_subject(partition)
    half_end = await read_whole(js, layout.HALF_STREAM, half_subject, checkpoint.half_seq, half)
    await read_whole(js, layout.OP_STREAM, layout.op_subject(partition), checkpoint.op_seq, op)
    return Recovered(halves, ops, half_end)


async def read_whole(
    js: JetStreamContext,
    stream: str,
    subject: str,
    start_seq: int,
    handle: Callable[[Msg], Awaitable[None]],
) -> int:
    """Hand every message of `subject` from `start_seq` on to `handle`, once `stream` is
    current, and again from where it stopped while the leader names a later last message;
    returns the last sequence read (`start_seq - 1` if none). Waiting for the stream to be
    current takes `CURRENT_DEADLINE` at most, all reads together."""
    end = max(start_seq, 1) - 1
    delay = RETRY_INITIAL
    waiting_until = time.monotonic() + CURRENT_DEADLINE
    for _ in range(GAP_READS):
        await wait_current(js, stream, deadline=max(0.0, waiting_until - time.monotonic()))
        async for msg in read_subject(js, stream, subject, end + 1):
            end = ack_fields(msg).seq
            await handle(msg)
        last = await last_seq(js, stream, subject)
        if last <= end:
            return end
        log.warning("recovery_read_gap", stream=stream, subject=subject, read_to=end, last=last)
        await anyio.sleep(delay)
        delay = backoff(delay)
    return end


UNREADABLE = (KeyError, ValueError, TypeError, msgspec.DecodeError, CoordinatorStateError)
"""What reading a garbage record raises: a missing header, a bad number, bytes that do not
decode, or a record the table refuses (it leaves the table as it was)."""


async def last_op_seq(js: JetStreamContext, partition: int) -> int:
    """The stream sequence of the partition's newest op record (0: none): the fence's start."""
    return await last_seq(js, layout.OP_STREAM, layout.op_subject(partition))


async def last_seq(js: JetStreamContext, stream: str, subject: str) -> int:
    """The stream sequence of the newest message on `subject` (0: none), from the leader."""
    try:
        last = await retry_transient(js.get_last_msg, stream, subject)
    except nats.js.errors.NotFoundError:
        return 0
    return last.seq or 0
