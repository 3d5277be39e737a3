"""The coordinator's two ways of writing to JetStream, both retrying until durable.

- `PipelinedWriter` (TXN_HALF, topic streams, TXN_DISCARD): many appends in flight at once,
  completions reported in the order the appends were issued. One connection delivers them
  to the server in that order, so issue order is stream order: the state machine sees
  halves in TXN_HALF order, as its checkpoint rule wants.
- `OpLog` (TXN_OP): one append in flight, carrying every op record queued meanwhile (group
  commit), fenced with `Nats-Expected-Last-Subject-Sequence` so a second coordinator
  writing the same partition is detected instead of interleaving decisions.

A failed or timed-out append is retried with the same `Nats-Msg-Id`, so JetStream drops the
copy if the first attempt did land. Nothing is reported before its append is acknowledged.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from txactors import layout
from txactors.coordinator.records import OpRecord
from txactors.coordinator.streams import encode_ops
from txactors.errors import TxActorsError
from txactors.logs import get_logger

log = get_logger(__name__)

RETRY_INITIAL = 0.05
RETRY_MAX = 2.0
ACK_TIMEOUT = 5.0
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error code when `Nats-Expected-Last-Subject-Sequence` does not match."""


class FencedOut(TxActorsError):
    """Another coordinator appended to this partition's TXN_OP: stop writing at once."""


@dataclass(frozen=True, slots=True)
class Append:
    subject: str
    payload: bytes
    headers: dict[str, str]


@dataclass(slots=True)
class _Job:
    appends: list[Append]
    futures: list[asyncio.Future[PubAck]]
    report: Callable[[list[PubAck]], Awaitable[None]]


async def publish_until_acked(js: JetStreamContext, append: Append) -> PubAck:
    """Publish and wait for the ack, retrying with backoff for as long as it takes."""
    delay = RETRY_INITIAL
    while True:
        try:
            return await js.publish(
                append.subject, append.payload, timeout=ACK_TIMEOUT, headers=append.headers
            )
        except (nats.errors.Error, TimeoutError, OSError) as error:
            log.warning("append_retry", subject=append.subject, error=repr(error), delay=delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)


class PipelinedWriter:
    """Appends issued at once, reported in issue order (see the module docstring)."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._jobs: collections.deque[_Job] = collections.deque()
        self._wakeup = anyio.Event()

    async def submit(
        self, appends: list[Append], report: Callable[[list[PubAck]], Awaitable[None]]
    ) -> None:
        """Issue the appends now; `report(acks)` runs once all are durable.

        Waits only when nats-py's window of pending async publishes is full (backpressure).
        """
        futures = [
            await self._js.publish_async(a.subject, a.payload, headers=a.headers) for a in appends
        ]
        self._jobs.append(_Job(appends, futures, report))
        self._wakeup.set()

    async def run(self) -> None:
        """The collector: awaits acks in issue order and reports each finished job."""
        while True:
            if not self._jobs:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                continue
            job = self._jobs[0]
            acks = [await self._ack(a, f) for a, f in zip(job.appends, job.futures, strict=True)]
            self._jobs.popleft()
            await job.report(acks)

    async def _ack(self, append: Append, future: asyncio.Future[PubAck]) -> PubAck:
        try:
            with anyio.fail_after(ACK_TIMEOUT):
                return await future
        except (nats.errors.Error, TimeoutError) as error:
            log.warning("append_unacknowledged", subject=append.subject, error=repr(error))
            return await publish_until_acked(self._js, append)


@dataclass(slots=True)
class _PendingOps:
    op_ids: list[int] = field(default_factory=list)
    records: list[OpRecord] = field(default_factory=list)


class OpLog:
    """Group-committed, fenced appends to one partition's TXN_OP subject."""

    def __init__(
        self,
        js: JetStreamContext,
        partition: int,
        last_seq: int,
        report: Callable[[list[int], int], Awaitable[None]],
    ) -> None:
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
            seq = await self._write(encode_ops(batch.records))
            await self._report(batch.op_ids, seq)

    async def _write(self, payload: bytes) -> int:
        delay = RETRY_INITIAL
        headers = {layout.EXPECTED_LAST_SUBJECT_SEQ_HEADER: str(self._last_seq)}
        while True:
            try:
                ack = await self._js.publish(
                    self._subject, payload, timeout=ACK_TIMEOUT, headers=headers
                )
            except nats.js.errors.APIError as error:
                if error.err_code != WRONG_LAST_SEQUENCE:
                    raise
                raise FencedOut(
                    f"{self._subject} was written by someone else after seq {self._last_seq}: "
                    "another coordinator owns this partition; this one stops"
                ) from error
            except (nats.errors.Error, TimeoutError, OSError) as error:
                # A timeout may hide a write that landed; then the fence fails on retry, which
                # we recognise by reading the last record back.
                log.warning("op_append_retry", subject=self._subject, error=repr(error))
                landed = await self._landed(payload)
                if landed is not None:
                    self._last_seq = landed
                    return landed
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                continue
            self._last_seq = ack.seq
            return ack.seq

    async def _landed(self, payload: bytes) -> int | None:
        """The seq of our own write if it is the subject's last message (a lost ack)."""
        try:
            last = await self._js.get_last_msg(layout.OP_STREAM, self._subject)
        except (nats.errors.Error, TimeoutError, OSError):
            return None
        if last.seq is not None and last.seq > self._last_seq and last.data == payload:
            return last.seq
        return None
