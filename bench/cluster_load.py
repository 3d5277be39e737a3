"""A load process of `bench cluster`, run in the producers' namespace.

`python -m bench.cluster_load KIND URL TOPIC IN_FLIGHT PARTITIONS WARMUP`, KIND one of:

- `tx`: a `TransactionProducer` (acked end, on the client a deployed producer uses) with
  IN_FLIGHT tasks, each sending one transaction of one 128-byte message after another
  (`send_in_transaction`, a trivial local transaction, COMMIT);
- `raw`: acked JetStream publishes of the same message to TOPIC's stream (made by the
  parent), IN_FLIGHT awaiting their acks, each with its own `Nats-Msg-Id` (as
  `bench.raw.publish_acked`).

It loads for WARMUP seconds (not measured), prints `ready`, waits for a `go SECONDS` line,
loads for SECONDS (what was started in time is finished), prints one JSON line (`count`
done, `seconds` from go to the last one done, each one's `latencies` in seconds), and leaves
when its stdin closes.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
from nats.aio.client import Client

from bench.transactions import BODY_SIZE
from txactors.actors.loop import run_anyio
from txactors.nats.client import connect
from txactors.observe.logs import configure_logging
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.wire import layout

BODY = b"x" * BODY_SIZE
KINDS = ("tx", "raw")


class Window:
    """One phase of load: what finished, and how long each took."""

    def __init__(self, seconds: float) -> None:
        self.started = time.monotonic()
        self.until = self.started + seconds
        self.latencies: list[float] = []
        self.last = self.started

    def open(self) -> bool:
        return time.monotonic() < self.until

    def done(self, sent: float) -> None:
        self.last = time.monotonic()
        self.latencies.append(self.last - sent)

    def result(self) -> dict[str, Any]:
        return {
            "count": len(self.latencies),
            "seconds": self.last - self.started,
            "latencies": [round(x, 6) for x in self.latencies],
        }


Load = Callable[[Window], Awaitable[None]]


def tx_load(producer: TransactionProducer, topic: str, in_flight: int) -> Load:
    async def load(window: Window) -> None:
        async def worker() -> None:
            while window.open():
                sent = time.monotonic()
                result = await producer.send_in_transaction(
                    TxMessage(topic, BODY), lambda m, a: Decision.COMMIT
                )
                if result.state != "committed":
                    raise RuntimeError(f"transaction not committed: {result}")
                window.done(sent)

        async with anyio.create_task_group() as tg:
            for _ in range(in_flight):
                tg.start_soon(worker)

    return load


def raw_load(nc: Client, topic: str, in_flight: int) -> Load:
    js = nc.jetstream(publish_async_max_pending=in_flight)
    subject = layout.topic_subject(topic)
    numbers = iter(range(1 << 62))
    me = os.getpid()

    async def load(window: Window) -> None:
        pending: collections.deque[tuple[float, Any]] = collections.deque()
        while window.open():
            if len(pending) >= in_flight:
                sent, future = pending.popleft()
                await future
                window.done(sent)
            future = await js.publish_async(
                subject, BODY, headers={"Nats-Msg-Id": f"{me}-{next(numbers)}"}
            )
            pending.append((time.monotonic(), future))
        while pending:
            sent, future = pending.popleft()
            await future
            window.done(sent)

    return load


async def read_line() -> str:
    return await anyio.to_thread.run_sync(sys.stdin.readline)


async def run(
    kind: str, url: str, topic: str, in_flight: int, partitions: int, warmup: float
) -> None:
    nc = await (connect([url]) if kind == "tx" else nats.connect(url))
    try:
        async with contextlib.AsyncExitStack() as stack:
            if kind == "tx":
                producer = await stack.enter_async_context(
                    TransactionProducer(
                        nc, "bench", lambda v: Decision.COMMIT, partitions=partitions
                    )
                )
                load = tx_load(producer, topic, in_flight)
            else:
                load = raw_load(nc, topic, in_flight)
            await measured(load, warmup)
    finally:
        await nc.close()


async def measured(load: Load, warmup: float) -> None:
    """The warm-up, then the measured window the parent starts."""
    await load(Window(warmup))
    print("ready", flush=True)
    words = (await read_line()).split()
    if words[:1] != ["go"]:
        raise RuntimeError(f"expected `go SECONDS`, got {words}")
    window = Window(float(words[1]))
    await load(window)
    print(json.dumps(window.result()), flush=True)
    await read_line()  # until stdin closes


def main() -> None:
    configure_logging("ERROR")
    kind, url, topic, in_flight, partitions, warmup = sys.argv[1:]
    if kind not in KINDS:
        raise SystemExit(f"KIND must be one of {KINDS}, got {kind!r}")
    run_anyio(run, kind, url, topic, int(in_flight), int(partitions), float(warmup))


if __name__ == "__main__":
    main()
