"""Bytes per transaction: on the wire (the server's `/varz`) and in each record stored for it.

One embedded server (fsync `always`), and in this process a coordinator, a producer
(`send_in_transaction`, acked end) and a consumer of the topic: `count` transactions of one
128-byte message each, `concurrency` at a time. Reported per transaction: the bytes the server
received and sent (every hop: prepare, half write, replies, end, op records, publish, delivery,
acks), each hop's share as a `>` subscriber (`Wiretap`) sees it, and the size of each record
kind as stored (header block + body): the half in TXN_HALF, an op record in TXN_OP (alone, and
its share of a group-committed message), the committed message in its topic stream. Next to
it, the same count of raw acked single publishes of the same body (with a `Nats-Msg-Id`) read
by a nats-py pull consumer, on the same server.

Run `python -m bench wire` (or `just bench wire`); `measure` is the reusable part.
"""

from __future__ import annotations

import base64
import json
import socket
import urllib.request
from collections import Counter
from dataclasses import dataclass
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import RawStreamMsg
from rich.console import Console
from rich.table import Table

from bench import raw
from bench.workers import run_workers
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator.core.records import OpKind
from txactors.coordinator.partition.checkpoints import decode_ops, encode_ops
from txactors.coordinator.service import run_coordinator
from txactors.embedded.server import EmbeddedNatsServer
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.framing import header_block_bytes

BODY = b"x" * 128
TOPIC = "wirebench"
RAW_TOPIC = "wireraw"
CONCURRENCY = (1, 64)
RAW_FETCH = 64
SETTLE = 0.2
"""Seconds without a new TXN_OP message after the last delivery: the deferred `done` records
are written (they wait at most `oplog.DEFER`)."""


@dataclass(frozen=True)
class Record:
    """One stored record: its header block and body, in bytes."""

    headers: int
    body: int

    @property
    def total(self) -> int:
        return self.headers + self.body


@dataclass(frozen=True)
class WireReport:
    count: int
    concurrency: int
    bytes_in: float
    """Per transaction: what the server received (every client's writes)."""
    bytes_out: float
    msgs_in: float
    msgs_out: float
    half: Record
    op_alone: int
    """One commit record encoded alone (a TXN_OP message of one record)."""
    op_share: float
    """TXN_OP bytes (header blocks + bodies) per op record, as group-committed in this run."""
    ops_per_txn: float
    committed: Record
    hops: dict[str, float]
    """Per transaction, by `hop`: bytes of headers and body seen on the bus."""


def _varz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as response:
        varz: dict[str, Any] = json.load(response)
        return varz


async def _traffic(port: int) -> tuple[int, int, int, int]:
    varz = await anyio.to_thread.run_sync(_varz, port)
    return varz["in_bytes"], varz["out_bytes"], varz["in_msgs"], varz["out_msgs"]


def _record(raw_msg: RawStreamMsg) -> Record:
    block = base64.b64decode(raw_msg.hdrs) if raw_msg.hdrs else b""
    return Record(len(block), len(raw_msg.data or b""))


async def _last(nc: Client, stream: str) -> RawStreamMsg:
    js = nc.jetstream()
    info = await js.stream_info(stream)
    return await js.get_msg(stream, info.state.last_seq)


async def _settled_ops(nc: Client) -> int:
    """TXN_OP's last sequence once no write has come for `SETTLE` seconds."""
    js = nc.jetstream()
    last = -1
    while True:
        seq: int = (await js.stream_info(layout.OP_STREAM)).state.last_seq
        if seq == last:
            return seq
        last = seq
        await anyio.sleep(SETTLE)


def hop(subject: str, reply: str | None) -> str:
    """Which hop of a transaction a message seen on the bus is."""
    tokens = subject.split(".")
    acked = (reply or "").startswith("$JS.ACK.")  # a JetStream delivery
    if subject.startswith("txn.coord."):
        return f"request: {tokens[3]}"
    if subject.startswith("txn.half."):
        return "half: read back (late-halves follower)" if acked else "half: write"
    if subject.startswith("txn.op."):
        return "op records: write"
    if subject.startswith("topic."):
        return "committed: delivery to the consumer" if acked else "committed: publish"
    if subject.startswith("_INBOX."):
        return "replies and JetStream acks (_INBOX)"
    if subject.startswith("$JS.ACK."):
        return "consumer acks"
    if subject.startswith("$JS.API."):
        return "JetStream API (pull requests, ...)"
    return "other (leases, advisories)"


class Wiretap:
    """Every message on the bus (a `>` subscriber): bytes of header block and body per `hop`,
    as the server counts them in `/varz`; the server sent the wiretap `sum(bytes.values())`."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._sub: Subscription | None = None
        self.bytes: Counter[str] = Counter()
        self.messages: Counter[str] = Counter()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(">", cb=self._seen)
        await self._nc.flush()

    async def stop(self) -> tuple[Counter[str], int]:
        """(bytes by hop, messages) seen until now; sees nothing more."""
        await self._nc.flush()  # what the server sent before now has arrived
        if self._sub is not None:
            await self._sub.unsubscribe()
        return self.bytes.copy(), sum(self.messages.values())

    async def _seen(self, msg: Msg) -> None:
        name = hop(msg.subject, msg.reply)
        headers = header_block_bytes(msg.headers) if msg.headers else 0
        self.messages[name] += 1
        self.bytes[name] += headers + len(msg.data)


async def _transactions(
    nc: Client, tap: Wiretap, port: int, count: int, concurrency: int
) -> WireReport:
    delivered = 0
    all_in = anyio.Event()

    async def handle(message: ConsumedMessage) -> None:
        nonlocal delivered
        delivered += 1
        if delivered == count + 1:  # the warm-up's too
            all_in.set()

    async def one(_: int) -> None:
        result = await producer.send_in_transaction(
            TxMessage(TOPIC, BODY), lambda m, a: Decision.COMMIT
        )
        assert result.state == "committed", result

    async with (
        run_coordinator(nc),
        TransactionProducer(nc, "wire", lambda view: Decision.COMMIT) as producer,
        Consumer(nc, TOPIC, "wire", handle, concurrency=concurrency),
    ):
        await one(0)  # declares the topic stream and the consumer
        first_op = await _settled_ops(nc) + 1
        await tap.start()
        before = await _traffic(port)
        await run_workers(count, concurrency, one)
        await all_in.wait()
        last_op = await _settled_ops(nc)
        after = await _traffic(port)
        hops, tapped = await tap.stop()
        op_messages = [
            await nc.jetstream().get_msg(layout.OP_STREAM, seq)
            for seq in range(first_op, last_op + 1)
        ]
    bytes_in, bytes_out, msgs_in, msgs_out = (a - b for a, b in zip(after, before, strict=True))
    bytes_out -= sum(hops.values())  # what the server sent the wiretap: no transaction's
    msgs_out -= tapped
    records = [decode_ops(m.data or b"") for m in op_messages]
    commit = next(r for batch in records for r in batch if r.kind is OpKind.COMMIT)
    op_records = sum(len(batch) for batch in records)
    return WireReport(
        count=count,
        concurrency=concurrency,
        bytes_in=bytes_in / count,
        bytes_out=bytes_out / count,
        msgs_in=msgs_in / count,
        msgs_out=msgs_out / count,
        half=_record(await _last(nc, layout.HALF_STREAM)),
        op_alone=len(encode_ops([commit])),
        op_share=sum(_record(m).total for m in op_messages) / op_records,
        ops_per_txn=op_records / count,
        committed=_record(await _last(nc, layout.topic_stream(TOPIC))),
        hops={name: hops[name] / count for name in sorted(hops)},
    )


async def _raw(nc: Client, port: int, count: int, concurrency: int) -> tuple[float, float]:
    """(bytes in, bytes out) per message: acked publishes with `concurrency` in flight, then
    read by a pull consumer (fetch `RAW_FETCH`, ack each)."""
    subject = layout.topic_subject(RAW_TOPIC)
    await ensure_topic_stream(nc.jetstream(), RAW_TOPIC)
    sub = await nc.jetstream().pull_subscribe(
        layout.topic_filter(RAW_TOPIC), "raw", stream=layout.topic_stream(RAW_TOPIC)
    )
    before = await _traffic(port)
    await raw.publish_acked(nc, subject, BODY, range(count), concurrency)
    seen = 0
    while seen < count:
        for msg in await sub.fetch(min(RAW_FETCH, count - seen), timeout=5):
            await msg.ack()
            seen += 1
    await nc.flush()
    after = await _traffic(port)
    await sub.unsubscribe()
    return (after[0] - before[0]) / count, (after[1] - before[1]) / count


async def measure(count: int, concurrency: int) -> tuple[WireReport, tuple[float, float]]:
    """`count` transactions at `concurrency` on a fresh embedded server, then as many raw
    messages on the same server: (the transactions' report, raw (bytes in, out) per message)."""
    port = _free_port()
    async with EmbeddedNatsServer(extra_args=("-m", str(port))) as server:
        nc = await nats.connect(server.url)
        tap = Wiretap(await nats.connect(server.url))
        try:
            report = await _transactions(nc, tap, port, count, concurrency)
        finally:
            await tap._nc.close()
        try:
            return report, await _raw(nc, port, count, concurrency)
        finally:
            await nc.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("WARNING")
    count = 640 if quick else 3200
    table = Table(title=f"bytes per transaction ({count:,} of one {len(BODY)}-byte message)")
    for column in ("", *(f"{c} in flight" for c in CONCURRENCY)):
        table.add_column(column, justify="right")
    rows: dict[str, list[str]] = {}
    for concurrency in CONCURRENCY:
        report, (raw_in, raw_out) = await measure(count, concurrency)
        half, committed = report.half, report.committed
        for name, value in (
            ("wire: bytes in / out per txn", f"{report.bytes_in:,.0f} / {report.bytes_out:,.0f}"),
            ("wire: NATS msgs in / out per txn", f"{report.msgs_in:.2f} / {report.msgs_out:.2f}"),
            ("raw acked publish + pull: in / out", f"{raw_in:,.0f} / {raw_out:,.0f}"),
            (
                "wire: txn / raw",
                f"{(report.bytes_in + report.bytes_out) / (raw_in + raw_out):.1f}x",
            ),
            ("half (headers + body)", f"{half.headers} + {half.body}"),
            ("committed message (headers + body)", f"{committed.headers} + {committed.body}"),
            ("op record alone (commit)", f"{report.op_alone}"),
            ("TXN_OP bytes per op record", f"{report.op_share:,.1f}"),
            ("op records per txn", f"{report.ops_per_txn:.2f}"),
            *((f"on the bus: {name}", f"{size:,.0f}") for name, size in report.hops.items()),
        ):
            rows.setdefault(name, []).append(value)
    for name, values in rows.items():
        table.add_row(name, *values, *[""] * (len(CONCURRENCY) - len(values)))
    Console(width=150).print(table)
    return [table]
