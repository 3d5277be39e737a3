"""The three consumer groups of `order.paid`, each changing only its own database, once,
and the hop after logistics: `shipment.booked`, applied once by notifications.

Each group's change runs inside `Database.apply_once`, so the message id and the change
commit together: a redelivery (a lost ack, a consumer killed mid-apply) changes nothing.
Logistics' handler also sends (`txactors.apply_and_send`, on its database's transaction
log): the apply record, the shipment and the log row of its `shipment.booked` commit in one
local transaction, and the message is published if and only if they did.
The tables deliberately have no uniqueness that would hide a double apply (a second
shipment row, points added twice, a cart emptied twice): reconciliation must be able to
see one if idempotency ever failed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from apps.common.db import Database, Tx
from apps.common.faults import LostAck
from apps.orders.events import (
    BOOKED_TAG,
    CART,
    LOGISTICS,
    NOTIFICATIONS,
    POINTS,
    SHIPMENTS_TOPIC,
    OrderItem,
    OrderPaid,
    ShipmentBooked,
    points_for,
)
from txactors import Outbox, TransactionProducer, TxMessage, apply_and_send
from txactors.consumer import ConsumedMessage
from txactors.producer.txlog import TxLog

SCHEMAS: Mapping[str, Sequence[str]] = {
    LOGISTICS: (
        "CREATE TABLE IF NOT EXISTS shipments (order_id TEXT NOT NULL, user_id TEXT NOT NULL, "
        "quantity BIGINT NOT NULL, msg_id TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL)",
    ),
    POINTS: (
        "CREATE TABLE IF NOT EXISTS user_points (user_id TEXT PRIMARY KEY, points BIGINT NOT NULL)",
    ),
    CART: (
        "CREATE TABLE IF NOT EXISTS cart_items (user_id TEXT NOT NULL, sku TEXT NOT NULL, "
        "quantity BIGINT NOT NULL, PRIMARY KEY (user_id, sku))",
    ),
    NOTIFICATIONS: (
        "CREATE TABLE IF NOT EXISTS notifications (order_id TEXT NOT NULL, "
        "user_id TEXT NOT NULL, msg_id TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL)",
    ),
}


async def create_shipment(tx: Tx, event: OrderPaid, msg_id: str) -> None:
    await tx.execute(
        "INSERT INTO shipments (order_id, user_id, quantity, msg_id, created_at) "
        "VALUES (?, ?, ?, ?, ?)",
        event.order_id,
        event.user_id,
        sum(item.quantity for item in event.items),
        msg_id,
        time.time(),
    )


async def add_points(tx: Tx, event: OrderPaid, msg_id: str) -> None:
    await tx.execute(
        "INSERT INTO user_points (user_id, points) VALUES (?, ?) "
        "ON CONFLICT (user_id) DO UPDATE SET points = user_points.points + excluded.points",
        event.user_id,
        points_for(event.amount_cents),
    )


async def clear_cart(tx: Tx, event: OrderPaid, msg_id: str) -> None:
    """Take what was bought out of the user's cart (what is left was not bought yet)."""
    for item in event.items:
        await tx.execute(
            "UPDATE cart_items SET quantity = quantity - ? WHERE user_id = ? AND sku = ?",
            item.quantity,
            event.user_id,
            item.sku,
        )


async def notify(tx: Tx, event: ShipmentBooked, msg_id: str) -> None:
    """Tell the user their order is on its way (here: a row per notice sent)."""
    await tx.execute(
        "INSERT INTO notifications (order_id, user_id, msg_id, created_at) VALUES (?, ?, ?, ?)",
        event.order_id,
        event.user_id,
        msg_id,
        time.time(),
    )


def booked(event: OrderPaid) -> TxMessage:
    """The `shipment.booked` logistics sends for a shipment it books."""
    quantity = sum(item.quantity for item in event.items)
    body = ShipmentBooked(order_id=event.order_id, user_id=event.user_id, quantity=quantity)
    return TxMessage(
        SHIPMENTS_TOPIC, msgspec.msgpack.encode(body), tag=BOOKED_TAG, keys=[event.order_id]
    )


Apply = Callable[[Tx, Any, str], Awaitable[None]]
APPLY: Mapping[str, Apply] = {
    LOGISTICS: create_shipment,
    POINTS: add_points,
    CART: clear_cart,
    NOTIFICATIONS: notify,
}
EVENT: Mapping[str, type[OrderPaid] | type[ShipmentBooked]] = {NOTIFICATIONS: ShipmentBooked}
"""What a group's messages carry: `order.paid` unless named here."""
Chain = tuple[TxLog[Any], TransactionProducer]
"""The log and the producer a group's handler sends with (logistics)."""


async def open_chain_log(db: Database) -> TxLog[Any]:
    """Logistics' transaction log, in its own database, with the table of applied inputs."""
    txlog = await db.open_txlog(LOGISTICS)
    await txlog.create_applied_table()
    return txlog


async def add_to_cart(db: Database, user_id: str, items: Sequence[OrderItem]) -> None:
    """The shopper fills the cart (before ordering); the cart group empties it on payment."""
    async with db.transaction() as tx:
        for item in items:
            await tx.execute(
                "INSERT INTO cart_items (user_id, sku, quantity) VALUES (?, ?, ?) "
                "ON CONFLICT (user_id, sku) DO UPDATE "
                "SET quantity = cart_items.quantity + excluded.quantity",
                user_id,
                item.sku,
                item.quantity,
            )


MidApply = Callable[[ConsumedMessage], Awaitable[None]]


@dataclass
class GroupHandler:
    """The consumer handler of one group.

    `lose_first_ack` names orders whose first handled delivery raises `LostAck` after applying, a
    duplicate delivery the idempotent apply must absorb. `mid_apply` runs inside the local
    transaction, after the change and before the commit: the consumer-crash fault waits
    there to be killed. With `chain` (logistics), the handler also sends `shipment.booked`
    in that transaction (`apply_and_send`); `mid_apply` then runs with its prepare out.
    """

    group: str
    db: Database
    lose_first_ack: Collection[str] = ()
    mid_apply: MidApply | None = None
    chain: Chain | None = None
    applied: int = 0
    absorbed: int = 0
    _acks_lost: set[str] = field(default_factory=set)

    @property
    def acks_lost(self) -> int:
        """Applied deliveries whose ack was lost on purpose (`lose_first_ack`)."""
        return len(self._acks_lost)

    async def __call__(self, message: ConsumedMessage) -> None:
        event = message.decode(EVENT.get(self.group, OrderPaid))
        apply = APPLY[self.group]

        async def work(tx: Tx) -> None:
            await apply(tx, event, message.msg_id)
            if self.mid_apply is not None:
                await self.mid_apply(message)

        async def work_and_send(conn: Any, out: Outbox[Any]) -> None:
            assert isinstance(event, OrderPaid)  # only logistics sends
            await apply(self.db.tx(conn), event, message.msg_id)
            await out.send(booked(event))
            if self.mid_apply is not None:
                await out.stored()  # killed there, its halves wait for their check-back
                await self.mid_apply(message)

        if self.chain is not None:
            txlog, producer = self.chain
            applied = await apply_and_send(txlog, producer, self.group, message, work_and_send)
        else:
            applied = await self.db.apply_once(self.group, message.msg_id, work)
        if applied:
            self.applied += 1
        else:
            self.absorbed += 1
        if event.order_id in self.lose_first_ack and event.order_id not in self._acks_lost:
            self._acks_lost.add(event.order_id)
            raise LostAck(f"{self.group}: ack of {event.order_id} lost (injected)")


async def create_schema(group: str, db: Database) -> None:
    await db.script(SCHEMAS[group])
