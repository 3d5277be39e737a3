"""A producer process that sends one transaction with `TxLog.send_in_transaction` and dies.

Usage: python -m tests.peers.txlog_producer NATS_URL BACKEND DB_DIR GROUP {fault|kill}

BACKEND is a name of tests.support.txlogs (its database: a SQLite file in DB_DIR, or the
test servers). The work prints `TXID <txid>` first, then writes the business row. With
`fault`, TXACTORS_FAULT names the step at which it dies (txactors.faults); with `kill` it
prints `WORKING` after its write and waits, so the test can SIGKILL it in the middle of
its local transaction. Prints `DONE <state>` if nothing killed it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import nats

from tests.support.txlogs import backend
from txactors.producer import Decision, TransactionProducer, TxMessage

TOPIC = "txlog-kill"


async def main(url: str, backend_name: str, directory: str, group: str, mode: str) -> None:
    db = backend(backend_name, Path(directory))
    nc = await nats.connect(url)
    try:
        txlog = await db.instance(group)

        async def work(conn: Any, txid: str) -> None:
            print("TXID", txid, flush=True)
            await db.write(conn, txid)
            if mode == "kill":
                print("WORKING", flush=True)
                await anyio.sleep_forever()

        # Its checker is never asked: the transaction is in flight until it dies.
        async with TransactionProducer(nc, group, lambda view: Decision.UNKNOWN) as producer:
            result = await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"paid"), work)
        print("DONE", result.state, flush=True)
    finally:
        await db.close()
        await nc.close()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:6])
