"""`python -m apps.transfer`: the bank-transfer demo, and commands to send one and reconcile.

    python -m apps.transfer --transfers 200 --concurrency 16 --faults all
    python -m apps.transfer --db postgres --pg-dsn postgresql://postgres@127.0.0.1/test
    python -m apps.transfer send --from a-001 --to b-002 --amount 12.50
    python -m apps.transfer reconcile

The flags shared with the order demo are in apps/common/options.py. The banks' databases
stay after a run (SQLite files in --data-dir, or PostgreSQL schemas `<prefix>alipay` and
`<prefix>yuebao`), so `send` and `reconcile` work on what the demo seeded; the next demo
run starts them (and the topic) afresh.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from pathlib import Path

import typer

from apps.common.db import Storage
from apps.common.drain import wait_drained
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
)
from apps.common.report import Reconciliation, show
from apps.common.timing import Timing
from apps.transfer.bank import ALIPAY, YUEBAO, Bank, TransferRefused
from apps.transfer.demo import DemoConfig, run_demo
from apps.transfer.messages import RECEIVER_GROUP, SENDER_GROUP, TOPIC
from apps.transfer.receiver import Receiver
from apps.transfer.reconcile import reconcile
from apps.transfer.sender import Sender, new_transfer
from txactors.actors.loop import run_anyio
from txactors.cli import run_cli
from txactors.cli.consoles import console as wide_console
from txactors.coordinator.service import run_coordinator
from txactors.errors import RolledBackByCheck
from txactors.nats.connect import nats_session
from txactors.observe.logs import configure_logging
from txactors.producer import TransactionProducer

DEMO = "transfer"

BAD_INPUT = 2
MISMATCH = 1

app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0])
console = wide_console()


def banks(db: Backend, data_dir: Path | None, pg_dsn: str, pg_prefix: str | None) -> Storage:
    return storage_of(DEMO, db, data_dir, pg_dsn, pg_prefix)


def fail(message: str, code: int = BAD_INPUT) -> typer.Exit:
    wide_console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


@app.callback(invoke_without_command=True)
def demo(
    ctx: typer.Context,
    transfers: int = typer.Option(200, min=1, help="How many transfers to run."),
    concurrency: Concurrency = DEFAULT_CONCURRENCY,
    faults: Faults = DEFAULT_FAULTS,
    seed: Seed = DEFAULT_SEED,
    db: Db = Backend.SQLITE,
    data_dir: DataDir = None,
    pg_dsn: PgDsn = DEFAULT_PG_DSN,
    pg_prefix: PgPrefix = None,
) -> None:
    """Seed both banks, run transfers (with faults), drain, and prove the books."""
    if ctx.invoked_subcommand is not None:
        return
    chosen = faults_option(faults)
    configure_logging("ERROR")  # the faults are on purpose: keep their warnings off screen
    storage = banks(db, data_dir, pg_dsn, pg_prefix)
    config = DemoConfig(storage, transfers, concurrency, chosen, seed=seed)
    names = ", ".join(sorted(chosen)) or "none"
    console.print(
        f"[bold]txactors bank transfer[/]: {transfers} transfers alipay → yuebao, "
        f"{concurrency} at a time; faults: {names}"
    )
    result = run_anyio(run_demo, config, console)
    took = f"{result.seconds:.1f}s from first transfer to drained"
    if not chosen:  # with faults, the time is mostly the wait for check-backs and redelivery
        took += f" ({transfers / result.seconds:,.0f} transfers/s)"
    console.print(took)
    show(
        console,
        result.reconciliation,
        drained=result.drained,
        drain_timeout=config.timing.drain_timeout,
    )
    if not result.reconciliation.ok:
        raise typer.Exit(MISMATCH)


def parse_amount(text: str) -> int:
    """Yuan with up to two decimals, as cents."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise TransferRefused(f"amount {text!r} is not a number (e.g. 12.50)") from None
    cents = value * 100
    if not cents.is_finite() or cents != cents.to_integral_value():
        raise TransferRefused(f"amount {text!r} must have at most two decimals")
    return int(cents)


@app.command()
def send(
    source: str = typer.Option(..., "--from", help="An alipay account, e.g. a-001."),
    target: str = typer.Option(..., "--to", help="A yuebao account, e.g. b-001."),
    amount: str = typer.Option(..., help="Yuan, e.g. 12.50."),
    db: Db = Backend.SQLITE,
    data_dir: DataDir = None,
    pg_dsn: PgDsn = DEFAULT_PG_DSN,
    pg_prefix: PgPrefix = None,
) -> None:
    """Send one transfer through the whole pipeline, on the banks a demo run seeded."""
    configure_logging("ERROR")
    storage = banks(db, data_dir, pg_dsn, pg_prefix)
    try:
        balances = run_anyio(send_one, storage, source, target, amount)
    except (TransferRefused, RolledBackByCheck) as error:
        raise fail(f"{error}; nothing was changed") from None
    for account, (before, after) in balances.items():
        console.print(f"{account}: ¥{before / 100:,.2f} → ¥{after / 100:,.2f}")


async def send_one(
    storage: Storage, source: str, target: str, amount: str
) -> dict[str, tuple[int, int]]:
    """Validate, transfer, wait until yuebao applied it; the two balances before and after."""
    alipay, yuebao = await open_banks(storage)
    try:
        transfer = await new_transfer(alipay, yuebao, source, target, parse_amount(amount))
        before = [await alipay.balance(source), await yuebao.balance(target)]
        timing = Timing()
        sender = await Sender.open(alipay)
        async with (
            nats_session() as session,
            run_coordinator(session.nc, config=timing.coordinator),
            TransactionProducer(session.nc, SENDER_GROUP, sender.txlog.check) as producer,
            Receiver(yuebao).consumer(session.nc, ack_wait=timing.ack_wait),
        ):
            await sender.transfer(producer, transfer)  # a refusal leaves the blocks as itself
            await wait_drained(
                session.nc, [(TOPIC, RECEIVER_GROUP)], producer_group=SENDER_GROUP, timeout=30
            )
        after = [await alipay.balance(source), await yuebao.balance(target)]
        return {
            f"{ALIPAY} {source}": (before[0] or 0, after[0] or 0),
            f"{YUEBAO} {target}": (before[1] or 0, after[1] or 0),
        }
    finally:
        await alipay.db.close()
        await yuebao.db.close()


async def open_banks(storage: Storage) -> tuple[Bank, Bank]:
    """Both banks as a demo left them; TransferRefused if there are none yet."""
    alipay = Bank(await storage.open(ALIPAY))
    yuebao = Bank(await storage.open(YUEBAO))
    for bank in (alipay, yuebao):
        if not await bank.has_accounts():
            await alipay.db.close()
            await yuebao.db.close()
            raise TransferRefused(
                f"no accounts in {storage.describe(bank.name)}; run the demo first "
                "(python -m apps.transfer) with the same --db options"
            )
    return alipay, yuebao


@app.command("reconcile")
def reconcile_command(
    db: Db = Backend.SQLITE,
    data_dir: DataDir = None,
    pg_dsn: PgDsn = DEFAULT_PG_DSN,
    pg_prefix: PgPrefix = None,
) -> None:
    """Prove the books of both banks as they are now (databases only); exit 1 on a mismatch."""
    try:
        reconciliation = run_anyio(reconcile_books, banks(db, data_dir, pg_dsn, pg_prefix))
    except TransferRefused as error:
        raise fail(str(error)) from None
    show(console, reconciliation, title="reconciliation (books only)")
    if not reconciliation.ok:
        raise typer.Exit(MISMATCH)


async def reconcile_books(storage: Storage) -> Reconciliation:
    alipay, yuebao = await open_banks(storage)
    try:
        return await reconcile(alipay, yuebao)
    finally:
        await alipay.db.close()
        await yuebao.db.close()


if __name__ == "__main__":
    run_cli(app)  # bad flags or settings: one line, exit 2; NATS unreachable: one line, exit 1
