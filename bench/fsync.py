"""What durability costs: raw acked JetStream publishes with `fsync` always versus interval.

The same embedded nats-server, a fresh data directory per round, 100-byte messages into one
file-storage stream (R1), acked publishes from nats-py:

- one at a time: each publish waits for its ack before the next (latency bound);
- 256 in flight: 256 tasks publishing at once, each waiting for its own ack.

Rounds alternate the two settings, so a change of load on a shared machine hits both; each
figure is the median over the rounds. The conditions (cores, load, the data directory's file
system) are printed with the table, since fsync cost is the disk's, not ours.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import anyio
import nats
from rich.console import Console
from rich.table import Table

from txactors.embedded.server import EmbeddedNatsServer, Fsync, find_nats_server_binary
from txactors.observe.logs import configure_logging

BODY = b"x" * 100
STREAM = "FSYNCBENCH"
SUBJECT = "fsyncbench.msg"
MODES: tuple[Fsync, ...] = ("interval", "always")
IN_FLIGHT = 256


async def publish_rate(url: str, count: int, in_flight: int) -> float:
    """Acked publishes per second: `count` messages, `in_flight` publishers at once."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=STREAM, subjects=[SUBJECT])
        per_task = count // in_flight

        async def publisher() -> None:
            for _ in range(per_task):
                await js.publish(SUBJECT, BODY)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(in_flight):
                tg.start_soon(publisher)
        seconds = time.perf_counter() - started
        info = await js.stream_info(STREAM)
        if info.state.messages != per_task * in_flight:
            raise RuntimeError(f"stored {info.state.messages} of {per_task * in_flight} messages")
        return per_task * in_flight / seconds
    finally:
        await nc.close()


async def one_round(mode: Fsync, measures: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Each measure on a fresh server and data directory with this fsync setting."""
    rates: dict[str, float] = {}
    for name, (count, in_flight) in measures.items():
        async with EmbeddedNatsServer(fsync=mode) as server:
            rates[name] = await publish_rate(server.url, count, in_flight)
    return rates


def conditions() -> list[str]:
    """What the numbers depend on, to print next to them."""
    temp = Path(tempfile.gettempdir())
    server = subprocess.run(
        [str(find_nats_server_binary()), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"{os.cpu_count()} cores, load average {load} (1, 5, 15 min)",
        f"data directories under {temp}: {_file_system(temp)}",
        f"Python {platform.python_version()}, {server}, nats-py {version('nats-py')}",
    ]


def _file_system(path: Path) -> str:
    """The mount holding `path` and its type, from /proc/mounts (Linux), else 'unknown'."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return "unknown"
    best = ("", "unknown", "unknown")
    resolved = str(path.resolve())
    for line in mounts:
        device, point, kind, *_ = line.split()
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best[0]):
            best = (point, kind, device)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("WARNING")
    console = Console()
    rounds = 1 if quick else 3
    measures = {
        "one at a time": (200 if quick else 2_000, 1),
        f"{IN_FLIGHT} in flight": (IN_FLIGHT * (4 if quick else 40), IN_FLIGHT),
    }
    for line in conditions():
        console.print(line)
    results: dict[Fsync, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            results[mode].append(await one_round(mode, measures))
    table = Table(title=f"acked publishes/s, 100-byte messages, median of {rounds} round(s)")
    for column in ("publish", "fsync interval (lazy)", "fsync always", "always / lazy"):
        table.add_column(column, justify="left" if column == "publish" else "right")
    for name in measures:
        lazy, durable = (_median(results[mode], name) for mode in MODES)
        table.add_row(name, f"{lazy:,.0f}", f"{durable:,.0f}", f"{durable / lazy:.0%}")
    console.print(table)
    console.print(f"after: load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return [table]


def _median(rounds: list[dict[str, float]], name: str) -> float:
    return statistics.median(rates[name] for rates in rounds)
