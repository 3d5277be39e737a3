"""A producer service that sends with `TxLog.send_in_transaction`, its SQLite database
(business table `ledger` and the transaction log) on the power-cut disk.

Usage: python -m tests.peers.powercut_txlog DB_PATH {load|answer} SETTING SEED

Same contract as tests.peers.powercut_producer (SETTING is ignored: the log makes its own
commits durable): `load` runs transactions until killed, each recording its txid in
`ledger` as its business change, a few failing after their write (rolled back), and
prints `COMMITTED <txid>` for each end the coordinator confirmed as committed; `answer`
only answers check-backs, from the log. Prints READY once it serves.
"""

from __future__ import annotations

import random
import sys

import aiosqlite
import anyio

from tests.peers.powercut_producer import CONCURRENCY, TOPIC
from txactors.nats.connect import nats_session
from txactors.producer import TransactionProducer, TxMessage
from txactors.producer.txlog.sqlite import SqliteTxLog

GROUP = "powercut"


class Refused(Exception):
    """The business rule said no: the local transaction rolls back."""


async def transact(producer: TransactionProducer, txlog: SqliteTxLog, rng: random.Random) -> None:
    refuse = rng.random() < 0.2

    async def work(conn: aiosqlite.Connection, txid: str) -> None:
        await conn.execute("INSERT INTO ledger (txid) VALUES (?)", (txid,))
        if refuse:
            raise Refused

    try:
        result = await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"x"), work)
    except Refused:
        return
    if result.state == "committed":
        print("COMMITTED", result.txid, flush=True)


async def main(path: str, mode: str, setting: str, seed: int) -> None:
    async with SqliteTxLog(path, GROUP, busy_timeout=30) as txlog:
        await txlog.connection.execute("PRAGMA journal_mode=WAL")
        await txlog.create_table()
        await txlog.connection.execute("CREATE TABLE IF NOT EXISTS ledger (txid TEXT PRIMARY KEY)")
        async with (
            nats_session() as session,
            TransactionProducer(session.nc, GROUP, txlog.check) as producer,
        ):
            print("READY", flush=True)
            if mode == "answer":
                await anyio.sleep_forever()

            async def worker(rng: random.Random) -> None:
                while True:
                    try:
                        await transact(producer, txlog, rng)
                    except Exception as error:  # e.g. the coordinator restarting: next
                        print("FAILED", type(error).__name__, error, flush=True)
                        await anyio.sleep(0.1)  # the load's pace after a failure

            async with anyio.create_task_group() as tg:
                for index in range(CONCURRENCY):
                    tg.start_soon(worker, random.Random(seed * 1000 + index))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
