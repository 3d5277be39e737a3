"""The outbox benchmark's consumer: a plain JetStream pull consumer, in a process of its own.

`python -m bench.outbox_consumer URL SUBJECT COUNT`: pulls SUBJECT's stream from its start,
acking; prints `ready` once subscribed, and after COUNT messages one JSON line: each message's

consumed latency (now minus the send time in the body's first 8 bytes, `bench.e2e_consumer`'s
stamp) and the monotonic time of the last one. The same consumer for every way of getting the
message there (`bench.outbox`), so it costs each the same.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import nats
import nats.errors

from bench.e2e_consumer import STAMP

FETCH = 256


async def consume(url: str, subject: str, count: int) -> None:
    nc = await nats.connect(url)
    latencies: list[float] = []
    last = 0.0
    try:
        subscription = await nc.jetstream().pull_subscribe(subject, durable=None)
        print("ready", flush=True)
        while len(latencies) < count:
            try:
                batch = await subscription.fetch(FETCH, timeout=5)
            except nats.errors.TimeoutError:
                continue
            last = time.monotonic()
            for message in batch:
                latencies.append(last - STAMP.unpack_from(message.data)[0])
                await message.ack()
    finally:
        await nc.close()
    print(json.dumps({"latencies": latencies, "last": last}), flush=True)
    await asyncio.to_thread(sys.stdin.read)


def main() -> None:
    asyncio.run(consume(sys.argv[1], sys.argv[2], int(sys.argv[3])))


if __name__ == "__main__":
    main()
