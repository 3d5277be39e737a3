"""Bank A's transfer service: debit the account and announce the transfer, all or nothing.

A transfer is one transactional message and one local transaction: prepare the half message,
then in alipay's database debit the source and record the transfer with the transaction id,
then commit (the message reaches yuebao) or, when the debit is refused, roll back (nothing is
ever delivered). If this process dies or the end is lost in between, the coordinator asks
any live member of the `alipay` group (`Sender.check`), which answers from the database.
"""

from __future__ import annotations

import time
import uuid

from apps.transfer.bank import Bank, TransferRefused
from apps.transfer.messages import TOPIC, Transfer
from txactors.producer import CheckView, Decision, TransactionProducer, TransactionResult, TxMessage


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
    """Runs transfers out of `alipay` and answers the `alipay` group's check-backs.

    `rollback_after` is how long the checker waits for a transfer's local transaction: a
    transfer not recorded that long after it was created is given up (ROLLBACK; younger:
    UNKNOWN, ask again). Giving up claims the transaction id in alipay's database, so a debit
    still running then fails instead of committing (see `Bank.give_up`): the answer stays
    true however slow the local transaction is, and no transfer is refused for being slow.
    """

    def __init__(self, alipay: Bank, *, rollback_after: float) -> None:
        self.alipay = alipay
        self.rollback_after = rollback_after

    @staticmethod
    def message(transfer: Transfer) -> TxMessage:
        return TxMessage(TOPIC, transfer, keys=[transfer.id])

    async def transfer(
        self, producer: TransactionProducer, transfer: Transfer
    ) -> TransactionResult:
        """Debit, record and announce `transfer`; on InsufficientFunds, RolledBackByCheck (or
        any failure of the local transaction) the message is rolled back and the error
        re-raised."""
        async with producer.begin() as txn:
            await txn.send(self.message(transfer))
            await self.debit(transfer, txn.txid)
        assert txn.result is not None  # the block's exit ended it
        return txn.result

    async def debit(self, transfer: Transfer, txid: str) -> None:
        """The local transaction: debit the source and record the transfer under `txid`."""
        async with self.alipay.db.transaction() as tx:
            await self.alipay.debit(tx, transfer, txid)

    async def check(self, view: CheckView) -> Decision:
        """Did transaction `view.txid` commit in alipay? The transfer row says so."""
        if await self.alipay.has_transfer(view.txid):
            return Decision.COMMIT
        transfer = view.messages[0].decode(Transfer)
        if time.time() - transfer.created_at < self.rollback_after:
            return Decision.UNKNOWN  # its local transaction may still be running
        return Decision.COMMIT if await self.alipay.give_up(view.txid) else Decision.ROLLBACK
