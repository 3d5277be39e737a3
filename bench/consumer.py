"""The consumer's cost per message: 20,000 stored messages read by a `Consumer` group.

Measured on a server of its own, with the messages already in the topic stream, so the number is
the consumer's alone: messages/s until the handler saw all, CPU of this process per message, the
socket writes of its connection, the server's CPU, and the NATS messages the
server counted in and out (`/varz`). Next to it, nats-py's own pull consumer (fetch 1,000,
ack each) on the same messages: the floor the consumer's bookkeeping adds to.

Run `python -m bench consumer` (or `just bench consumer`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from rich.console import Console
from rich.table import Table

from txactors.consumer import ConsumedMessage, Consumer
from txactors.embedded.server import EmbeddedNatsServer
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.wire import layout

BODY = b"x" * 128
TOPIC = "consumerbench"
CONCURRENCY = 64
"""As in `bench transactions`."""


@dataclass(frozen=True)
class Sample:
    seconds: float
    cpu: float
    writes: int
    server_cpu: float
    msgs_in: int
    msgs_out: int


class _CountingWrites:
    """Counts the socket writes nats-py hands its transport (each `write`/`writelines` is one
    send of everything pending)."""

    def __init__(self, nc: Client) -> None:
        self.count = 0
        transport = nc._transport  # a benchmark looks inside
        assert transport is not None
        for name in ("write", "writelines"):
            original = getattr(transport, name)

            def counted(payload: Any, original: Any = original) -> None:
                self.count += 1
                original(payload)

            setattr(transport, name, counted)


def _cpu_of(pid: int | None) -> float:
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _varz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as response:
        varz: dict[str, Any] = json.load(response)
        return varz


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _fill(nc: Client, count: int) -> None:
    """`count` messages on the topic stream, shaped like committed ones (id, txid headers)."""
    js = nc.jetstream()
    await ensure_topic_stream(js, TOPIC)
    subject = layout.topic_subject(TOPIC)
    futures = []
    for i in range(count):
        headers = {layout.MSG_ID_HEADER: f"tx{i}:0", layout.TXID_HEADER: f"tx{i}"}
        futures.append(await js.publish_async(subject, BODY, headers=headers))
    await asyncio.gather(*futures)


async def _measure(
    server: EmbeddedNatsServer,
    monitor: int,
    writes: _CountingWrites,
    run: Callable[[], Awaitable[None]],
) -> Sample:
    before = await asyncio.to_thread(_varz, monitor)
    server_cpu, cpu, sent = _cpu_of(server.pid), time.process_time(), writes.count
    started = time.perf_counter()
    await run()
    seconds = time.perf_counter() - started
    cpu, sent = time.process_time() - cpu, writes.count - sent
    server_cpu = _cpu_of(server.pid) - server_cpu
    after = await asyncio.to_thread(_varz, monitor)
    return Sample(
        seconds,
        cpu,
        sent,
        server_cpu,
        after["in_msgs"] - before["in_msgs"],
        after["out_msgs"] - before["out_msgs"],
    )


async def _txactors(nc: Client, count: int) -> None:
    seen = 0
    all_in = anyio.Event()

    async def handle(message: ConsumedMessage) -> None:
        nonlocal seen
        seen += 1
        if seen == count:
            all_in.set()

    async with Consumer(nc, TOPIC, "bench", handle, concurrency=CONCURRENCY):
        await all_in.wait()


async def _raw(nc: Client, count: int) -> None:
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        layout.topic_filter(TOPIC), "raw", stream=layout.topic_stream(TOPIC)
    )
    seen = 0
    while seen < count:
        for msg in await sub.fetch(1000, timeout=5):
            await msg.ack()
            seen += 1
    await nc.flush()
    await sub.unsubscribe()


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("INFO")  # the default a deployment runs with
    count = 2_000 if quick else 20_000
    monitor = _free_port()
    table = Table(title=f"consuming {count:,} stored messages (concurrency {CONCURRENCY})")
    for column in (
        "reader",
        "msgs/s",
        "CPU µs/msg",
        "writes",
        "server CPU µs/msg",
        "NATS in / out",
    ):
        table.add_column(column, justify="left" if column == "reader" else "right")
    async with EmbeddedNatsServer(extra_args=["-m", str(monitor)]) as server:
        nc = await nats.connect(server.url)
        try:
            await _fill(nc, count)
            writes = _CountingWrites(nc)
            for name, reader in (("txactors Consumer", _txactors), ("nats-py fetch + ack", _raw)):
                s = await _measure(server, monitor, writes, functools.partial(reader, nc, count))
                table.add_row(
                    name,
                    f"{count / s.seconds:,.0f}",
                    f"{s.cpu / count * 1e6:,.0f}",
                    f"{s.writes:,}",
                    f"{s.server_cpu / count * 1e6:,.0f}",
                    f"{s.msgs_in:,} / {s.msgs_out:,}",
                )
        finally:
            await nc.close()
    Console(width=150).print(table)
    return [table]
