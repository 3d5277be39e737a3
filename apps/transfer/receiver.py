"""Bank B's side: credit each transfer exactly once, however often it is delivered.

The consumer delivers at least once. The credit and the message-apply record (txactors'
`apply_once`) are one local transaction in yuebao's database, so a redelivery, whether after
a lost ack or after a consumer process died mid-apply, finds the record and changes nothing,
or finds no record because the interrupted transaction never committed, and applies it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from nats.aio.client import Client

from apps.common.db import Tx
from apps.common.faults import LostAck
from apps.transfer.bank import Bank
from apps.transfer.messages import RECEIVER_GROUP, TOPIC, Transfer
from txactors.consumer import ConsumedMessage, Consumer


class Receiver:
    """The `yuebao` group's handler. `lose_ack_for` (transfer ids) and `mid_apply` inject
    faults: the first makes those transfers come twice, the second runs inside the open
    database transaction after the credit (a crash there must leave no trace)."""

    def __init__(
        self,
        yuebao: Bank,
        *,
        lose_ack_for: Collection[str] = (),
        mid_apply: Callable[[Transfer], Awaitable[None]] | None = None,
    ) -> None:
        self.yuebao = yuebao
        self._lose_ack_for = lose_ack_for
        self._mid_apply = mid_apply
        self.applied = 0
        self.duplicates = 0
        """Deliveries of a message already applied: absorbed, nothing changed."""
        self.acks_lost = 0
        """Applied deliveries whose ack was lost on purpose (`lose_ack_for`)."""

    async def handle(self, message: ConsumedMessage) -> None:
        transfer = message.decode(Transfer)

        async def credit(tx: Tx) -> None:
            await self.yuebao.credit(tx, transfer, message.msg_id)
            if self._mid_apply is not None:
                await self._mid_apply(transfer)

        if not await self.yuebao.db.apply_once(RECEIVER_GROUP, message.msg_id, credit):
            self.duplicates += 1
            return
        self.applied += 1
        if transfer.id in self._lose_ack_for:
            self.acks_lost += 1
            raise LostAck(f"transfer {transfer.id} applied; its ack is lost on purpose")

    def consumer(self, nc: Client, **options: Any) -> Consumer:
        """The group's consumer on `transfers`; `options` go to `Consumer`."""
        return Consumer(nc, TOPIC, RECEIVER_GROUP, self.handle, **options)
