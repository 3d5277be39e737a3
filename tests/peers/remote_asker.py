"""Second process for the remote-actor test: asks over NATS and prints what came back."""

from __future__ import annotations

import asyncio
import json
import sys

import nats

from tests.peers.echo_protocol import Add, Greet, Reply
from txactors.actors import RemoteActorRef
from txactors.wire.protocol import Encoding


async def main(url: str, subject: str) -> None:
    nc = await nats.connect(url)
    try:
        ref = RemoteActorRef(nc, subject, Reply)
        total = await ref.ask(Add(2, 40))
        json_ref = RemoteActorRef(nc, subject, Reply, encoding=Encoding.JSON)
        greeting = await json_ref.ask(Greet("other process"))
        print(json.dumps({"sum": total.value, "greeting": greeting.text}))
    finally:
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
