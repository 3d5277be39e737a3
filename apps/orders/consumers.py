"""The three consumer groups of `order.paid`, each changing only its own database, once.

Each group's change runs inside `Database.apply_once`, so the message id and the change
commit together: a redelivery (a lost ack, a consumer killed mid-apply) changes nothing.
The tables deliberately have no uniqueness that would hide a double apply (a second
shipment row, points added twice, a cart emptied twice): reconciliation must be able to
see one if idempotency ever failed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from apps.common.db import Database, Tx
from apps.common.faults import LostAck
from apps.orders.events import CART, LOGISTICS, POINTS, OrderItem, OrderPaid, points_for
from txactors.consumer import ConsumedMessage

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


Apply = Callable[[Tx, OrderPaid, str], Awaitable[None]]
APPLY: Mapping[str, Apply] = {LOGISTICS: create_shipment, POINTS: add_points, CART: clear_cart}


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
    there to be killed.
    """

    group: str
    db: Database
    lose_first_ack: Collection[str] = ()
    mid_apply: MidApply | None = None
    applied: int = 0
    absorbed: int = 0
    _acks_lost: set[str] = field(default_factory=set)

    @property
    def acks_lost(self) -> int:
        """Applied deliveries whose ack was lost on purpose (`lose_first_ack`)."""
        return len(self._acks_lost)

    async def __call__(self, message: ConsumedMessage) -> None:
        event = message.decode(OrderPaid)
        apply = APPLY[self.group]

        async def work(tx: Tx) -> None:
            await apply(tx, event, message.msg_id)
            if self.mid_apply is not None:
                await self.mid_apply(message)

        if await self.db.apply_once(self.group, message.msg_id, work):
            self.applied += 1
        else:
            self.absorbed += 1
        if event.order_id in self.lose_first_ack and event.order_id not in self._acks_lost:
            self._acks_lost.add(event.order_id)
            raise LostAck(f"{self.group}: ack of {event.order_id} lost (injected)")


async def create_schema(group: str, db: Database) -> None:
    await db.script(SCHEMAS[group])
