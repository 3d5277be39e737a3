"""The outbox benchmark's consumer: a plain JetStream pull consumer, in a process of its own.

`python -m bench.outbox_consumer URL SUBJECT COUNT`: pulls SUBJECT's stream from its start,
acking; prints `ready` once subscribed, and after COUNT messages one JSON line with the
monotonic time of the last one. The same consumer for every way of getting the message there
(`bench.outbox`; the outbox packages send JSON of their own), so it costs each the same.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import nats
import nats.errors

from txactors.actors.loop import run as run_on_loop

FETCH = 256


async def consume(url: str, subject: str, count: int) -> None:
    nc = await nats.connect(url)
    received = 0
    last = 0.0
    try:
        subscription = await nc.jetstream().pull_subscribe(subject, durable=None)
        print("ready", flush=True)
        while received < count:
            try:
                batch = await subscription.fetch(FETCH, timeout=5)
            except nats.errors.TimeoutError:
                continue
            last = time.monotonic()
            for message in batch:
                await message.ack()
            received += len(batch)
    finally:
        await nc.close()
    print(json.dumps({"last": last}), flush=True)
    await asyncio.to_thread(sys.stdin.read)


def main() -> None:
    run_on_loop(consume(sys.argv[1], sys.argv[2], int(sys.argv[3])))


if __name__ == "__main__":
    main()
