"""A consumer process that journals every delivery: one line `<topic> <Nats-Msg-Id>` each.

Usage: python -m tests.peers.journal_consumer NATS_URLS JOURNAL [--topics t0,t1] [--group G]
       [--replicas R]

One durable `Consumer` per topic, all in group G. A line is written (and flushed) before the
handler returns, so before the ack: a delivery that is journaled may be delivered again, one
that is acked is journaled. Runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TextIO

from txactors.consumer import ConsumedMessage, Consumer
from txactors.nats.client import connect

READY_LINE = "JOURNAL CONSUMER READY"


async def main(args: argparse.Namespace, out: TextIO) -> None:
    nc = await connect(args.urls.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    stopping = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping.set)

    async def handle(message: ConsumedMessage) -> None:
        out.write(f"{message.topic} {message.msg_id}\n")
        out.flush()

    async with AsyncExitStack() as stack:
        for topic in args.topics.split(","):
            await stack.enter_async_context(
                Consumer(nc, topic, args.group, handle, replicas=args.replicas)
            )
        print(READY_LINE, flush=True)
        await stopping.wait()
    await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("urls")
    parser.add_argument("journal")
    parser.add_argument("--topics", default="orders")
    parser.add_argument("--group", default="audit")
    parser.add_argument("--replicas", type=int, default=1)
    arguments = parser.parse_args()
    with Path(arguments.journal).open("a") as journal_file:
        asyncio.run(main(arguments, journal_file))
