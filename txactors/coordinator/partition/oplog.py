"""`OpLog`: group-committed, fenced appends to one partition's TXN_OP subject.

One append is in flight at a time, carrying every op record queued meanwhile, fenced with
`Nats-Expected-Last-Subject-Sequence` so that a second coordinator writing the same
partition is detected instead of interleaving decisions. A lost ack is recognised by
reading the subject's last message back (our own write landed) before trying again.

Records nobody waits for (`done`, `checked`: `DEFERRABLE`) wait up to `DEFER` for a decision
to share its write, so that at moderate rates a commit costs one TXN_OP write, not two.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field

import anyio
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck

from txactors.coordinator.core.records import OpKind, OpRecord
from txactors.coordinator.partition.store import encode_ops
from txactors.errors import TxActorsError
from txactors.nats.link import (
    Ack,
    AckInbox,
    Troubled,
    await_ack,
    link_generation,
    wait_connected,
)
from txactors.nats.retry import LINK_TROUBLE, RETRY_INITIAL, Fault, backoff, classify, describe
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


class FencedOut(TxActorsError):
    """Another coordinator appended to this partition's TXN_OP: stop writing at once."""


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
        """Set when records are queued."""
        self._urgent = False
        """Some queued record is a decision: the next write goes at once."""
        self._oldest = 0.0
        """When the oldest queued record was queued."""

    def append(self, op_id: int, records: tuple[OpRecord, ...]) -> None:
        """Queue records for the next write; they share it with everything queued meanwhile."""
        if not self._pending.op_ids:
            self._oldest = time.monotonic()
        self._urgent = self._urgent or any(r.kind not in DEFERRABLE for r in records)
        self._pending.op_ids.append(op_id)
        self._pending.records.extend(records)
        self._wakeup.set()

    async def run(self) -> None:
        try:
            await self._write_forever()
        finally:
            await self._inbox.close()

    async def _write_forever(self) -> None:
        while True:
            if not self._pending.op_ids:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                continue
            wait = self._oldest + DEFER - time.monotonic()
            if not self._urgent and wait > 0:
                self._wakeup = anyio.Event()
                with anyio.move_on_after(wait):
                    await self._wakeup.wait()  # a decision to join, or only more of the same
                continue
            batch, self._pending, self._urgent = self._pending, _PendingOps(), False
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
                try:
                    landed = await self._landed(payload)
                except LINK_TROUBLE as unread:  # ours or a successor's? Ask again after a retry
                    log.warning("op_append_retry", subject=self._subject, error=describe(unread))
                else:
                    if landed is not None:
                        self._last_seq = landed
                        return landed
                    if error.err_code == WRONG_LAST_SEQUENCE:
                        raise FencedOut(
                            f"{self._subject} was written by someone else after seq "
                            f"{self._last_seq}: another coordinator owns this partition; "
                            "this one stops"
                        ) from error
                    level = log.error if classify(error) is Fault.PERMANENT else log.warning
                    level("op_append_refused", subject=self._subject, error=describe(error))
            except (*LINK_TROUBLE, Troubled) as error:
                log.warning("op_append_retry", subject=self._subject, error=describe(error))
                # No stream took the write (no responders: TXN_OP electing a leader), so
                # nothing landed; otherwise its ack may be what was lost.
                if not isinstance(error, nats.js.errors.NoStreamResponseError):
                    with suppress(*LINK_TROUBLE):
                        landed = await self._landed(payload)
                        if landed is not None:
                            self._last_seq = landed
                            return landed
            else:
                self._last_seq = ack.seq
                return ack.seq
            await anyio.sleep(delay)
            delay = backoff(delay)

    async def _await(self, future: asyncio.Future[PubAck], generation: int) -> PubAck:
        outcome = await await_ack(self._nc, future, generation, time.monotonic())
        if outcome is not Ack.SETTLED:
            future.cancel()
            raise Troubled("connection lost" if outcome is Ack.LINK_LOST else "no ack")
        return future.result()

    async def _landed(self, payload: bytes) -> int | None:
        """The seq of our own write if it is the subject's last message (a lost ack), else
        None. Raises `LINK_TROUBLE` when the subject cannot be read within
        `READ_BACK_TIMEOUT`."""
        await wait_connected(self._nc)
        with anyio.fail_after(READ_BACK_TIMEOUT):
            last = await self._js.get_last_msg(layout.OP_STREAM, self._subject)
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
