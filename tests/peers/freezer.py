"""Second process for the broker-fault test: freezes nats-server (SIGSTOP) the moment the
first message appears on a subject, so the writes issued around it stay unacknowledged.

A process of its own, because a subscriber sharing the writer's event loop would react only
after that loop had already read most of the acks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import nats


async def main(url: str, subject: str, pid: int) -> None:
    nc = await nats.connect(url)
    seen = asyncio.Event()

    async def freeze(_: object) -> None:
        if not seen.is_set():
            os.kill(pid, signal.SIGSTOP)
            seen.set()

    await nc.subscribe(subject, cb=freeze)
    await nc.flush()
    print("ready", flush=True)
    await seen.wait()
    print("frozen", flush=True)
    os._exit(0)  # the server is frozen: a clean close would hang


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
