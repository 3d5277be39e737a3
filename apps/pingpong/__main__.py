"""`python -m apps.pingpong`: a Pinger actor asks a Ponger actor over NATS.

The Ponger is served on a NATS subject; the Pinger reaches it only through a
`RemoteActorRef`, exactly as it would from another process or machine. With no `NATS_URL`
set, an embedded nats-server is started for the run and stopped afterwards.
"""

from __future__ import annotations

import time
from typing import Any

import typer
from rich.progress import Progress
from rich.table import Table

from txactors.actors import Actor, ActorSystem, RemoteActorRef, serve
from txactors.actors.loop import run_anyio
from txactors.cli.consoles import console as wide_console
from txactors.nats.connect import nats_session
from txactors.observe.logs import configure_logging
from txactors.wire.protocol import Message

SUBJECT = "demo.ponger"


class Ping(Message):
    seq: int


class Pong(Message):
    seq: int
    served_by: str


class PlayRally(Message):
    """Ask the Pinger to play `count` pings against the Ponger."""

    count: int


class RallyResult(Message):
    pongs: int
    seconds: float


class Ponger(Actor):
    async def receive(self, message: Any) -> Any:
        match message:
            case Ping(seq=seq):
                return Pong(seq, served_by=self.ref.name)


class Pinger(Actor):
    def __init__(self, ponger: RemoteActorRef, progress: Progress) -> None:
        self.ponger = ponger
        self.progress = progress

    async def receive(self, message: Any) -> Any:
        match message:
            case PlayRally(count=count):
                task = self.progress.add_task("ping → pong over NATS", total=count)
                started = time.perf_counter()
                for seq in range(count):
                    pong = await self.ponger.ask(Ping(seq))
                    if pong.seq != seq:
                        raise RuntimeError(f"pong {pong.seq} answered ping {seq}")
                    self.progress.advance(task)
                return RallyResult(pongs=count, seconds=time.perf_counter() - started)


def main(count: int = typer.Option(2000, min=1, help="How many pings to send.")) -> None:
    configure_logging("WARNING")
    run_anyio(play, count)


async def play(count: int) -> None:
    console = wide_console()
    async with nats_session() as session, ActorSystem() as system:
        where = "embedded nats-server" if session.server else "NATS"
        console.print(f"[bold]txactors ping-pong[/] on {where} at {session.url}")
        ponger = await system.spawn(Ponger, name="ponger")
        subscription = await serve(session.nc, ponger, SUBJECT, Ping)
        with Progress(console=console) as progress:
            pinger = await system.spawn(
                lambda: Pinger(RemoteActorRef(session.nc, SUBJECT, Pong), progress),
                name="pinger",
            )
            result: RallyResult = await pinger.ask(PlayRally(count), timeout=600)
        await subscription.unsubscribe()

    table = Table(title="rally")
    for column in ("pongs", "seconds", "round trips/s", "mean latency"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{result.pongs:,}",
        f"{result.seconds:.2f}",
        f"{result.pongs / result.seconds:,.0f}",
        f"{result.seconds / result.pongs * 1e6:,.0f} µs",
    )
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
