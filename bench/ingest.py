"""Atomic batches against fast-ingest batches (ADR-50) for half, op and topic writes.

The same 20,000 messages of 300 bytes (the size of a half, each with its own `Nats-Msg-Id`)
into one file-storage stream (R1, `allow_atomic` and `allow_batched`, a dedupe window), written
four ways by raw nats-py publishes (`bench/ingest_publish.py`):

- pipelined acked publishes, 256 unacknowledged at most: the baseline;
- atomic batches of 64 and of 256, 4 batches unacknowledged at most (what the coordinator's
  writers do for TXN_HALF, TXN_OP and a transaction's topic messages);
- fast-ingest: one batch of all messages (flow ack every 128 asked, 2 acks outstanding, so at
  most 256 unacknowledged like the baseline), and batches of 64 with 4 in flight (the shape a
  writer would use per tick or per transaction).

Each on a fresh server and data directory, with fsync `always` and `interval`; rounds alternate
the settings and methods, each figure the median over the rounds. CPU per message is the
benchmark process's (client) and the nats-server's, from /proc.

Then the guarantees the coordinator relies on, observed on the same server: whether each
message's stream sequence follows from the batch's ack when another publisher writes meanwhile,
whether a batch that loses a message stores nothing, and how a repeated `Nats-Msg-Id` counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamConfig
from rich.console import Console
from rich.table import Table

from bench import ingest_publish as pub
from bench.fsync import conditions
from txactors.embedded.server import EmbeddedNatsServer, Fsync
from txactors.observe.logs import configure_logging

STREAM = "INGESTBENCH"
COUNT = 20_000
IN_FLIGHT = 256
MODES: tuple[Fsync, ...] = ("always", "interval")

Method = Callable[[Client, int], Awaitable[None]]
METHODS: dict[str, Method] = {
    f"pipelined, {IN_FLIGHT} in flight": lambda nc, n: pub.pipelined(nc, n, IN_FLIGHT),
    "atomic batches of 64, 4 in flight": lambda nc, n: pub.atomic(nc, n, 64, 4),
    "atomic batches of 256, 4 in flight": lambda nc, n: pub.atomic(nc, n, 256, 4),
    "fast-ingest, one batch, ack every 128": lambda nc, n: pub.fast(nc, n, n, 1, 128),
    "fast-ingest batches of 64, 4 in flight": lambda nc, n: pub.fast(nc, n, 64, 4, 64),
}


@dataclass(frozen=True)
class Sample:
    rate: float
    client_us: float  # CPU per message, microseconds
    server_us: float


def _stream() -> StreamConfig:
    return StreamConfig(
        name=STREAM,
        subjects=["ingestbench.>"],
        duplicate_window=120.0,
        allow_atomic=True,
        allow_batched=True,
    )


def _cpu_of(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(mode: Fsync, method: Method, count: int) -> Sample:
    """One method on a fresh server with this fsync setting; checks every message is stored."""
    async with EmbeddedNatsServer(fsync=mode) as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await js.add_stream(_stream())
            server_cpu, cpu = _cpu_of(server.pid), time.process_time()
            started = time.perf_counter()
            async with asyncio.timeout(300):
                await method(nc, count)
            seconds = time.perf_counter() - started
            cpu, server_cpu = time.process_time() - cpu, _cpu_of(server.pid) - server_cpu
            stored = (await js.stream_info(STREAM)).state.messages
            if stored != count:
                raise pub.PublishFailed(f"stored {stored} of {count} messages")
            return Sample(count / seconds, cpu / count * 1e6, server_cpu / count * 1e6)
        finally:
            await nc.close()


# -- guarantees ---------------------------------------------------------------------------


class _Replies:
    """Every reply to a probe's messages; `final()` is the first pub ack or error (no "type")."""

    def __init__(self) -> None:
        self.got: list[dict[str, object]] = []
        self._event = asyncio.Event()

    async def on_reply(self, msg: Msg) -> None:
        if msg.data:  # an atomic batch's message with a reply subject gets an empty ack
            self.got.append(json.loads(msg.data))
        self._event.set()

    async def final(self) -> dict[str, object]:
        async with asyncio.timeout(15):  # an abandoned atomic batch times out after 10 s
            while True:
                for reply in self.got:
                    if "type" not in reply:
                        return reply
                self._event.clear()
                await self._event.wait()


async def _probe(
    nc: Client, kind: str, msg_ids: list[str], *, lose: int = 0, interleave: int = 0
) -> tuple[dict[str, object], list[int]]:
    """One batch of len(msg_ids) messages (`lose`: that batch sequence is never sent;
    `interleave`: a plain publish after that one). Returns the final reply and the stream
    sequences now holding the batch's messages."""
    js = nc.jetstream()
    before = (await js.stream_info(STREAM)).state.last_seq
    replies, inbox, batch = _Replies(), nc.new_inbox(), f"probe{kind}{len(msg_ids)}{lose}"
    sub = await nc.subscribe(inbox + ".>", cb=replies.on_reply)
    last = len(msg_ids)
    for seq, msg_id in enumerate(msg_ids, 1):
        headers = {pub.MSG_ID: msg_id}
        if kind == "atomic":
            headers |= {pub.BATCH_ID: batch, pub.BATCH_SEQUENCE: str(seq)}
            reply = f"{inbox}.{seq}"
            if seq == last:
                headers[pub.BATCH_COMMIT] = "1"
        else:
            reply = f"{inbox}.{batch}.10.fail.{seq}.{pub.fast_op(seq, last)}.$FI"
        if seq != lose:
            await nc.publish(pub.SUBJECT, pub.BODY, reply, headers)
        if seq == interleave:
            await js.publish("ingestbench.other", b"another publisher")
    final = await replies.final()
    await sub.unsubscribe()
    after = (await js.stream_info(STREAM)).state.last_seq
    ours = [
        seq
        for seq in range(before + 1, after + 1)
        if (await js.get_msg(STREAM, seq)).subject == pub.SUBJECT
    ]
    return final, ours


async def guarantees() -> list[tuple[str, str, str]]:
    """(property, atomic batch, fast-ingest batch) as observed on a server of our own."""
    rows: dict[str, list[str]] = {}
    async with EmbeddedNatsServer(fsync="always") as server:
        nc = await nats.connect(server.url)
        try:
            await nc.jetstream().add_stream(_stream())
            for kind in ("atomic", "fast"):
                final, ours = await _probe(nc, kind, [f"{kind}{i}" for i in range(4)], interleave=2)
                end = int(str(final.get("seq")))
                derived = list(range(end - len(ours) + 1, end + 1))
                rows.setdefault("each message's sequence = ack seq - count + offset", []).append(
                    f"{derived == ours}: ack seq {end}, stored at {ours} (a plain publish after #2)"
                )
                final, ours = await _probe(nc, kind, [f"{kind}L{i}" for i in range(4)], lose=2)
                rows.setdefault("message 2 of 4 lost: stored", []).append(
                    f"{len(ours)} of 4; reply {final.get('error') or final}"
                )
                ids = [f"{kind}D0", f"{kind}D1", f"{kind}D0", f"{kind}D2"]
                final, ours = await _probe(nc, kind, ids)
                rows.setdefault("4 messages, one Msg-Id repeated: stored", []).append(
                    f"{len(ours)}; reply {final.get('error') or final}"
                )
        finally:
            await nc.close()
    return [(name, atomic, fast) for name, (atomic, fast) in rows.items()]


# -- report ---------------------------------------------------------------------------------


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("WARNING")
    console = Console()
    rounds, count = (1, 2_000) if quick else (3, COUNT)
    for line in conditions():
        console.print(line)
    samples: dict[tuple[Fsync, str], list[Sample]] = {}
    tables: list[Table] = []
    for _ in range(rounds):
        for mode in MODES:
            for name, method in METHODS.items():
                samples.setdefault((mode, name), []).append(await measure(mode, method, count))
    for mode in MODES:
        table = Table(
            title=f"{count:,} messages of {len(pub.BODY)} B, fsync {mode}, median of {rounds}"
        )
        for column in ("method", "msgs/s", "vs pipelined", "client µs/msg", "server µs/msg"):
            table.add_column(column, justify="left" if column == "method" else "right")
        base = statistics.median(s.rate for s in samples[mode, next(iter(METHODS))])
        for name in METHODS:
            runs = samples[mode, name]
            rate = statistics.median(s.rate for s in runs)
            table.add_row(
                name,
                f"{rate:,.0f}",
                f"{rate / base:.2f}x",
                f"{statistics.median(s.client_us for s in runs):.1f}",
                f"{statistics.median(s.server_us for s in runs):.1f}",
            )
        console.print(table)
        tables.append(table)
    table = Table(title="guarantees (fsync always)")
    for column in ("property", "atomic batch", "fast-ingest batch (gap fail)"):
        table.add_column(column, overflow="fold")
    for row in await guarantees():
        table.add_row(*row)
    console.print(table)
    console.print(f"after: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return [*tables, table]
