"""Rebuilding a partition's table on start: TXN_HALF, then TXN_OP, from the checkpoint.

Reads only from the checkpointed offsets, so the cost follows what was still open at the
last checkpoint, not the whole history (RocketMQ keeps the same two consume offsets).
A record that cannot be read (a half without its headers, an op message that does not
decode, a record the table refuses) is quarantined and skipped: one bad record in the
coordinator's own streams must not keep a partition from starting. A read JetStream cannot
answer now (a timeout, a leader election) is retried with backoff from where it stopped.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from txactors import layout
from txactors.coordinator.core.errors import CoordinatorStateError
from txactors.coordinator.core.events import HalvesStored, OpReplayed
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.core.transactions import Checkpoint
from txactors.coordinator.discard import quarantine
from txactors.coordinator.link import (
    LINK_TROUBLE,
    RETRY_INITIAL,
    backoff,
    describe,
    retry_transient,
    transient,
)
from txactors.coordinator.store import StoredHalf, decode_ops, read_half
from txactors.logs import get_logger

FETCH_BATCH = 512

log = get_logger(__name__)


async def read_subject(
    js: JetStreamContext, stream: str, subject: str, start_seq: int
) -> AsyncIterator[Msg]:
    """Every message of `subject` from `start_seq` to the current end, in stream order.

    A transient failure (`link.transient`) drops the consumer and reads on from the message
    after the last one yielded, after a backoff; a permanent one is raised.
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
                    )
                    sub = await js.pull_subscribe(subject, stream=stream, config=config)
                    remaining = (await sub.consumer_info()).num_pending or 0
                if remaining <= 0:
                    return
                try:
                    msgs = await sub.fetch(min(FETCH_BATCH, remaining), timeout=2.0)
                except nats.errors.TimeoutError:
                    remaining = (await sub.consumer_info()).num_pending or 0
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
                next_seq = msg.metadata.sequence.stream + 1
                yield msg
            remaining = msgs[-1].metadata.num_pending if msgs else remaining
    finally:
        if sub is not None:
            await sub.unsubscribe()


async def recover(
    js: JetStreamContext,
    table: TransactionTable,
    partition: int,
    checkpoint: Checkpoint,
    remember: Callable[[StoredHalf], None],
    now: float,
) -> tuple[int, int]:
    """Replay into a fresh `table`; returns (halves read, op messages read).

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
            seq=msg.metadata.sequence.stream,
        )

    async for msg in read_subject(
        js, layout.HALF_STREAM, layout.half_subject(partition), checkpoint.half_seq
    ):
        halves += 1
        try:
            stored = read_half(msg.metadata.sequence.stream, msg.headers or {}, msg.data)
            table.handle(_stored_event(stored), now)
        except _UNREADABLE as error:
            await unreadable(msg, layout.HALF_STREAM, error)
            continue
        remember(stored)
    async for msg in read_subject(
        js, layout.OP_STREAM, layout.op_subject(partition), checkpoint.op_seq
    ):
        ops += 1
        seq = msg.metadata.sequence.stream
        try:
            table.handle(OpReplayed(seq=seq, records=tuple(decode_ops(msg.data))), now)
        except _UNREADABLE as error:
            await unreadable(msg, layout.OP_STREAM, error)
    return halves, ops


_UNREADABLE = (KeyError, ValueError, TypeError, msgspec.DecodeError, CoordinatorStateError)
"""What reading a garbage record raises: a missing header, a bad number, bytes that do not
decode, or a record the table refuses (it leaves the table as it was)."""


def _stored_event(stored: StoredHalf) -> HalvesStored:
    return HalvesStored(
        txid=stored.txid,
        token=stored.token,
        group=stored.group,
        producer=stored.producer,
        halves=(stored.half,),
        begins=stored.begins,
    )


async def last_op_seq(js: JetStreamContext, partition: int) -> int:
    """The stream sequence of the partition's newest op record (0: none): the fence's start."""
    try:
        subject = layout.op_subject(partition)
        last = await retry_transient(js.get_last_msg, layout.OP_STREAM, subject)
    except nats.js.errors.NotFoundError:
        return 0
    return last.seq or 0
