"""A producer service whose ledger (SQLite) lives on the power-cut disk.

Usage: python -m tests.peers.powercut_producer DB_PATH {load|answer} {durable|lazy} SEED

NATS comes from NATS_URL. Each transaction sends one message on `powercut` and, unless it
rolls back, records its txid in the ledger as its local transaction; it ends with COMMIT,
ROLLBACK or UNKNOWN (the check-back then asks the ledger). `load` runs transactions until
killed, printing `COMMITTED <txid>` for each end the coordinator confirmed as committed;
`answer` only answers check-backs. Prints READY once it serves. `durable` keeps the ledger
durably (rollback journal with synchronous=EXTRA: FULL does not sync the
journal's deletion that commits), `lazy` as SQLite's common
fast setting (WAL, synchronous=NORMAL).
"""

from __future__ import annotations

import random
import sys
import time

import aiosqlite
import anyio
import msgspec

from txactors.nats.connect import nats_session
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage

TOPIC = "powercut"
ROLLBACK_AFTER = 2.0
"""A transaction not in the ledger this long after it began never will be: the local
transaction refuses to commit past half of it, so the checker's ROLLBACK stays right."""
CONCURRENCY = 8
PRAGMAS = {
    "durable": ("PRAGMA journal_mode=DELETE", "PRAGMA synchronous=EXTRA"),
    "lazy": ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL"),
}


class Born(msgspec.Struct):
    at: float


class Ledger:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn
        self._lock = anyio.Lock()

    @classmethod
    async def open(cls, path: str, setting: str) -> Ledger:
        conn = await aiosqlite.connect(path, isolation_level=None)
        for pragma in PRAGMAS[setting]:
            await conn.execute(pragma)
        await conn.execute("CREATE TABLE IF NOT EXISTS ledger (txid TEXT PRIMARY KEY)")
        return cls(conn)

    async def record(self, txid: str, born: float) -> bool:
        """The local transaction; False when it is too late to commit it."""
        async with self._lock:
            await self._conn.execute("BEGIN IMMEDIATE")
            await self._conn.execute("INSERT INTO ledger (txid) VALUES (?)", (txid,))
            if time.time() - born > ROLLBACK_AFTER / 2:
                await self._conn.rollback()
                return False
            await self._conn.commit()
            return True

    async def has(self, txid: str) -> bool:
        async with self._lock:
            cursor = await self._conn.execute("SELECT 1 FROM ledger WHERE txid = ?", (txid,))
            return await cursor.fetchone() is not None


async def transact(producer: TransactionProducer, ledger: Ledger, rng: random.Random) -> None:
    kind = rng.choices(["commit", "rollback", "unknown"], weights=[6, 2, 2])[0]
    born = time.time()
    txn = producer.begin()
    await txn.send(TxMessage(TOPIC, Born(born), keys=[txn.txid]))
    if kind == "rollback":
        await txn.rollback()
        return
    recorded = (
        await ledger.record(txn.txid, born) if kind == "commit" or rng.random() < 0.7 else False
    )
    if kind == "unknown" or not recorded:
        await txn.leave_unknown()  # the check-back asks the ledger
        return
    result = await txn.commit()
    if result.state == "committed":
        print("COMMITTED", txn.txid, flush=True)


async def main(path: str, mode: str, setting: str, seed: int) -> None:
    ledger = await Ledger.open(path, setting)

    async def check(view: CheckView) -> Decision:
        if await ledger.has(view.txid):
            return Decision.COMMIT
        born = view.messages[0].decode(Born).at
        return Decision.UNKNOWN if time.time() - born < ROLLBACK_AFTER else Decision.ROLLBACK

    async with (
        nats_session() as session,
        TransactionProducer(session.nc, "powercut", check) as producer,
    ):
        print("READY", flush=True)
        if mode == "answer":
            await anyio.sleep_forever()

        async def worker(rng: random.Random) -> None:
            while True:
                try:
                    await transact(producer, ledger, rng)
                except Exception as error:  # e.g. the coordinator restarting: try the next
                    print("FAILED", type(error).__name__, error, flush=True)
                    await anyio.sleep(0.1)  # the load's pace after a failure

        async with anyio.create_task_group() as tg:
            for index in range(CONCURRENCY):
                tg.start_soon(worker, random.Random(seed * 1000 + index))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
