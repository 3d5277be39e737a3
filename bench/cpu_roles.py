"""The client roles of `bench cpu`, each in a process of its own (run under callgrind).

`python -m bench.cpu_roles ROLE URL TOPIC WARMUP COUNT CONCURRENCY`, ROLE one of `ROLES`.
The parent talks to a role through lines, so it can switch the counting on around exactly the
measured work:

- a producer sends WARMUP messages (first calls, lazy set-up, the streams' first writes), prints
  `ready`, waits for a `go` line, sends COUNT more with CONCURRENCY in flight and prints `done`;
- a consumer prints `ready` once subscribed, `warm` after WARMUP messages and `done` after
  WARMUP + COUNT;

then each waits for stdin to close and leaves (callgrind writes its count on exit).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable

import anyio
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, Header

from bench.raw import publish_acked
from bench.transactions import BODY_SIZE, CONCURRENCY
from bench.workers import run_workers
from txactors.actors.loop import run_anyio
from txactors.consumer import ConsumedMessage, Consumer
from txactors.nats.client import connect as txactors_connect
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.wire import layout

BODY = b"x" * BODY_SIZE
PARTITIONS = 2
"""As in `bench transactions`: one coordinator process serving two partitions."""
SLOW = 3600.0
"""Seconds: every timeout of a role, so that running ~50x slower under callgrind never
turns into a retry or a redelivery (which would count work that a normal run does not do)."""
SLOWDOWN = 20
"""About how much slower a role runs under callgrind here: the clock-driven settings the
benchmark can set (the coordinator's tick, the consumer's pull expiry) are stretched by it,
so that what they cost per transaction is about what it is in a normal run."""
CONSUMER_CONCURRENCY = max(CONCURRENCY)
"""The txactors consumer's handlers in flight, and the raw consumer's fetch batch."""


def say(line: str) -> None:
    print(line, flush=True)


async def read_line() -> str:
    return await anyio.to_thread.run_sync(sys.stdin.readline)


async def produce(
    send: Callable[[int], Awaitable[None]], warmup: int, count: int, concurrency: int
) -> None:
    """`send(i)` for the warm-up, then, after `go`, for the measured `count`."""
    await run_workers(warmup, min(warmup, concurrency), lambda i: send(i))
    say("ready")
    if (await read_line()).strip() != "go":
        raise RuntimeError("expected go")
    await run_workers(count, concurrency, lambda i: send(warmup + i))
    say("done")


async def tx_producer(nc: Client, topic: str, warmup: int, count: int, concurrency: int) -> None:
    async with TransactionProducer(
        nc,
        "bench",
        lambda view: Decision.COMMIT,
        partitions=PARTITIONS,
        request_timeout=SLOW,
        check_timeout=SLOW,
    ) as producer:

        async def send(i: int) -> None:
            result = await producer.send_in_transaction(
                TxMessage(topic, BODY), lambda message, arg: Decision.COMMIT
            )
            if result.state != "committed":
                raise RuntimeError(f"transaction {i} not committed: {result}")

        await produce(send, warmup, count, concurrency)


async def raw_producer(nc: Client, topic: str, warmup: int, count: int, concurrency: int) -> None:
    await ensure_topic_stream(nc.jetstream(), topic)
    subject = layout.topic_subject(topic)
    await publish_acked(nc, subject, BODY, range(warmup), min(warmup, concurrency))
    say("ready")
    if (await read_line()).strip() != "go":
        raise RuntimeError("expected go")
    await publish_acked(nc, subject, BODY, range(warmup, warmup + count), concurrency)
    say("done")


class Progress:
    """Says `warm` after the warm-up's messages and `done` after all of them."""

    def __init__(self, warmup: int, count: int) -> None:
        self.warmup, self.total, self.seen = warmup, warmup + count, 0

    def saw(self) -> None:
        self.seen += 1
        if self.seen == self.warmup:
            say("warm")
        if self.seen == self.total:
            say("done")


async def tx_consumer(nc: Client, topic: str, warmup: int, count: int, concurrency: int) -> None:
    progress = Progress(warmup, count)

    async def handle(message: ConsumedMessage) -> None:
        progress.saw()

    async with Consumer(
        nc,
        topic,
        "bench",
        handle,
        concurrency=CONSUMER_CONCURRENCY,
        ack_wait=SLOW,
        pull_expires=1.0 * SLOWDOWN,  # the default, stretched
    ):
        say("ready")
        await read_line()  # until stdin closes


async def raw_consumer(nc: Client, topic: str, warmup: int, count: int, concurrency: int) -> None:
    """The least a JetStream pull consumer does per message: pull requests of a batch of 64
    (lasting `SLOWDOWN` seconds, as the txactors consumer's), each message acked as it comes,
    the next pull once a batch is delivered or has expired. (nats-py's `fetch` probes with
    `no_wait` first and gathers what happens to be there, so what it costs per message
    depends on the timing: not repeatable.)"""
    js = nc.jetstream()
    stream = await ensure_topic_stream(js, topic)
    await js.add_consumer(
        stream,
        ConsumerConfig(
            durable_name="raw",
            ack_policy=AckPolicy.EXPLICIT,
            filter_subject=layout.topic_filter(topic),
            ack_wait=SLOW,
        ),
    )
    inbox = nc.new_inbox()
    next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.raw"
    request = json.dumps({"batch": CONSUMER_CONCURRENCY, "expires": int(SLOWDOWN * 1e9)})
    progress = Progress(warmup, count)
    left = 0

    async def pull() -> None:
        nonlocal left
        left = CONSUMER_CONCURRENCY
        await nc.publish(next_subject, request.encode(), reply=inbox)

    async def delivered(message: Msg) -> None:
        nonlocal left
        if message.headers and Header.STATUS in message.headers:  # the pull expired
            await pull()
            return
        await message.ack()
        progress.saw()
        left -= 1
        if not left:
            await pull()

    await nc.subscribe(inbox, cb=delivered)
    await pull()
    say("ready")
    await read_line()  # until stdin closes


ROLES = {
    "txproducer": tx_producer,
    "txconsumer": tx_consumer,
    "rawproducer": raw_producer,
    "rawconsumer": raw_consumer,
}


async def run(role: str, url: str, topic: str, warmup: int, count: int, concurrency: int) -> None:
    # The txactors consumer on the client a deployed one runs on (`nats_session`'s).
    nc = await (txactors_connect(url) if role == "txconsumer" else nats.connect(url))
    try:
        await ROLES[role](nc, topic, warmup, count, concurrency)
        if role.endswith("producer"):
            await read_line()  # until stdin closes
    finally:
        await nc.close()


def main() -> None:
    configure_logging("ERROR")
    role, url, topic, warmup, count, concurrency = sys.argv[1:]
    run_anyio(run, role, url, topic, int(warmup), int(count), int(concurrency))


if __name__ == "__main__":
    main()
