"""What nats-server takes to store `n` messages as one atomic batch, against `n` single
publishes all in flight: p50 latency of the write and server CPU per write, under both fsync
settings, each on a fresh embedded server. The writers (`nats/writer.py`
`ATOMIC_MIN_MESSAGES`) send fewer than 16 messages as singles because of what this shows.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.js.api import Header, StreamConfig
from nats.nuid import NUID
from rich.console import Console
from rich.table import Table

from bench.deployed import cpu_seconds
from txactors.embedded.server import EmbeddedNatsServer, Fsync
from txactors.observe.logs import configure_logging

SIZES = (1, 2, 4, 8, 16, 32)
WRITES = 60
QUICK_WRITES = 20
BODY = b"x" * 60


async def singles(nc: Client, n: int, _: NUID) -> None:
    await asyncio.gather(*(nc.request(f"t.{k}", BODY, timeout=5) for k in range(n)))


async def batch(nc: Client, n: int, nuid: NUID) -> None:
    batch_id = nuid.next().decode()
    for k in range(1, n):
        headers: dict[str, str] = {Header.BATCH_ID: batch_id, Header.BATCH_SEQUENCE: str(k)}
        await nc.publish(f"t.{k}", BODY, headers=headers)
    last: dict[str, str] = {Header.BATCH_ID: batch_id, Header.BATCH_SEQUENCE: str(n)}
    last[Header.BATCH_COMMIT] = "1"
    await nc.request("t.0", BODY, headers=last, timeout=5)


Write = Callable[[Client, int, NUID], Awaitable[None]]


async def measure(server: EmbeddedNatsServer, nc: Client, write: Write, n: int, writes: int) -> str:
    nuid = NUID()
    cpu = sum(cpu_seconds(server.pid or 0))
    latencies = []
    for _ in range(writes):
        started = time.perf_counter()
        await write(nc, n, nuid)
        latencies.append(time.perf_counter() - started)
    cpu = sum(cpu_seconds(server.pid or 0)) - cpu
    return f"{statistics.median(latencies) * 1e3:.2f} / {cpu / writes * 1e3:.2f}"


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("ERROR")
    writes = QUICK_WRITES if quick else WRITES
    table = Table(title="n messages to one stream: p50 ms per write / server CPU ms per write")
    table.add_column("n", justify="right")
    settings: tuple[Fsync, ...] = ("always", "interval")
    for setting in settings:
        table.add_column(f"{setting}: singles", justify="right")
        table.add_column(f"{setting}: atomic batch", justify="right")
    cells: dict[int, list[str]] = {n: [] for n in SIZES}
    for setting in settings:
        async with EmbeddedNatsServer(fsync=setting) as server:
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                await js.add_stream(StreamConfig(name="T", subjects=["t.>"], allow_atomic=True))
                for n in SIZES:
                    cells[n].append(await measure(server, nc, singles, n, writes))
                    cells[n].append(await measure(server, nc, batch, n, writes))
            finally:
                await nc.close()
    for n in SIZES:
        table.add_row(str(n), *cells[n])
    Console(width=160).print(table)
    return [table]
