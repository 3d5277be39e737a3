"""A service whose handler sends (`apply_and_send`), in a process a test can kill.

Usage: python -m tests.peers.chained_handler NATS_URL BACKEND DB_DIR GROUP

BACKEND is a name of tests.support.txlogs (its database: a SQLite file in DB_DIR, or the test
servers). GROUP is both the consumer group reading INPUT and the producer group of its log.
Each handling writes the business row of its outgoing txid (`Backend.write`) and sends one
message to OUTPUT whose body is the input's id, then prints `HANDLED <msg_id> <delivery>
<applied>`. With TXACTORS_FAULT set (txactors.faults) it dies at that step of its first
handling; else it runs until killed. Its consumer's ack wait is ACK_WAIT seconds, so a
redelivery after a crash comes soon.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import nats

from tests.support.txlogs import backend
from txactors import ConsumedMessage, Consumer, TransactionProducer, TxMessage, apply_and_send
from txactors.app.chain import Outbox

INPUT = "orders"
OUTPUT = "shipments"
ACK_WAIT = 2.0


async def main(url: str, backend_name: str, directory: str, group: str) -> None:
    db = backend(backend_name, Path(directory))
    nc = await nats.connect(url)
    try:
        txlog = await db.instance(group)
        await txlog.create_applied_table()

        async def handle(message: ConsumedMessage) -> None:
            async def work(conn: Any, out: Outbox[Any]) -> None:
                await db.write(conn, out.txid)
                await out.send(TxMessage(OUTPUT, message.msg_id.encode()))

            applied = await apply_and_send(txlog, producer, group, message, work)
            print("HANDLED", message.msg_id, message.deliveries, applied, flush=True)

        async with (
            TransactionProducer(nc, group, txlog.check) as producer,
            Consumer(nc, INPUT, group, handle, ack_wait=ACK_WAIT, retry_delays=[0.2]),
        ):
            print("READY", flush=True)
            await anyio.sleep_forever()
    finally:
        await db.close()
        await nc.close()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:5])
