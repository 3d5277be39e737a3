"""Three raw ways to write many small messages into one JetStream stream (for bench ingest).

Plain nats-py publishes with the ADR-50 headers or reply subjects, no txactors writer, so the
benchmark measures the server feature and the least client work each needs:

- `pipelined`: acked publishes, each with its own reply subject, at most `in_flight` unacked;
- `atomic`: atomic batches (`allow_atomic`): `Nats-Batch-Id`, `Nats-Batch-Sequence` on every
  message, `Nats-Batch-Commit: 1` and a reply subject on the last only; one ack per batch;
- `fast`: fast-ingest batches (`allow_batched`): the control state rides in the reply subject
  `<inbox>.<batch id>.<flow>.<gap mode>.<batch seq>.<op>.$FI` (op 0 start, 1 append, 2 commit);
  the server answers the start with a flow ack, then one flow ack every `msgs` persisted
  messages, and the commit with a pub ack. The publisher waits for the first flow ack, keeps at
  most `OUTSTANDING_ACKS` flows unacknowledged, and treats a gap or error reply as failure.

Every message carries a unique `Nats-Msg-Id`, as a half does (its stream dedupes).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.nuid import NUID

SUBJECT = "ingestbench.half"
BODY = b"h" * 300
MSG_ID = "Nats-Msg-Id"
BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"
OUTSTANDING_ACKS = 2
"""Flow acks a fast publisher may be behind before it waits (ADR-50: 2 suits most uses)."""

_nuid = NUID()


class PublishFailed(RuntimeError):
    """The server refused or lost part of a benchmark write."""


def _new_id() -> str:
    return _nuid.next().decode()


async def pipelined(nc: Client, count: int, in_flight: int) -> None:
    """`count` acked publishes, at most `in_flight` unacknowledged at any time."""
    inbox, tag = nc.new_inbox(), _new_id()
    window = asyncio.Semaphore(in_flight)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    acked = 0

    async def on_ack(msg: Msg) -> None:
        nonlocal acked
        window.release()
        if b'"error"' in msg.data:
            _fail(done, msg.data)
        acked += 1
        if acked == count and not done.done():
            done.set_result(None)

    sub = await nc.subscribe(inbox + ".*", cb=on_ack)
    try:
        for i in range(count):
            await window.acquire()
            if done.done():
                break
            await nc.publish(SUBJECT, BODY, f"{inbox}.{i}", {MSG_ID: f"{tag}.{i}"})
        await done
    finally:
        await sub.unsubscribe()


async def atomic(nc: Client, count: int, size: int, in_flight: int) -> None:
    """`count` messages as atomic batches of `size`, at most `in_flight` batches unacked."""
    inbox, tag = nc.new_inbox(), _new_id()
    window = asyncio.Semaphore(in_flight)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sizes: dict[str, int] = {}
    acked = 0

    async def on_ack(msg: Msg) -> None:
        nonlocal acked
        window.release()
        ack = json.loads(msg.data)
        expected = sizes.pop(msg.subject.rsplit(".", 1)[1])
        if "error" in ack or ack.get("count") != expected:
            _fail(done, msg.data)
        acked += expected
        if acked == count and not done.done():
            done.set_result(None)

    sub = await nc.subscribe(inbox + ".*", cb=on_ack)
    try:
        for start in range(0, count, size):
            await window.acquire()
            if done.done():
                break
            batch, n = _new_id(), min(size, count - start)
            sizes[batch] = n
            for seq in range(1, n + 1):
                headers = {MSG_ID: f"{tag}.{start + seq}", BATCH_ID: batch}
                headers[BATCH_SEQUENCE] = str(seq)
                reply = ""
                if seq == n:
                    headers[BATCH_COMMIT] = "1"
                    reply = f"{inbox}.{batch}"
                await nc.publish(SUBJECT, BODY, reply, headers)
        await done
    finally:
        await sub.unsubscribe()


async def fast(nc: Client, count: int, size: int, in_flight: int, flow: int) -> None:
    """`count` messages as fast-ingest batches of `size` (gap mode `fail`), `in_flight` at once,
    asking for a flow ack every `flow` messages (the server may ask for them more often)."""
    inbox, tag = nc.new_inbox(), _new_id()
    batches: dict[str, _FastBatch] = {}

    async def on_reply(msg: Msg) -> None:
        batch = batches.get(msg.subject[len(inbox) + 1 :].split(".", 1)[0])
        if batch is not None:  # else a late reply to a batch that already failed
            batch.on_reply(msg.data)

    async def one(start: int, n: int, window: asyncio.Semaphore) -> None:
        async with window:
            batch = _FastBatch(n)
            batches[batch.id] = batch
            await batch.publish(nc, f"{inbox}.{batch.id}.{flow}.fail", f"{tag}.{start}")
            del batches[batch.id]

    window = asyncio.Semaphore(in_flight)
    sub = await nc.subscribe(inbox + ".>", cb=on_reply)
    try:
        async with asyncio.TaskGroup() as tg:
            for start in range(0, count, size):
                tg.create_task(one(start, min(size, count - start), window))
    finally:
        await sub.unsubscribe()


class _FastBatch:
    """One fast-ingest batch: its flow state from the server's replies, and its final ack."""

    def __init__(self, size: int) -> None:
        self.id = _new_id()
        self.size = size
        self.acked = -1  # batch sequence of the last flow ack; -1 until the start is answered
        self.every = 1
        loop = asyncio.get_running_loop()
        self.result: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._waiter: asyncio.Future[None] | None = None

    def on_reply(self, data: bytes) -> None:
        reply = json.loads(data)
        kind = reply.get("type")
        if kind == "ack":
            self.acked, self.every = max(self.acked, reply["seq"]), reply["msgs"]
        elif kind is not None or "error" in reply:  # a gap, an error, or a refused batch
            _fail(self.result, data)
        elif not self.result.done():
            self.result.set_result(reply)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def publish(self, nc: Client, reply_prefix: str, msg_id_prefix: str) -> None:
        for seq in range(1, self.size + 1):
            op = fast_op(seq, self.size)
            headers = {MSG_ID: f"{msg_id_prefix}.{seq}"}
            await nc.publish(SUBJECT, BODY, f"{reply_prefix}.{seq}.{op}.$FI", headers)
            if op == 2:
                break
            while (self.acked < 0 or self.acked + self.every * OUTSTANDING_ACKS <= seq) and (
                not self.result.done()
            ):
                self._waiter = asyncio.get_running_loop().create_future()
                await self._waiter
            if self.result.done():
                break  # failed early: the result says why
        ack = await self.result
        if ack.get("count") != self.size:
            raise PublishFailed(f"fast batch stored {ack.get('count')} of {self.size}: {ack}")


def fast_op(seq: int, last: int) -> int:
    """The fast-ingest operation for batch sequence `seq` of `last`: commit, start, append."""
    return 2 if seq == last else 0 if seq == 1 else 1


def _fail(future: asyncio.Future[Any], data: bytes) -> None:
    if not future.done():
        future.set_exception(PublishFailed(data.decode(errors="replace")))
