"""The benchmark's consumer, in a process of its own as a deployment would run it.

`python -m bench.e2e_consumer URL TOPIC COUNT`: runs txactors' `Consumer` on TOPIC, prints
`ready` once it is subscribed, and after COUNT messages one JSON line: each message's consumed
latency (now minus the send time the producer wrote into the body's first 8 bytes, both on
the machine-wide monotonic clock) and the monotonic time of the last one. It then waits for
stdin to close, so the parent can read its CPU time while it is still alive.
"""

from __future__ import annotations

import json
import struct
import sys
import time

import anyio
import nats

from bench.deployed import CONSUMER_CONNECTION
from txactors.consumer import ConsumedMessage, Consumer
from txactors.observe.logs import configure_logging

STAMP = struct.Struct("<d")
"""The send time (`time.monotonic()`) at the start of each benchmark body."""


async def consume(url: str, topic: str, count: int) -> None:
    latencies: list[float] = []
    all_in = anyio.Event()
    last = 0.0

    async def handle(message: ConsumedMessage) -> None:
        nonlocal last
        last = time.monotonic()
        latencies.append(last - STAMP.unpack_from(message.body)[0])
        if len(latencies) == count:
            all_in.set()

    nc = await nats.connect(url, name=CONSUMER_CONNECTION)
    try:
        async with Consumer(nc, topic, "bench", handle, concurrency=64):
            print("ready", flush=True)
            await all_in.wait()
    finally:
        await nc.close()
    print(json.dumps({"latencies": latencies, "last": last}), flush=True)
    await anyio.to_thread.run_sync(sys.stdin.read)


def main() -> None:
    configure_logging("INFO")
    url, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    anyio.run(consume, url, topic, count)


if __name__ == "__main__":
    main()
