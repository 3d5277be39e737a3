"""One bank of the transfer demo, its books (SQLite) on the power-cut disk.

Usage: python -m tests.peers.powercut_bank sender DB_DIR {load|answer} SEED
       python -m tests.peers.powercut_bank receiver DB_DIR

NATS comes from NATS_URL. Each bank seeds its accounts on its first start. `sender` is
alipay's transfer service (apps.transfer's `Sender`, its transaction log in alipay's
database on the same disk): `load` runs random transfers until killed, `answer` only
answers check-backs (from the log). `receiver` is yuebao's consumer (`Receiver`),
crediting each transfer once. The books are kept durably (WAL, synchronous=FULL): set
here for the banks' connections, not taken from apps/, so this test says what it relies
on; alipay's debits commit on its transaction log's connection, which txactors makes as
durable (under test too). Prints READY once it serves.
"""

from __future__ import annotations

import random
import sys
import time
import uuid
from pathlib import Path

import aiosqlite
import anyio

from apps.common.db import SqliteDatabase
from apps.transfer.bank import ALIPAY, YUEBAO, Bank, TransferRefused
from apps.transfer.demo import Timing
from apps.transfer.messages import SENDER_GROUP, Transfer
from apps.transfer.receiver import Receiver
from apps.transfer.sender import Sender
from txactors.nats.connect import nats_session
from txactors.producer import TransactionProducer

ACCOUNTS = 8
OPENING = 1_000_000
CONCURRENCY = 8
SOURCES = [f"a-{i:03}" for i in range(ACCOUNTS)]
TARGETS = [f"b-{i:03}" for i in range(ACCOUNTS)]


async def open_bank(name: str, directory: Path, accounts: list[str]) -> Bank:
    conn = await aiosqlite.connect(directory / f"{name}.db", isolation_level=None, timeout=30)
    await conn.execute("PRAGMA journal_mode=WAL")
    await conn.execute("PRAGMA synchronous=FULL")
    bank = Bank(SqliteDatabase(name, directory / f"{name}.db", conn))
    if not await bank.has_accounts():
        await bank.seed(dict.fromkeys(accounts, OPENING))
    return bank


async def sender(directory: Path, mode: str, seed: int) -> None:
    alipay = await open_bank(ALIPAY, directory, SOURCES)
    service = await Sender.open(alipay)
    async with (
        nats_session() as session,
        TransactionProducer(session.nc, SENDER_GROUP, service.txlog.check) as producer,
    ):
        print("READY", flush=True)
        if mode == "answer":
            await anyio.sleep_forever()

        async def worker(rng: random.Random) -> None:
            while True:
                transfer = Transfer(
                    id=uuid.uuid4().hex,
                    source=rng.choice(SOURCES),
                    target=rng.choice(TARGETS),
                    amount=rng.randint(1, 5_000),
                    created_at=time.time(),
                )
                try:
                    result = await service.transfer(producer, transfer)
                except TransferRefused:
                    continue
                except Exception as error:  # e.g. the coordinator restarting: try the next
                    print("FAILED", type(error).__name__, error, flush=True)
                    await anyio.sleep(0.1)  # the load's pace after a failure
                    continue
                if result.state == "committed":
                    print("COMMITTED", transfer.id, flush=True)

        async with anyio.create_task_group() as tg:
            for index in range(CONCURRENCY):
                tg.start_soon(worker, random.Random(seed * 1000 + index))


async def receiver(directory: Path) -> None:
    yuebao = await open_bank(YUEBAO, directory, TARGETS)
    timing = Timing()
    async with (
        nats_session() as session,
        Receiver(yuebao).consumer(
            session.nc, ack_wait=timing.ack_wait, retry_delays=timing.retry_delays
        ),
    ):
        print("READY", flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    role, directory = sys.argv[1], Path(sys.argv[2])
    if role == "sender":
        anyio.run(sender, directory, sys.argv[3], int(sys.argv[4]))
    else:
        anyio.run(receiver, directory)
