"""The bank-transfer demo as a benchmark: transfers per second with the books proven clean.

One transfer is a prepare, a local transaction in alipay's database (transaction-log row,
debit, transfer row), a commit, and yuebao's consumer crediting it with the message-apply
record: so the rate is bounded by the bare transactional-message rate, measured in the same
run with `bench.transactions` (prepare, a trivial local transaction, commit, consumed) at
the same concurrency. Every run must reconcile with zero mismatches, or its number does not count.
SQLite and PostgreSQL (TXACTORS_BENCH_PG_DSN, default the local test database).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import nats
from rich.console import Console
from rich.table import Table

from apps.common.db import DEFAULT_PG_DSN, Storage
from apps.common.timing import Timing
from apps.transfer.bank import ALIPAY, YUEBAO
from apps.transfer.demo import DemoConfig, run_demo
from bench.inprocess import transactions
from txactors.coordinator.service import run_coordinator
from txactors.embedded.server import EmbeddedNatsServer
from txactors.observe.logs import configure_logging
from txactors.producer import Decision, TransactionProducer

PG_DSN_ENV = "TXACTORS_BENCH_PG_DSN"
TIMING = Timing(drain_timeout=600.0)
"""No faults: only the drain wait matters, generous for the slow runs."""


async def bare_rate(count: int, workers: int) -> float:
    """Committed transactional messages per second until consumed (bench.transactions)."""
    async with EmbeddedNatsServer() as server:
        nc = await nats.connect(server.url)
        try:
            async with (
                run_coordinator(nc),
                TransactionProducer(nc, "bench", lambda v: Decision.COMMIT) as producer,
            ):
                rate, _, _ = await transactions(nc, producer, count, workers, f"bare{workers}")
        finally:
            await nc.close()
    return rate


async def transfer_rate(storage: Storage, count: int, workers: int) -> tuple[float, bool]:
    """(transfers per second until drained, whether the books reconciled cleanly)."""
    config = DemoConfig(storage, count, workers, faults=frozenset(), timing=TIMING)
    result = await run_demo(config)
    return count / result.seconds, result.drained and result.reconciliation.ok


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("ERROR")
    os.environ.pop("NATS_URL", None)  # every run on an embedded server of its own
    console = Console(width=150)
    count = 256 if quick else 2048  # a multiple of every concurrency
    table = Table(title=f"bank transfers vs bare transactional messages ({count:,} each)")
    for column in ("database", "concurrency", "transfers/s", "bare tx/s", "ratio", "books"):
        table.add_column(column, justify="left" if column == "database" else "right")
    pg = Storage.postgres(
        os.environ.get(PG_DSN_ENV, DEFAULT_PG_DSN), f"bench{uuid.uuid4().hex[:6]}_"
    )
    sqlite = Storage.sqlite(Path(tempfile.mkdtemp(prefix="txactors-bench-")))
    try:
        for workers in (16, 64):
            bare = await bare_rate(count, workers)
            for name, storage in (("sqlite", sqlite), ("postgres", pg)):
                rate, clean = await transfer_rate(storage, count, workers)
                table.add_row(
                    name,
                    str(workers),
                    f"{rate:,.0f}",
                    f"{bare:,.0f}",
                    f"{rate / bare:.0%}",
                    "✓ 0 mismatches" if clean else "✗ MISMATCH",
                )
    finally:
        for name in (ALIPAY, YUEBAO):
            await pg.drop(name)
        assert sqlite.directory is not None
        shutil.rmtree(sqlite.directory, ignore_errors=True)
    console.print(table)
    return [table]
