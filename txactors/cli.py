"""The `txactors` command. Each command is a thin function here; its work lives in a module.

To add one, write `@app.command()` below with its options and import the implementation inside
the function, so `txactors --help` stays fast and one command's imports cannot break another.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from txactors.config import DATA_DIR_ENV
from txactors.errors import NatsServerError
from txactors.logs import LOG_LEVEL_ENV, configure_logging

if TYPE_CHECKING:
    from nats.aio.client import Client

    from txactors.coordinator import CoordinatorConfig
    from txactors.coordinator.options import CoordinatorOptions
    from txactors.metrics import CoordinatorMetrics
    from txactors.protocol import Ended, TransactionInfo

T = TypeVar("T")

app = typer.Typer(
    help="Transactional messages on NATS JetStream, built from asyncio actors.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main() -> None:
    """Keeps `txactors <command>` form even while there is only one command."""


@app.command()
def server(
    port: Annotated[
        int, typer.Option(help="Client port; 0 picks a free one.", min=0, max=65535)
    ] = 0,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="JetStream store directory (kept). Default: a temporary one, removed on exit.",
            envvar=DATA_DIR_ENV,
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
) -> None:
    """Run an embedded nats-server with JetStream in the foreground until Ctrl-C or SIGTERM.

    The first line on stdout is the URL to connect to (e.g. NATS_URL for other processes).
    """
    configure_logging()
    try:
        code = asyncio.run(_run_server(port=port, data_dir=data_dir, host=host))
    except NatsServerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


async def _run_server(*, port: int, data_dir: Path | None, host: str) -> int:
    from txactors.server import EmbeddedNatsServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with EmbeddedNatsServer(data_dir, port=port, host=host) as nats_server:
        typer.echo(nats_server.url)
        kept = "" if data_dir is not None else " (temporary; --data-dir to keep it)"
        typer.echo(f"data dir: {nats_server.data_dir}{kept}; Ctrl-C to stop", err=True)
        while not stop.is_set():
            if not nats_server.running:
                typer.echo(
                    f"error: nats-server exited unexpectedly; its log:\n{nats_server.log_tail()}",
                    err=True,
                )
                return 1
            # Wake on a signal at once; otherwise look at the child twice a second.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
    return 0


@app.command()
def coordinator(
    partitions: Annotated[int, typer.Option(help="Partitions (txid hash buckets).", min=1)] = 1,
    transaction_timeout: Annotated[
        float, typer.Option(help="Seconds before the first check-back.")
    ] = 6.0,
    check_interval: Annotated[
        float, typer.Option(help="Seconds after the first inconclusive check.")
    ] = 30.0,
    check_max: Annotated[int, typer.Option(help="Inconclusive checks before discard.")] = 15,
    check_answer_timeout: Annotated[
        float, typer.Option(help="Seconds a producer has to answer a check-back.")
    ] = 5.0,
    tick_interval: Annotated[float, typer.Option(help="Timer resolution in seconds.")] = 0.1,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve Prometheus metrics on http://0.0.0.0:PORT/metrics."),
    ] = None,
    replicas: Annotated[
        int, typer.Option(help="Replicas of the TXN_* streams (3 on a production cluster).", min=1)
    ] = 1,
    lease_ttl: Annotated[
        float, typer.Option(help="Seconds before a dead coordinator's partitions are taken over.")
    ] = 10.0,
    max_partitions: Annotated[
        int | None, typer.Option(help="Most partitions this process serves (default: all).")
    ] = None,
) -> None:
    """Run the transaction coordinator (and checker) on NATS_URL, or an embedded server.

    Stops cleanly on Ctrl-C or SIGTERM; a crash at any point loses nothing (it recovers
    from its streams on the next start).
    """
    from txactors.coordinator import CoordinatorConfig
    from txactors.coordinator.options import CoordinatorOptions

    configure_logging()
    config = CoordinatorConfig(
        transaction_timeout=transaction_timeout,
        check_interval=check_interval,
        check_max=check_max,
        check_answer_timeout=check_answer_timeout,
    )
    options = CoordinatorOptions(
        partitions=partitions,
        tick_interval=tick_interval,
        replicas=replicas,
        lease_ttl=lease_ttl,
        max_partitions=max_partitions or partitions,
    )
    metrics = None
    if metrics_port is not None:
        from prometheus_client import start_http_server

        from txactors.metrics import CoordinatorMetrics

        metrics = CoordinatorMetrics()
        start_http_server(metrics_port)
    asyncio.run(_run_coordinator(config, options, metrics))


async def _run_coordinator(
    config: CoordinatorConfig, options: CoordinatorOptions, metrics: CoordinatorMetrics | None
) -> None:
    from txactors.connection import nats_session
    from txactors.coordinator.service import run_coordinator

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with (
        nats_session() as session,
        run_coordinator(session.nc, config=config, options=options, metrics=metrics),
    ):
        typer.echo(f"coordinator ready on {session.url}", err=True)
        await stop.wait()


# -- txactors txn: operators inspect and resolve transactions -------------------------------

txn_app = typer.Typer(
    help="Inspect and resolve transactions held by a running coordinator (`txactors coordinator`).",
    no_args_is_help=True,
)
app.add_typer(txn_app, name="txn")

TxidArgument = Annotated[str, typer.Argument(help="The transaction id.", show_default=False)]
UrlOption = Annotated[
    str | None,
    typer.Option(help="NATS server the coordinator runs on. Default: NATS_URL (one is required)."),
]
PartitionsOption = Annotated[
    int, typer.Option(help="The coordinator's partition count (its --partitions).", min=1)
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON, for scripts.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


@txn_app.command("list")
def txn_list(
    state: Annotated[
        list[str] | None,
        typer.Option(help="Only transactions in this state (repeatable), e.g. discarded."),
    ] = None,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """List open (prepared, checking, being decided) and discarded transactions, oldest first."""
    from txactors import admin
    from txactors.coordinator.lifecycle import TxnState

    states = state or []
    known = [s.value for s in TxnState]
    unknown = [s for s in states if s not in known]
    if unknown:
        raise typer.BadParameter(
            f"{', '.join(unknown)}; states are {', '.join(known)}", param_hint="--state"
        )
    found = _admin_call(
        url, lambda nc: admin.list_transactions(nc, partitions=partitions, states=states)
    )
    if as_json:
        typer.echo(admin.to_json(found))
    elif found:
        _print(admin.render_list(found))
    else:
        typer.echo("no open or discarded transactions")


@txn_app.command("show")
def txn_show(
    txid: TxidArgument,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Show everything about one open or discarded transaction."""
    from txactors import admin

    info = _admin_call(url, lambda nc: admin.show(nc, txid, partitions=partitions))
    if as_json:
        typer.echo(admin.to_json(info))
    else:
        _print(admin.render_detail(info))


@txn_app.command("resume")
def txn_resume(
    txid: TxidArgument,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Put a discarded or pending transaction back to prepared, with a fresh check count.

    The checker then asks its producer again; nothing is published by this command.
    """
    from txactors import admin

    ended = _admin_call(url, lambda nc: admin.resume(nc, txid, partitions=partitions))
    _print_ended(ended, as_json)


@txn_app.command("commit")
def txn_commit(
    txid: TxidArgument,
    yes: YesOption = False,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Commit a transaction by hand: its messages are published to their topics.

    Commit only what the producer's local transaction committed (check its database first).
    """
    from txactors import admin

    if not yes:
        _confirm(url, txid, partitions, "commit", "publishes its messages to their topics")
    ended = _admin_call(url, lambda nc: admin.commit(nc, txid, partitions=partitions))
    _print_ended(ended, as_json)


@txn_app.command("rollback")
def txn_rollback(
    txid: TxidArgument,
    yes: YesOption = False,
    partitions: PartitionsOption = 1,
    as_json: JsonOption = False,
    url: UrlOption = None,
) -> None:
    """Roll a transaction back by hand: none of its messages is ever delivered."""
    from txactors import admin

    if not yes:
        _confirm(url, txid, partitions, "roll back", "means none of its messages is delivered")
    ended = _admin_call(url, lambda nc: admin.rollback(nc, txid, partitions=partitions))
    _print_ended(ended, as_json)


def _admin_call(url: str | None, work: Callable[[Client], Awaitable[T]]) -> T:
    """One exchange with the coordinator; exit 1 when it refuses, 2 when it cannot be asked."""
    from txactors.admin import CoordinatorUnavailable, admin_session
    from txactors.errors import CommandError, ConfigError, NatsConnectError

    # Operator output stays clean; connection trouble is reported once, below.
    configure_logging(os.environ.get(LOG_LEVEL_ENV) or "ERROR")

    async def run() -> T:
        async with admin_session(url) as nc:
            return await work(nc)

    try:
        return asyncio.run(run())
    except CommandError as exc:
        typer.echo(f"{exc.code}: {exc.message}", err=True)
        raise typer.Exit(1) from exc
    except (ConfigError, NatsConnectError, CoordinatorUnavailable) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _confirm(url: str | None, txid: str, partitions: int, action: str, effect: str) -> None:
    """Show what is about to be decided (on stderr, so --json output stays clean) and ask."""
    from rich.console import Console

    from txactors import admin
    from txactors.errors import CommandError

    async def find(nc: Client) -> TransactionInfo | str:
        try:
            return await admin.show(nc, txid, partitions=partitions)
        except CommandError as exc:
            return exc.message

    found = _admin_call(url, find)
    if isinstance(found, str):
        typer.echo(f"note: {found}", err=True)
    else:
        Console(stderr=True).print(admin.render_detail(found))
    # Not typer.confirm: click's prompt writes a space to stdout, which would spoil --json.
    typer.echo(
        f"{action.capitalize()} transaction {txid}? This {effect} [y/N] ", nl=False, err=True
    )
    if sys.stdin.readline().strip().lower() not in ("y", "yes"):
        typer.echo(f"not done: {txid} was left as it is", err=True)
        raise typer.Exit(1)


def _print(renderable: object) -> None:
    """Print to a terminal at its width; into a pipe or file, wide enough not to wrap rows."""
    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 200).print(renderable)


def _print_ended(ended: Ended, as_json: bool) -> None:
    from txactors.admin import to_json

    typer.echo(to_json(ended) if as_json else f"{ended.txid}: {ended.state}")


# -- txactors sink: committed topics into Spark tables (spark_sinks/, the `spark` extra) ----

sink_app = typer.Typer(
    help="Stream committed topics into Parquet tables with Spark, exactly once (needs Java 17+).",
    no_args_is_help=True,
)
app.add_typer(sink_app, name="sink")

WarehouseOption = Annotated[
    Path,
    typer.Option(
        help="Tables, checkpoints and the catalog live here.", envvar="TXACTORS_WAREHOUSE"
    ),
]


@sink_app.command("run")
def sink_run(
    topics: Annotated[
        list[str], typer.Option(help="Topics to sink (comma separated or repeated).")
    ],
    warehouse: WarehouseOption = Path("warehouse"),
    schema: Annotated[
        list[str] | None,
        typer.Option(help="TOPIC=module:Struct decodes the payload into columns (repeatable)."),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Catch up with the streams, then stop.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between micro-batches.")] = 10.0,
    max_rows_per_batch: Annotated[int | None, typer.Option(min=1)] = None,
    query: Annotated[str | None, typer.Option(help="SQL to show after the run.")] = None,
) -> None:
    """Sink topics from NATS_URL (or an embedded server over TXACTORS_DATA_DIR) into tables.

    Prints each batch's rows and lag; a rerun continues where the last one stopped.
    """
    configure_logging(os.environ.get(LOG_LEVEL_ENV) or "WARNING")
    with _sink_errors():
        from spark_sinks import cli as sink_cli

        sink_cli.sink_and_show(
            sink_cli.parse_schemas(topics, schema or []),
            warehouse,
            once=once,
            interval=interval,
            max_rows_per_batch=max_rows_per_batch,
            sql=query,
        )


@sink_app.command("query")
def sink_query(
    sql: Annotated[str, typer.Argument(help='e.g. "select count(*) from transfers"')],
    warehouse: WarehouseOption = Path("warehouse"),
    limit: Annotated[int, typer.Option(help="Rows to show.", min=1)] = 20,
) -> None:
    """Run SQL on the sunk tables (`<topic>`, `_rejects`) and print the result."""
    with _sink_errors():
        from spark_sinks import cli as sink_cli

        sink_cli.query(sql, warehouse, limit)


@contextlib.contextmanager
def _sink_errors() -> Iterator[None]:
    """A missing Java, a bad schema or an unreachable server: one line and exit 2."""
    from txactors.errors import TxActorsError

    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name not in ("pyspark", "pyarrow"):
            raise
        typer.echo(f"error: the sink needs {exc.name}: pip install 'txactors[spark]'", err=True)
        raise typer.Exit(2) from exc
    except TxActorsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


if __name__ == "__main__":
    app()
