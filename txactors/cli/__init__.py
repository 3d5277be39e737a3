"""The `txactors` command: the root `app` with the options of every command, and its commands.

Each command is a thin function in the module named after it; its work lives in the module
that owns it, imported inside the function, so `txactors --help` stays fast and one command's
imports cannot break another. To add one, write it in its own module and register it below.
"""

from __future__ import annotations

import os
from typing import Annotated, NoReturn

import typer

from spark_sinks import commands as sink
from txactors.cli import coordinator, dlq, lease, partitions, protocol, run, server, top, txn
from txactors.cli.exits import run_cli
from txactors.cli.flags import show_flags_without_a_type
from txactors.observe.logs import LOG_FORMAT_ENV, LogFormat

__all__ = ["app", "main", "run_cli"]

show_flags_without_a_type()

app = typer.Typer(
    help="Transactional messages on NATS JetStream, built from asyncio actors.",
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"txactors {version('txactors')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("txactors (not installed: no version)")
        raise typer.Exit()


@app.callback()
def _main(
    log_format: Annotated[
        LogFormat | None,
        typer.Option(
            envvar=LOG_FORMAT_ENV,
            case_sensitive=False,
            help="Log lines as JSON or for the console. Default: JSON unless stderr is a terminal.",
        ),
    ] = None,
    _version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    """Options of every command, given before it: `txactors --log-format json coordinator`."""
    if log_format is not None:
        # Every command configures its own logging (and its children inherit the
        # environment): the variable is how the choice reaches them all.
        os.environ[LOG_FORMAT_ENV] = log_format.value


# In this order in `txactors --help`.
app.command()(server.server)
app.command()(coordinator.coordinator)
app.add_typer(txn.app, name="txn")
app.add_typer(dlq.app, name="dlq")
app.add_typer(lease.app, name="lease")
app.add_typer(partitions.app, name="partitions")
app.add_typer(protocol.app, name="protocol")
app.add_typer(sink.app, name="sink")
app.command()(run.run)
app.command()(top.top)


def main() -> NoReturn:
    """The `txactors` command."""
    run_cli(app)
