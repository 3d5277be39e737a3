"""What a coordinator process costs while it waits: 1 partition against 8 in one process.

Per partition count, on a fresh embedded server (fsync `always`, `bench.deployed`), one
coordinator started through the CLI with its default settings, measured twice for `SECONDS`
(`--quick`: a quarter): idle with nothing open, then with `OPEN` transactions left open (their
local transaction and every check-back answer UNKNOWN, so each partition has a deadline
pending, as under load). Per phase: the coordinator's CPU ms per second, the NATS messages per
second the server received and sent (`/varz`, the coordinator's renewals, looks and
check-backs), and, in a second window as long, the coordinator's `epoll_wait` calls per second
(`strace -c -f`: one per turn of its event loop, so its timer wakeups), when strace can attach.
These counts, unlike seconds, do not move with the machine's load.
"""

from __future__ import annotations

import asyncio
import re
import shutil

import anyio
import nats
from rich.console import Console
from rich.table import Table

from bench.deployed import Deployment, deployment
from txactors.producer import Decision, TransactionProducer, TxMessage

SECONDS = 20.0
OPEN = 32
"""Transactions left open in the second phase (spread over the partitions by their txids)."""


async def loop_turns(pid: int, seconds: float) -> float | None:
    """`epoll_wait` calls per second of process `pid` (all threads) over `seconds`; None
    without strace or when it cannot attach."""
    if shutil.which("strace") is None:
        return None
    strace = await asyncio.create_subprocess_exec(
        *("strace", "-c", "-f", "-e", "trace=epoll_wait", "-p", str(pid)),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    await anyio.sleep(seconds)
    strace.send_signal(2)
    _, err = await strace.communicate()
    found = re.search(rb"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?epoll_wait", err, re.M)
    return int(found.group(1)) / seconds if found else None


async def phase(dep: Deployment, seconds: float) -> tuple[float, float, float, float | None]:
    """(CPU ms/s, messages in/s, messages out/s, loop turns/s) of the coordinator."""
    before = dep.snapshot()
    await anyio.sleep(seconds)
    usage = dep.usage(before, dep.snapshot())
    [pid] = dep.roles["coordinator"]
    turns = await loop_turns(pid, seconds)
    per_s = usage.seconds
    return (
        1000 * usage.cpu["coordinator"] / per_s,
        usage.in_msgs / per_s,
        usage.out_msgs / per_s,
        turns,
    )


async def measure(table: Table, partitions: int, seconds: float) -> None:
    async with deployment("always") as dep:
        nc = await nats.connect(dep.url)
        try:
            async with (
                dep.coordinators(1, partitions),
                TransactionProducer(
                    nc, "bench", lambda v: Decision.UNKNOWN, partitions=partitions, end_mode="ack"
                ) as producer,
            ):
                await anyio.sleep(2.0)  # recovery's reads and the first renewals are done
                rows = [("idle", await phase(dep, seconds))]
                async with anyio.create_task_group() as tasks:
                    for i in range(OPEN):
                        tasks.start_soon(
                            producer.send_in_transaction,
                            TxMessage("idle", str(i).encode()),
                            lambda m, a: Decision.UNKNOWN,
                        )
                rows.append((f"{OPEN} open", await phase(dep, seconds)))
        finally:
            await nc.close()
    for state, (cpu, msgs_in, msgs_out, turns) in rows:
        table.add_row(
            str(partitions),
            state,
            f"{cpu:.1f}",
            f"{msgs_in:.1f}",
            f"{msgs_out:.1f}",
            "-" if turns is None else f"{turns:.1f}",
        )


async def main(*, quick: bool = False) -> list[Table]:
    seconds = SECONDS / 4 if quick else SECONDS
    table = Table(title=f"A waiting coordinator process, {seconds:.0f} s per phase")
    for column in ("partitions", "state", "CPU ms/s", "msgs in/s", "msgs out/s", "loop turns/s"):
        table.add_column(column, justify="right")
    for partitions in (1, 8):
        await measure(table, partitions, seconds)
    Console().print(table)
    return [table]
