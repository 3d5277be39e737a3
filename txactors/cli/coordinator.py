"""`txactors coordinator`: the coordinator as an operator runs it, one flag per setting, and
a stop on a signal that is clean when it can be and prompt when it cannot."""

from __future__ import annotations

import asyncio
import gc
import inspect
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from txactors.actors.loop import run
from txactors.cli.settings import CONFIG_ENV, SETTINGS, CoordinatorSettings, load_settings
from txactors.errors import ConfigError
from txactors.observe.logs import configure_logging, get_logger

if TYPE_CHECKING:
    from txactors.observe.metrics import CoordinatorMetrics

log = get_logger(__name__)

GC_YOUNG_THRESHOLD = 20_000
"""Container allocations between two young-generation collections (CPython's default: 700).
A round of 64 transactions allocates thousands of short-lived objects, nearly none in cycles:
at the default a collection ran several times a round, and whatever was in flight then (the
round's transactions) survived it and was traversed again by the older generations.
Measured: -3% of the coordinator's instructions per transaction at 64 in flight, -1% at 1
(docs/benchmarks.md). The coordinator's own process only: the library never tunes a user's
collector."""
STOP_GRACE = 1.0
"""Seconds a stopping coordinator has to leave cleanly (give its leases back)."""
STOP_CUT = 0.5
"""Further seconds a cancelled one has to unwind before the process exits regardless."""


def coordinator(config: Path | None = None, **flags: str | None) -> None:
    """Run the transaction coordinator (and checker) on NATS_URL, or an embedded server.

    Each setting is a flag, TXACTORS_<NAME> or a key of the --config file (in that order of
    precedence); times are in seconds.

    Stops within two seconds on Ctrl-C or SIGTERM; a crash at any point loses nothing (it
    recovers from its streams on the next start).
    """
    from txactors.observe.metrics import CoordinatorMetrics, serve_metrics

    settings = load_settings(flags, os.environ, config)
    configure_logging(settings.process.log_level)
    port = settings.process.metrics_port
    metrics: CoordinatorMetrics | None = None
    http = None
    if port is not None:
        metrics = CoordinatorMetrics()
        try:
            http = serve_metrics(metrics.registry, port)
        except ConfigError as error:
            raise ConfigError(f"{error} (set by {settings.source('metrics_port')})") from error
    gc.freeze()  # what the imports and settings made lives on: no collection visits it again
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    try:
        run(_run_coordinator(settings, metrics))
    finally:
        if http is not None:
            http.shutdown()
            http.server_close()


# Typer reads a command's options from its signature: give `coordinator` one `--flag` per
# setting (text, None when not given, so the environment or the file can fill it in).
coordinator.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                Path | None,
                typer.Option(
                    "--config",
                    envvar=CONFIG_ENV,
                    dir_okay=False,
                    help="A TOML file of settings, e.g. `check_max = 20` (keys as in the table "
                    "of docs/operations.md).",
                ),
            ],
        ),
        *(
            inspect.Parameter(
                setting.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    str | None,
                    typer.Option(
                        setting.flag,
                        metavar=setting.metavar,
                        show_default=False,
                        help=f"{setting.help} (default {setting.shown_default}; env {setting.env})",
                    ),
                ],
            )
            for setting in SETTINGS
        ),
    ]
)


async def _run_coordinator(
    settings: CoordinatorSettings, metrics: CoordinatorMetrics | None
) -> None:
    from txactors.coordinator.service import run_coordinator
    from txactors.nats.config import NatsConfig
    from txactors.nats.connect import nats_session

    process = settings.process
    nats_config = NatsConfig.from_env(fsync=process.fsync, fsync_interval=process.fsync_interval)

    async def serve(stop: asyncio.Event) -> None:
        # Its own requests (check-backs) use the inbox prefix it answers, as the account's do.
        inbox_prefix = settings.options.inbox_prefix.removesuffix(".")
        async with (
            nats_session(nats_config, inbox_prefix=inbox_prefix) as session,
            run_coordinator(
                session.nc, config=settings.config, options=settings.options, metrics=metrics
            ),
        ):
            loop = type(asyncio.get_running_loop()).__module__.partition(".")[0]  # as it runs
            typer.echo(f"coordinator ready on {session.url} (event loop: {loop})", err=True)
            await stop.wait()

    await _until_stopped(serve)


def _quiet_cancelled_leftovers(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """A stop cut short cancels what was still under way, nats-py's drain among them, whose
    gathered futures then end cancelled with nobody to read them: asyncio would print each as
    a traceback. Those are the cut, said once by `stop_cut_short`; anything else is printed."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


async def _until_stopped(work: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `work` until it returns, or until SIGINT/SIGTERM, which ends it in ~STOP_GRACE s.

    On a signal, `work` sees its event set and leaves cleanly. With the server gone, that
    cleanup (or a start-up still waiting for the server) would sit out NATS timeouts and
    reconnects, so after STOP_GRACE it is cancelled, and if even that does not end it within
    STOP_CUT the process exits at once: a coordinator killed at any point loses nothing.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(work(stop))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        await asyncio.wait({task}, timeout=STOP_GRACE)
    if not task.done():
        log.warning("stop_cut_short", after=STOP_GRACE)
        loop.set_exception_handler(_quiet_cancelled_leftovers)
        task.cancel()
        await asyncio.wait({task}, timeout=STOP_CUT)
    if not task.done():
        log.warning("stop_forced", after=STOP_GRACE + STOP_CUT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if not task.cancelled():
        task.result()  # its error, if it failed
