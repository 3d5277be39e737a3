"""One instance of a producer service for the chaos test: `TxLog.send_in_transaction` on a
SQLite database (WAL) that every instance of its group shares, as a service's replicas share
their database.

Usage: python -m tests.peers.chaos_producer NATS_URLS DB_PATH GROUP TOPIC SEED

Each worker loops: one transaction whose business change records its txid in `ledger`, one
in five refused by the business rule after its write (rolled back locally). `ledger` is the
truth the test checks the topic against: a txid there was committed locally and must be on
TOPIC exactly once; a txid on TOPIC must be there. A killed instance's transactions in flight
are settled by a check-back its sibling answers from the shared log. On SIGUSR1 the load
stops (`LOAD STOPPED` once every worker is idle) and the instance keeps answering check-backs
until SIGTERM. Prints `READY` once it serves.
"""

from __future__ import annotations

import random
import signal
import sys

import aiosqlite
import anyio

from txactors.nats.client import connect
from txactors.producer import TransactionProducer, TxMessage
from txactors.producer.txlog.sqlite import SqliteTxLog

CONCURRENCY = 4
READY_LINE = "READY"
STOPPED_LINE = "LOAD STOPPED"
REFUSED_SHARE = 0.2
FAILURE_PAUSE = 0.1
"""Seconds a worker waits after a failed transaction, as an application would."""


class Refused(Exception):
    """The business rule said no: the local transaction rolls back."""


async def transact(
    producer: TransactionProducer, txlog: SqliteTxLog, topic: str, rng: random.Random
) -> None:
    refuse = rng.random() < REFUSED_SHARE

    async def work(conn: aiosqlite.Connection, txid: str) -> None:
        await conn.execute("INSERT INTO ledger (txid) VALUES (?)", (txid,))
        if refuse:
            raise Refused

    try:
        await txlog.send_in_transaction(producer, TxMessage(topic, b"x"), work)
    except Refused:
        return


async def main(urls: str, path: str, group: str, topic: str, seed: int) -> None:
    stop_load = anyio.Event()
    nc = await connect(urls.split(","), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    async with SqliteTxLog(path, group, busy_timeout=30) as txlog:
        await txlog.connection.execute("PRAGMA journal_mode=WAL")
        await txlog.create_table()
        await txlog.connection.execute("CREATE TABLE IF NOT EXISTS ledger (txid TEXT PRIMARY KEY)")
        async with TransactionProducer(nc, group, txlog.check) as producer:
            print(READY_LINE, flush=True)

            async def worker(rng: random.Random) -> None:
                while not stop_load.is_set():
                    try:
                        await transact(producer, txlog, topic, rng)
                    except Exception as error:  # a fault under way: the next transaction
                        print("FAILED", type(error).__name__, error, flush=True)
                        await anyio.sleep(FAILURE_PAUSE)

            with anyio.open_signal_receiver(signal.SIGUSR1, signal.SIGTERM) as signals:
                async with anyio.create_task_group() as workers:
                    for index in range(CONCURRENCY):
                        workers.start_soon(worker, random.Random(seed * 1000 + index))
                    received = await anext(aiter(signals))
                    stop_load.set()
                print(STOPPED_LINE, flush=True)
                while received != signal.SIGTERM:  # still answering check-backs
                    received = await anext(aiter(signals))
    await nc.close()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:5], int(sys.argv[5]))
