"""A producer process that dies by SIGKILL between prepare and end.

Usage: python -m tests.peers.dying_producer NATS_URL MARKER_FILE {0|1}
With 1 its local transaction commits first (it writes MARKER_FILE, standing in for the
database commit); with 0 it dies before committing anything. Prints `TXID <txid>` first.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import anyio
import nats

from txactors.producer import Decision, TransactionProducer, TxMessage


async def main(url: str, marker: Path, commit_locally: bool) -> None:
    nc = await nats.connect(url)
    async with TransactionProducer(nc, "bank", lambda view: Decision.UNKNOWN) as producer:
        txn = producer.begin()
        await txn.send(TxMessage("transfers", b"100"))
        print("TXID", txn.txid, flush=True)
        if commit_locally:
            await anyio.Path(marker).write_text("committed")
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"))
