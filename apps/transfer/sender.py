"""Bank A's transfer service: debit the account and announce the transfer, all or nothing.

A transfer is one transactional message and one local transaction: send the half message;
in alipay's database (on PostgreSQL while the half is on its way) debit the source and record
the transfer with the transaction id; once the half is stored, commit (the message reaches
yuebao) or, when the debit is refused (or the half was not stored), roll back (nothing is ever
delivered). The local transaction also records the transaction id in the `alipay` group's
transaction log (`txactors.producer.txlog`, a table in alipay's database). If this
process dies or the end is lost in between, the coordinator asks any live member of the
group, and the log answers (`txlog.check`): the txid recorded, COMMIT; not, the check claims
it rolled back under the same key, so a debit still running can no longer commit.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from apps.transfer.bank import Bank, TransferRefused
from apps.transfer.messages import SENDER_GROUP, TOPIC, Transfer
from txactors.producer import TransactionProducer, TransactionResult, TxMessage
from txactors.producer.txlog import TxLog


async def new_transfer(
    alipay: Bank, yuebao: Bank, source: str, target: str, amount: int
) -> Transfer:
    """A valid transfer of `amount` cents, or TransferRefused saying what is wrong (nothing
    is changed or sent either way)."""
    if amount <= 0:
        raise TransferRefused(f"the amount must be positive, not ¥{amount / 100:,.2f}")
    if source == target:
        raise TransferRefused(f"{source} is on both sides; a transfer needs two accounts")
    if not await alipay.has_account(source):
        raise TransferRefused(f"no account {source!r} in {alipay.name} to send from")
    if not await yuebao.has_account(target):
        raise TransferRefused(f"no account {target!r} in {yuebao.name} to send to")
    return Transfer(
        id=uuid.uuid4().hex, source=source, target=target, amount=amount, created_at=time.time()
    )


class Sender:
    """Runs transfers out of `alipay`; the `alipay` group's transaction log, in alipay's
    database, answers its check-backs: create the producer with `sender.txlog.check`."""

    def __init__(self, alipay: Bank, txlog: TxLog[Any]) -> None:
        self.alipay = alipay
        self.txlog = txlog

    @classmethod
    async def open(cls, alipay: Bank) -> Sender:
        """A sender with the group's log in alipay's database (its table created if
        missing; closed with the database)."""
        return cls(alipay, await alipay.db.open_txlog(SENDER_GROUP))

    @staticmethod
    def message(transfer: Transfer) -> TxMessage:
        return TxMessage(TOPIC, transfer, keys=[transfer.id])

    async def transfer(
        self, producer: TransactionProducer, transfer: Transfer
    ) -> TransactionResult:
        """Debit, record and announce `transfer` (`TxLog.send_in_transaction`). On
        InsufficientFunds, RolledBackByCheck (a check-back decided it first) or any other
        failure of the local transaction the message is rolled back and the error re-raised."""

        async def debit(connection: Any, txid: str) -> None:
            await self.alipay.debit(self.alipay.db.tx(connection), transfer, txid)

        return await self.txlog.send_in_transaction(producer, self.message(transfer), debit)

    async def debit(self, transfer: Transfer, txid: str) -> None:
        """The local transaction alone, for a transaction the caller began and ends (the
        demo's lost-end and producer-crash faults): record `txid` in the log, debit the
        source and record the transfer, committed together. RolledBackByCheck when a
        check-back claimed `txid` first: nothing is debited."""
        async with self.txlog.local() as local:  # left uncommitted, it rolls back
            await self.txlog.record(local.connection, txid)
            await self.alipay.debit(self.alipay.db.tx(local.connection), transfer, txid)
            await local.commit()
