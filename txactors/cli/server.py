"""`txactors server`: an embedded nats-server in the foreground, for trying txactors out."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Annotated

import typer

from txactors.actors.loop import run
from txactors.embedded.setup import (
    DEFAULT_FSYNC,
    DEFAULT_FSYNC_INTERVAL,
    FSYNC_MODES,
    Fsync,
    FsyncError,
    FsyncSetting,
)
from txactors.errors import NatsServerError
from txactors.nats.config import DATA_DIR_ENV, FSYNC_ENV, FSYNC_INTERVAL_ENV
from txactors.observe.logs import configure_logging


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
    fsync: Annotated[
        str,
        typer.Option(
            metavar=f"[{'|'.join(FSYNC_MODES)}]",
            help="always: every JetStream write is on disk before it is acknowledged. "
            "interval: acknowledged at once, flushed every --fsync-interval seconds (faster; "
            "a power cut or kernel crash loses acknowledged writes).",
            envvar=FSYNC_ENV,
        ),
    ] = DEFAULT_FSYNC,
    fsync_interval: Annotated[
        float,
        typer.Option(
            help="Seconds between flushes with --fsync interval.", envvar=FSYNC_INTERVAL_ENV
        ),
    ] = DEFAULT_FSYNC_INTERVAL,
    nodes: Annotated[
        int,
        typer.Option(
            help="Servers to run as one JetStream cluster (3 to try --replicas 3); ports are "
            "picked free, each node stores into --data-dir/nN.",
            min=1,
            max=9,  # a cluster to try on one machine; JetStream clusters are 3 or 5
        ),
    ] = 1,
) -> None:
    """Run an embedded nats-server with JetStream in the foreground until Ctrl-C or SIGTERM.

    The first line on stdout is the URL to connect to (e.g. NATS_URL for other processes);
    with --nodes, every node's URL, comma-separated.
    """
    try:
        setting = FsyncSetting(fsync=fsync, fsync_interval=fsync_interval)  # type: ignore[arg-type]
    except FsyncError as exc:
        flag = "--" + exc.field.replace("_", "-")
        raise typer.BadParameter(str(exc), param_hint=flag) from None
    if nodes > 1 and port:
        raise typer.BadParameter(
            "a cluster's ports are picked free: leave --port 0", param_hint="--port"
        )
    configure_logging()
    try:
        code = run(
            _run_server(
                port=port,
                data_dir=data_dir,
                host=host,
                fsync=setting.fsync,
                fsync_interval=setting.fsync_interval,
                nodes=nodes,
            )
        )
    except NatsServerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)


async def _run_server(
    *,
    port: int,
    data_dir: Path | None,
    host: str,
    fsync: Fsync,
    fsync_interval: float,
    nodes: int,
) -> int:
    from txactors.embedded.cluster import EmbeddedNatsCluster
    from txactors.embedded.server import EmbeddedNatsServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    servers: EmbeddedNatsServer | EmbeddedNatsCluster = (
        EmbeddedNatsServer(
            data_dir, port=port, host=host, fsync=fsync, fsync_interval=fsync_interval
        )
        if nodes == 1
        else EmbeddedNatsCluster(
            data_dir, size=nodes, host=host, fsync=fsync, fsync_interval=fsync_interval
        )
    )
    members = servers.nodes if isinstance(servers, EmbeddedNatsCluster) else [servers]
    async with servers:
        typer.echo(servers.urls if isinstance(servers, EmbeddedNatsCluster) else servers.url)
        kept = "" if data_dir is not None else " (temporary; --data-dir to keep it)"
        flushed = (
            "fsync before every ack"
            if fsync == "always"
            else f"fsync every {fsync_interval:g}s (acked writes can be lost on a power cut)"
        )
        typer.echo(f"data dir: {servers.data_dir}{kept}; {flushed}; Ctrl-C to stop", err=True)
        while not stop.is_set():
            for member in members:
                if not member.running:
                    typer.echo(
                        f"error: nats-server exited unexpectedly; its log:\n{member.log_tail()}",
                        err=True,
                    )
                    return 1
            # Wake on a signal at once; otherwise look at the children twice a second.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=0.5)
    return 0
