"""Actor runtime throughput, next to raw nats-py on the same embedded server.

- local `tell`: messages per second into one actor's bounded mailbox;
- remote `ask` round trips per second at concurrency 1 and 64, against raw nats-py
  request/reply (a callback that echoes the bytes) measured in the same run, same server,
  same two connections. Goal: remote ask >= 70% of raw at both concurrencies.
- the same ask answered later: the actor keeps the `Request` handle and answers it from its
  next message (one more mailbox hop, the coordinator's pattern); no goal, shown beside.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from rich.console import Console
from rich.table import Table

from txactors.actors import Actor, ActorSystem, RemoteActorRef, Request, serve
from txactors.embedded.server import EmbeddedNatsServer
from txactors.observe.logs import configure_logging
from txactors.wire.protocol import Message, encode


class Ping(Message):
    seq: int
    body: bytes


class Pong(Message):
    seq: int


class Echo(Actor):
    async def receive(self, message: Any) -> Any:
        return Pong(message.seq)


class Answered:
    __slots__ = ("request",)

    def __init__(self, request: Request) -> None:
        self.request = request


class EchoLater(Actor):
    """Keeps each ask's handle and answers it when its own follow-up message comes."""

    answers_later = True

    async def receive(self, message: Any) -> None:
        if isinstance(message, Answered):
            await message.request.answer(Pong(message.request.message.seq))
        else:
            await self.ref.tell(Answered(message))


class Sink(Actor):
    def __init__(self) -> None:
        self.count = 0

    async def receive(self, message: Any) -> Any:
        self.count += 1
        return self.count


BODY = b"x" * 64


async def local_tell_rate(count: int) -> float:
    async with ActorSystem() as system:
        ref = await system.spawn(Sink, mailbox_size=1024)
        message = Ping(0, BODY)
        started = time.perf_counter()
        for _ in range(count):
            await ref.tell(message)
        assert await ref.ask(message) == count + 1
        return count / (time.perf_counter() - started)


async def round_trips(request: Callable[[int], Awaitable[Any]], total: int, workers: int) -> float:
    """Requests per second with `workers` concurrent callers sharing `total` requests."""
    per_worker = total // workers

    async def worker(offset: int) -> None:
        for i in range(per_worker):
            await request(offset + i)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for w in range(workers):
            tg.start_soon(worker, w * per_worker)
    return per_worker * workers / (time.perf_counter() - started)


async def raw_rate(server_nc: Client, client_nc: Client, total: int, workers: int) -> float:
    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    sub = await server_nc.subscribe("bench.raw", cb=echo)
    await server_nc.flush()
    payload = encode(Ping(0, BODY))
    try:
        return await round_trips(
            lambda i: client_nc.request("bench.raw", payload, timeout=10), total, workers
        )
    finally:
        await sub.unsubscribe()


async def remote_ask_rate(
    server_nc: Client, client_nc: Client, total: int, workers: int, actor: type[Actor] = Echo
) -> float:
    async with ActorSystem() as system:
        ref = await system.spawn(actor, mailbox_size=1024)
        sub = await serve(server_nc, ref, "bench.actor", Ping)
        await server_nc.flush()
        remote = RemoteActorRef(client_nc, "bench.actor", Pong)
        try:
            return await round_trips(
                lambda i: remote.ask(Ping(i, BODY), timeout=10), total, workers
            )
        finally:
            await sub.unsubscribe()


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("WARNING")
    console = Console()
    rounds = 1 if quick else 3
    table = Table(title=f"actor runtime (median of {rounds} rounds)")
    for column in ("measure", "txactors", "raw nats-py", "ratio", "goal"):
        table.add_column(column, justify="right" if column != "measure" else "left")

    tell_rates = [await local_tell_rate(20_000 if quick else 200_000) for _ in range(rounds)]
    table.add_row("local tell msg/s", f"{statistics.median(tell_rates):,.0f}", "-", "-", "-")

    async with EmbeddedNatsServer() as server:
        server_nc = await nats.connect(server.url)
        client_nc = await nats.connect(server.url)
        try:
            for workers, total in (
                (1, 2_000 if quick else 10_000),
                (64, 6_400 if quick else 64_000),
            ):
                raw, ours, later = [], [], []
                for _ in range(rounds):  # interleave so drift hits all alike
                    raw.append(await raw_rate(server_nc, client_nc, total, workers))
                    ours.append(await remote_ask_rate(server_nc, client_nc, total, workers))
                    later.append(
                        await remote_ask_rate(server_nc, client_nc, total, workers, EchoLater)
                    )
                raw_m, ours_m = statistics.median(raw), statistics.median(ours)
                later_m = statistics.median(later)
                ratio = ours_m / raw_m
                table.add_row(
                    f"remote ask req/s, concurrency {workers}",
                    f"{ours_m:,.0f}",
                    f"{raw_m:,.0f}",
                    f"{ratio:.0%}",
                    "✓ >= 70%" if ratio >= 0.7 else "✗ < 70%",
                )
                table.add_row(
                    f"  answered later, concurrency {workers}",
                    f"{later_m:,.0f}",
                    f"{raw_m:,.0f}",
                    f"{later_m / raw_m:.0%}",
                    "-",
                )
        finally:
            await client_nc.close()
            await server_nc.close()
    console.print(table)
    return [table]
