"""The `txactors` command. Each command is a thin function here; its work lives in a module.

To add one, write `@app.command()` below with its options and import the implementation inside
the function, so `txactors --help` stays fast and one command's imports cannot break another.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Annotated

import typer

from txactors.config import DATA_DIR_ENV
from txactors.errors import NatsServerError
from txactors.logs import configure_logging

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


if __name__ == "__main__":
    app()
