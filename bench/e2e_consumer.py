"""The benchmark's consumer, in a process of its own as a deployment would run it.

`python -m bench.e2e_consumer URL TOPIC COUNT [raw]`: runs txactors' `Consumer` on TOPIC (with
`raw`: a plain nats-py pull consumer, fetch `RAW_FETCH`, ack each, as `bench wire` reads its
baseline), prints `ready` once it is subscribed, and after COUNT messages one JSON line: each
message's consumed latency (now minus the send time the producer wrote into the body's first
8 bytes, both on the machine-wide monotonic clock) and the monotonic time of the last one. It
then waits for stdin to close, so the parent can read its CPU time while it is still alive.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Callable

import anyio
import nats
import nats.errors
from nats.aio.client import Client

from bench.deployed import CONSUMER_CONNECTION
from txactors.actors.loop import run_anyio
from txactors.consumer import ConsumedMessage, Consumer
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.wire import layout

STAMP = struct.Struct("<d")
"""The send time (`time.monotonic()`) at the start of each benchmark body."""
RAW_FETCH = 64
"""Messages per fetch of the raw pull consumer: the transactions' concurrency."""


async def consume(url: str, topic: str, count: int, raw: bool) -> None:
    latencies: list[float] = []
    all_in = anyio.Event()
    last = 0.0

    def received(body: bytes) -> None:
        nonlocal last
        last = time.monotonic()
        latencies.append(last - STAMP.unpack_from(body)[0])
        if len(latencies) == count:
            all_in.set()

    async def handle(message: ConsumedMessage) -> None:
        received(message.body)

    nc = await nats.connect(url, name=CONSUMER_CONNECTION)
    try:
        if raw:
            await pull_raw(nc, topic, count, received)
        else:
            async with Consumer(nc, topic, "bench", handle, concurrency=64):
                print("ready", flush=True)
                await all_in.wait()
    finally:
        await nc.close()
    print(json.dumps({"latencies": latencies, "last": last}), flush=True)
    await anyio.to_thread.run_sync(sys.stdin.read)


async def pull_raw(nc: Client, topic: str, count: int, received: Callable[[bytes], None]) -> None:
    """What a user's own consumer of raw publishes does: a durable pull consumer on the
    topic's stream, `RAW_FETCH` at a time, each message acked."""
    js = nc.jetstream()
    await ensure_topic_stream(js, topic)
    sub = await js.pull_subscribe(
        layout.topic_filter(topic), "bench-raw", stream=layout.topic_stream(topic)
    )
    print("ready", flush=True)
    seen = 0
    while seen < count:
        try:
            batch = await sub.fetch(min(RAW_FETCH, count - seen), timeout=1)
        except nats.errors.TimeoutError:
            continue
        for msg in batch:
            received(msg.data)
            await msg.ack()
            seen += 1
    await nc.flush()


def main() -> None:
    configure_logging("INFO")
    url, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    raw = sys.argv[4:] == ["raw"]
    run_anyio(consume, url, topic, count, raw)


if __name__ == "__main__":
    main()
