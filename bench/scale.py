"""Scale-out: the same transactions over 1, 2 and 4 coordinator processes on 8 partitions,
and over 1 partition in one process (what 8 partitions in one process should match).

Per row of `ROWS` (coordinator processes, partitions), on a fresh embedded server (fsync
`always`, `bench.deployed`): the raw baseline of that server first (`bench.transactions`'
raw runs: one at a time, pipelined, atomic batches; the faster of the last two is the
baseline), then the coordinators started through the CLI with `--partitions <n>` and left to
split the partitions between them (balance.py; measured once the split is even), their idle
CPU for `IDLE_SECONDS`, and 64 producers in this process with the acked end, until the
consumer process has every message.

Per run: committed tx/s, NATS messages in / out per transaction, and CPU ms per transaction of
each process (each coordinator separately): what bench/HISTORY.md ("What N cores and a 3-node
cluster should give") turns into an estimate for more cores and a 3-node cluster.
"""

from __future__ import annotations

import anyio
import nats
from rich.console import Console
from rich.table import Table

from bench.deployed import deployment
from bench.transactions import Run, e2e, p50_p99, raw_runs
from txactors.observe.logs import configure_logging
from txactors.producer import Decision, TransactionProducer

PARTITIONS = 8
ROWS = ((1, 1), (1, PARTITIONS), (2, PARTITIONS), (4, PARTITIONS))
"""(coordinator processes, partitions) per row: the first two compare one partition with
eight in one process (one writer per stream per process: as fast, within 10%)."""
WORKERS = 64
TRANSACTIONS = 20000
"""Transactions per run (`--quick`: a tenth)."""
IDLE_SECONDS = 2.0
"""How long the coordinators' idle CPU (lease renewals, ticks) is measured before each run:
the part of their CPU per transaction that does not grow with the rate."""


def per_process(run: Run) -> str:
    """CPU ms per transaction of each process, server first, then producer, consumer and
    the coordinators in order."""
    order = ["nats-server", "producer", "consumer"]
    roles = order + sorted(role for role in run.usage.cpu if role not in order)
    return ", ".join(f"{role} {run.cpu_ms(role):.3f}" for role in roles if role in run.usage.cpu)


async def measure(table: Table, processes: int, partitions: int, scale: float) -> None:
    """One row: `processes` coordinators serving `partitions` on a fresh server, against
    its raw baseline."""
    async with deployment("always") as dep:
        nc = await nats.connect(dep.url)
        try:
            raws = await raw_runs(dep, nc, scale, life=False)
            _, pipelined, batched = raws.values()
            base = max(pipelined, batched, key=lambda r: r.rate)
            async with (
                dep.coordinators(processes, partitions),
                TransactionProducer(
                    nc, "bench", lambda v: Decision.COMMIT, partitions=partitions, end_mode="ack"
                ) as producer,
            ):
                before = dep.snapshot()
                await anyio.sleep(IDLE_SECONDS)
                idle = dep.usage(before, dep.snapshot())
                count = max(int(TRANSACTIONS * scale), WORKERS)
                run = await e2e(dep, producer, count, WORKERS, f"scale{processes}x{partitions}")
        finally:
            await nc.close()
    assert run.consumed is not None
    table.add_row(
        str(processes),
        f"{partitions // processes}",
        f"{run.rate:,.0f}",
        f"{base.rate:,.0f} (pipelined {pipelined.rate:,.0f})",
        f"{run.rate / base.rate:.1%} ({run.rate / pipelined.rate:.0%})",
        f"{p50_p99(run.latencies)}; {p50_p99(run.consumed)}",
        run.msgs(),
        f"{run.cpu_ms():.3f}",
        per_process(run),
        ", ".join(
            f"{idle.cpu[role] / idle.seconds * 1e3:.0f}"
            for role in sorted(idle.cpu)
            if role.startswith("coordinator")
        ),
    )


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("ERROR")
    table = Table(
        title=f"scale-out: c{WORKERS}, acked end, fsync always "
        "(each row its own server and raw baseline)"
    )
    for column in (
        "coordinator processes",
        "partitions each",
        "tx/s until consumed",
        "raw baseline msg/s",
        "ratio (pipelined)",
        "commit; consumed p50 / p99 ms",
        "NATS msgs in / out per txn",
        "CPU ms per txn",
        "CPU ms per txn per process",
        "coordinators idle CPU ms/s",
    ):
        table.add_column(
            column, justify="left" if column.startswith("CPU ms per txn per") else "right"
        )
    for processes, partitions in ROWS:
        await measure(table, processes, partitions, 0.1 if quick else 1.0)
    Console(width=260).print(table)
    return [table]
