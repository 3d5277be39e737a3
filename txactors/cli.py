"""The `txactors` command. Each command is a thin function here; its work lives in a module.

To add one, write `@app.command()` below with its options and import the implementation inside
the function, so `txactors --help` stays fast and one command's imports cannot break another.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from txactors.config import DATA_DIR_ENV
from txactors.errors import NatsServerError
from txactors.logs import configure_logging

if TYPE_CHECKING:
    from txactors.coordinator import CoordinatorConfig
    from txactors.coordinator.partition import CoordinatorOptions

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
) -> None:
    """Run the transaction coordinator (and checker) on NATS_URL, or an embedded server.

    Stops cleanly on Ctrl-C or SIGTERM; a crash at any point loses nothing (it recovers
    from its streams on the next start).
    """
    from txactors.coordinator import CoordinatorConfig
    from txactors.coordinator.partition import CoordinatorOptions

    configure_logging()
    config = CoordinatorConfig(
        transaction_timeout=transaction_timeout,
        check_interval=check_interval,
        check_max=check_max,
        check_answer_timeout=check_answer_timeout,
    )
    options = CoordinatorOptions(partitions=partitions, tick_interval=tick_interval)
    asyncio.run(_run_coordinator(config, options))


async def _run_coordinator(config: CoordinatorConfig, options: CoordinatorOptions) -> None:
    from txactors.connection import nats_session
    from txactors.coordinator.service import run_coordinator

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with (
        nats_session() as session,
        run_coordinator(session.nc, config=config, options=options),
    ):
        typer.echo(f"coordinator ready on {session.url}", err=True)
        await stop.wait()


if __name__ == "__main__":
    app()
