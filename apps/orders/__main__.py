"""`python -m apps.orders`: pay N orders end to end, with faults, and reconcile every group.

    python -m apps.orders --orders 200 --concurrency 16 --faults all --db sqlite
    python -m apps.orders --db postgres --pg-dsn postgresql://postgres@127.0.0.1:5432/test

The flags shared with the transfer demo are in apps/common/options.py. Prints the
reconciliation, publishes it on the `reconciliation` topic (tag `orders`), and exits 1 if
the topic or any consumer group's database disagrees with the order database.
"""

from __future__ import annotations

import typer

from apps.common.db import Storage
from apps.common.faults import Fault
from apps.common.options import (
    DEFAULT_CONCURRENCY,
    DEFAULT_FAULTS,
    DEFAULT_PG_DSN,
    DEFAULT_SEED,
    Backend,
    Concurrency,
    DataDir,
    Db,
    Faults,
    PgDsn,
    PgPrefix,
    Seed,
    faults_option,
    storage_of,
    where_nats,
)
from apps.common.report import progress_bar, show
from apps.common.timing import Timing
from apps.orders.demo import DATABASES, DemoReport, run_demo
from txactors.actors.loop import run_anyio
from txactors.cli import run_cli
from txactors.cli.consoles import console as wide_console
from txactors.nats.connect import nats_session
from txactors.observe.logs import configure_logging

DEMO = "orders"
MISMATCH = 1


def main(
    orders: int = typer.Option(200, min=1, help="How many orders to create and pay."),
    concurrency: Concurrency = DEFAULT_CONCURRENCY,
    faults: Faults = DEFAULT_FAULTS,
    seed: Seed = DEFAULT_SEED,
    db: Db = Backend.SQLITE,
    data_dir: DataDir = None,
    pg_dsn: PgDsn = DEFAULT_PG_DSN,
    pg_prefix: PgPrefix = None,
) -> None:
    """Create and pay orders (with faults), drain, and reconcile every consumer group."""
    chosen = faults_option(faults)
    configure_logging("ERROR")  # the faults are on purpose: keep their warnings off screen
    storage = storage_of(DEMO, db, data_dir, pg_dsn, pg_prefix)
    report = run_anyio(_run, storage, orders, concurrency, chosen, seed)
    if not report.ok:
        raise typer.Exit(MISMATCH)


async def _run(
    storage: Storage, orders: int, concurrency: int, faults: frozenset[Fault], seed: int
) -> DemoReport:
    console = wide_console()
    timing = Timing()
    console.print(
        f"[bold]txactors orders[/]: {orders} orders paid, {concurrency} at a time; "
        f"faults: {', '.join(sorted(faults)) or 'none'}"
    )
    for name in DATABASES:
        console.print(f"  {name}: {storage.describe(name)}")
    async with nats_session() as session:
        console.print(f"  {where_nats(session)}")
        with progress_bar(console) as progress:
            report = await run_demo(
                session.nc,
                session.url,
                storage,
                orders=orders,
                concurrency=concurrency,
                faults=faults,
                timing=timing,
                seed=seed,
                progress=progress,
            )
    console.print(f"{report.seconds:.1f}s from seeding to drained")
    assert report.reconciliation is not None
    show(
        console,
        report.reconciliation,
        drained=report.drained,
        drain_timeout=timing.drain_timeout,
    )
    return report


if __name__ == "__main__":
    app = typer.Typer(add_completion=False)
    app.command()(main)
    run_cli(app)  # bad flags or settings: one line, exit 2; NATS unreachable: one line, exit 1
