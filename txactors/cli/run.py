"""`txactors run`: a TxApp's consumers as a worker process (txactors/app/worker.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from txactors.actors.loop import run as run_on_loop
from txactors.observe.logs import configure_logging


def run(
    target: Annotated[
        str,
        typer.Argument(
            metavar="MODULE:APP",
            help="The TxApp to run, e.g. `orders.service:app` (`:app` may be left out).",
            show_default=False,
        ),
    ],
    metrics_port: Annotated[
        int | None,
        typer.Option(help="Serve the consumers' Prometheus metrics on this port.", min=0),
    ] = None,
) -> None:
    """Run a TxApp's consumers on NATS_URL (or an embedded server) until Ctrl-C or SIGTERM.

    A signal stops them gracefully: running handlers finish and ack, then exit 0. A second
    signal stops at once (their messages are redelivered).
    """
    from txactors.app.worker import load_app, run_worker, settle_threads
    from txactors.observe.metrics import serve_metrics

    configure_logging()
    worker = load_app(target)
    http = None if metrics_port is None else serve_metrics(worker.metrics.registry, metrics_port)
    try:
        code = run_on_loop(run_worker(worker))
    finally:
        if http is not None:
            http.shutdown()
            http.server_close()
    settle_threads(code)  # or exits past threads the app left running
    raise typer.Exit(code)
