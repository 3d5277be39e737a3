"""Child processes the demo SIGKILLs on purpose, to show recovery across real process deaths.

    python -m apps.transfer.crash producer PLAN_JSON STORAGE...
    python -m apps.transfer.crash consumer ACK_WAIT STORAGE...

NATS comes from the environment (the parent sets NATS_URL to its server). `producer` joins
the alipay group, prepares every transfer of the plan (a JSON list of `[Transfer fields,
commit_locally]`), debits and records those marked to commit locally, prints
`PREPARED <id> prepared|debited|fenced` for each (fenced: a check-back claimed its txid
rolled back in the transaction log before the debit recorded it, so it was not debited),
then SIGKILLs itself before any end: only check-backs, answered from the log by a surviving
alipay process, can resolve them.
`consumer` joins the yuebao group with one handler, prints `READY`, and on its first message
prints `APPLYING <id>` and SIGKILLs itself inside the open database transaction, after the
credit and before its commit.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import anyio
import msgspec

from apps.common.db import Storage
from apps.common.faults import kill_self
from apps.transfer.bank import ALIPAY, YUEBAO, Bank
from apps.transfer.messages import SENDER_GROUP, Transfer
from apps.transfer.receiver import Receiver
from apps.transfer.sender import Sender
from txactors.actors.loop import run_anyio
from txactors.errors import RolledBackByCheck
from txactors.nats.connect import nats_session
from txactors.observe.logs import configure_logging
from txactors.producer import TransactionProducer

Plan = list[tuple[dict[str, Any], bool]]


async def crash_producer(plan: Plan, storage: Storage) -> None:
    sender = await Sender.open(Bank(await storage.open(ALIPAY)))
    async with (
        nats_session() as session,
        TransactionProducer(session.nc, SENDER_GROUP, sender.txlog.check) as producer,
    ):

        async def prepare(fields: dict[str, Any], commit_locally: bool) -> None:
            transfer = msgspec.convert({**fields, "created_at": time.time()}, Transfer)
            txn = producer.begin()
            await txn.send(sender.message(transfer))
            outcome = "prepared"
            if commit_locally:
                try:
                    await sender.debit(transfer, txn.txid)
                    outcome = "debited"
                except RolledBackByCheck:  # a check-back decided it first: never debited
                    outcome = "fenced"
            print("PREPARED", transfer.id, outcome, flush=True)

        async with anyio.create_task_group() as tg:
            for fields, commit_locally in plan:
                tg.start_soon(prepare, fields, commit_locally)
        kill_self()


async def crash_consumer(ack_wait: float, storage: Storage) -> None:
    async def die(transfer: Transfer) -> None:
        print("APPLYING", transfer.id, flush=True)
        kill_self()

    yuebao = Bank(await storage.open(YUEBAO))
    receiver = Receiver(yuebao, mid_apply=die)
    async with (
        nats_session() as session,
        receiver.consumer(session.nc, concurrency=1, ack_wait=ack_wait),
    ):
        print("READY", flush=True)
        await anyio.sleep_forever()


def main(argv: list[str]) -> None:
    configure_logging("ERROR")
    role, rest = argv[0], argv[1:]
    if role == "producer":
        plan: Plan = msgspec.json.decode(rest[0])
        run_anyio(crash_producer, plan, Storage.from_args(rest[1:]))
    elif role == "consumer":
        run_anyio(crash_consumer, float(rest[0]), Storage.from_args(rest[1:]))
    else:
        sys.exit(f"unknown role {role!r}; use producer or consumer")


if __name__ == "__main__":
    main(sys.argv[1:])
