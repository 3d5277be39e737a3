"""`python -m apps.orders`: pay N orders end to end, with faults, and reconcile every group.

    python -m apps.orders --orders 100 --concurrency 8 --faults all --db sqlite
    python -m apps.orders --db postgres --dsn postgresql://postgres@127.0.0.1:5432/test

Exits 1 if any consumer group's database disagrees with the order database.
"""

from __future__ import annotations

import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import anyio
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from apps.common.db import DEFAULT_PG_DSN, Storage
from apps.common.faults import Fault, parse_faults
from apps.orders.demo import DemoReport, run_demo
from txactors.cli import run_cli
from txactors.connection import nats_session
from txactors.logs import configure_logging


class Backend(StrEnum):
    SQLITE = "sqlite"
    POSTGRES = "postgres"


def main(
    orders: Annotated[int, typer.Option(min=1, help="How many orders to create and pay.")] = 100,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Payments (and handlers) in flight at once.")
    ] = 8,
    faults: Annotated[
        str, typer.Option(help=f"all, none, or a comma-separated list of: {', '.join(Fault)}.")
    ] = "none",
    db: Annotated[Backend, typer.Option(help="Where every service keeps its data.")] = (
        Backend.SQLITE
    ),
    dsn: Annotated[str, typer.Option(envvar="ORDERS_PG_DSN", help="PostgreSQL DSN.")] = (
        DEFAULT_PG_DSN
    ),
    schema_prefix: Annotated[
        str, typer.Option(help="PostgreSQL: each service gets the schema <prefix><service>.")
    ] = "orders_demo_",
    data_dir: Annotated[
        Path | None,
        typer.Option(help="SQLite: directory of the database files (temporary by default)."),
    ] = None,
    seed: Annotated[
        int, typer.Option(help="Seeds the carts and which orders get which fault.")
    ] = 7,
) -> None:
    configure_logging("ERROR")
    try:
        chosen = parse_faults(faults)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--faults") from error
    with tempfile.TemporaryDirectory(prefix="orders-") as scratch:
        if db is Backend.SQLITE:
            storage = Storage.sqlite(data_dir or Path(scratch))
        else:
            storage = Storage.postgres(dsn, prefix=schema_prefix)
        report = anyio.run(_run, storage, orders, concurrency, chosen, seed)
    if not report.ok:
        raise typer.Exit(1)


async def _run(
    storage: Storage, orders: int, concurrency: int, faults: frozenset[Fault], seed: int
) -> DemoReport:
    console = Console()
    async with nats_session() as session:
        where = "an embedded nats-server" if session.server else session.url
        console.print(
            f"[bold]{orders} orders[/], concurrency {concurrency}, faults: "
            f"{', '.join(sorted(faults)) or 'none'}, databases: {storage.kind}, NATS: {where}"
        )
        with Progress(console=console) as progress:
            report = await run_demo(
                session.nc,
                session.url,
                storage,
                orders=orders,
                concurrency=concurrency,
                faults=faults,
                seed=seed,
                progress=progress,
            )
    console.print(_summary(report))
    assert report.reconciliation is not None
    console.print(report.reconciliation.table())
    for problem in report.reconciliation.problems():
        console.print(f"  [red]✘[/] {problem}")
    if not report.drained:
        console.print("[red]the pipeline did not drain in time[/]")
    verdict = "[green]reconciled: every group agrees with the order database[/]"
    console.print(verdict if report.ok else "[red]MISMATCH[/]")
    console.print(f"{report.seconds:.1f} s")
    return report


def _summary(report: DemoReport) -> Table:
    table = Table(title="payments and deliveries")
    table.add_column("what")
    table.add_column("count", justify="right")
    for outcome, count in sorted(report.payments.items()):
        table.add_row(f"payment: {outcome}", str(count))
    for group, handler in report.handlers.items():
        table.add_row(f"{group}: applied", str(handler.applied))
        table.add_row(f"{group}: duplicates absorbed", str(handler.absorbed))
    if report.consumer_killed_at is not None:
        table.add_row(f"logistics consumer killed applying {report.consumer_killed_at}", "1")
    return table


if __name__ == "__main__":
    app = typer.Typer(add_completion=False)
    app.command()(main)
    run_cli(app)  # bad flags or settings: one line, exit 2; NATS unreachable: one line, exit 1
