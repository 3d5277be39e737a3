"""`txactors top`: a live view of the partitions, their owners, open and discarded
transactions, rates and dead letters (gathered by txactors/ops/top.py, drawn by
txactors/ops/top_view.py), refreshed in place until Ctrl-C; `--once` prints one frame."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated

import typer

from txactors.cli import consoles
from txactors.cli.operator import NatsUrlOption, admin_call

if TYPE_CHECKING:
    from nats.aio.client import Client
    from rich.console import Console


def top(
    metrics: Annotated[
        list[str] | None,
        typer.Option(
            "--metrics",
            metavar="URL",
            help="A coordinator's metrics endpoint (http://HOST:PORT/metrics, its "
            "--metrics-port); give one per coordinator. Rates and counts come from these.",
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option(help="Seconds between frames (and the span rates are taken over).")
    ] = 2.0,
    once: Annotated[
        bool,
        typer.Option(
            "--once", help="Print one frame and exit: two looks --interval apart, for the rates."
        ),
    ] = False,
    partitions: Annotated[
        int | None,
        typer.Option(
            help="Expect this partition count (an error if the coordinators publish another).",
            min=1,
        ),
    ] = None,
    url: NatsUrlOption = None,
) -> None:
    """Watch partitions, owners, open and discarded transactions, commits and check-backs
    per second, and dead letters, live."""
    if not interval > 0:
        raise typer.BadParameter(f"must be above 0, got {interval:g}", param_hint="--interval")
    endpoints = list(metrics or ())
    console = consoles.console()
    try:
        admin_call(url, lambda nc: _watch(nc, console, endpoints, interval, once, partitions))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


async def _watch(
    nc: Client,
    console: Console,
    metrics: list[str],
    interval: float,
    once: bool,
    partitions: int | None,
) -> None:
    from rich.live import Live

    from txactors.ops.top import take_snapshot
    from txactors.ops.top_view import render_top

    previous = await take_snapshot(nc, metrics=metrics, partitions=partitions)
    if once:
        await asyncio.sleep(interval)
        current = await take_snapshot(nc, metrics=metrics, partitions=partitions)
        console.print(render_top(previous, current, interval=interval))
        return
    with Live(
        render_top(None, previous, interval=interval),
        console=console,
        auto_refresh=False,
        screen=console.is_terminal,
    ) as live:
        while True:
            await asyncio.sleep(interval)
            current = await take_snapshot(nc, metrics=metrics, partitions=partitions)
            live.update(render_top(previous, current, interval=interval), refresh=True)
            previous = current
