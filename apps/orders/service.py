"""The order service: create orders, pay them, and answer check-backs from its own database.

Paying is the transactional message, sent with the order-service group's transaction log
(`txactors.producer.txlog`, in the orders database): the `order.paid` half is stored first,
then ONE local transaction records the attempt's txid in the log, marks the order paid and
charges it, then the end commits the message. If the process dies in between, the
coordinator asks any live instance of the group, and the log answers (`txlog.check`): the
txid recorded, COMMIT; not, the check claims it rolled back, so an attempt still running
can no longer commit and pay an order whose message was rolled back.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from apps.common.db import Database, Tx
from apps.orders.events import PAID_TAG, PRODUCER_GROUP, TOPIC, OrderItem, OrderPaid
from txactors.errors import PrepareFailed, RolledBackByCheck
from txactors.producer import Transaction, TransactionProducer, TxMessage
from txactors.producer.txlog import TxLog

UNPAID = "unpaid"
PAID = "paid"

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, "
    "amount_cents BIGINT NOT NULL, status TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
    "paid_txid TEXT, paid_at DOUBLE PRECISION)",
    "CREATE TABLE IF NOT EXISTS order_items (order_id TEXT NOT NULL, sku TEXT NOT NULL, "
    "quantity BIGINT NOT NULL, price_cents BIGINT NOT NULL, PRIMARY KEY (order_id, sku))",
)


class OrderError(Exception):
    """A request the order service refuses; nothing was changed."""


class InvalidOrder(OrderError):
    pass


class UnknownOrder(OrderError):
    pass


class AlreadyPaid(OrderError):
    pass


class PaymentDeclined(OrderError):
    pass


class PaymentAborted(OrderError):
    """The check-back already rolled this attempt back (it took too long); pay again."""


Charge = Callable[[OrderPaid], Awaitable[None]]
"""The payment gateway: returns when the charge went through, raises `PaymentDeclined`."""


async def accept_all(event: OrderPaid) -> None:
    """A gateway that never declines."""


class Order(msgspec.Struct, frozen=True, kw_only=True):
    order_id: str
    user_id: str
    amount_cents: int
    status: str
    items: list[OrderItem]


class OrderService:
    """One instance of the order service: its database, its transaction log and its
    transactional producer (whose checker is the log's: `txlog.check`)."""

    def __init__(
        self,
        db: Database,
        producer: TransactionProducer | None = None,
        *,
        charge: Charge = accept_all,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self._producer = producer
        self._charge = charge
        self._clock = clock
        self._txlog: TxLog[Any] | None = None

    def attach(self, producer: TransactionProducer) -> None:
        """The producer is created with `self.txlog.check` as its checker, so it comes
        second."""
        self._producer = producer

    async def create_schema(self) -> None:
        await self.db.script(SCHEMA)
        await self.open_txlog()

    async def open_txlog(self) -> TxLog[Any]:
        """The group's transaction log in the orders database (done by `create_schema`)."""
        if self._txlog is None:
            self._txlog = await self.db.open_txlog(PRODUCER_GROUP)
        return self._txlog

    @property
    def txlog(self) -> TxLog[Any]:
        if self._txlog is None:
            raise RuntimeError("open_txlog() (or create_schema()) before paying or checking")
        return self._txlog

    # -- orders ------------------------------------------------------------------------------

    async def create_order(self, order_id: str, user_id: str, items: Sequence[OrderItem]) -> Order:
        """Store a new unpaid order; `InvalidOrder` for an empty cart, bad items or a reused id."""
        _validate(order_id, user_id, items)
        amount = sum(item.quantity * item.price_cents for item in items)
        async with self.db.transaction() as tx:
            inserted = await tx.execute(
                "INSERT INTO orders (order_id, user_id, amount_cents, status, created_at) "
                "VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                order_id,
                user_id,
                amount,
                UNPAID,
                self._clock(),
            )
            if not inserted:
                raise InvalidOrder(f"order {order_id!r} already exists")
            for item in items:
                await tx.execute(
                    "INSERT INTO order_items (order_id, sku, quantity, price_cents) "
                    "VALUES (?, ?, ?, ?)",
                    order_id,
                    item.sku,
                    item.quantity,
                    item.price_cents,
                )
        return Order(
            order_id=order_id, user_id=user_id, amount_cents=amount, status=UNPAID, items=[*items]
        )

    async def get_order(self, order_id: str) -> Order:
        rows = await self.db.fetch(
            "SELECT user_id, amount_cents, status FROM orders WHERE order_id = ?", order_id
        )
        if not rows:
            raise UnknownOrder(f"there is no order {order_id!r}")
        user_id, amount, status = rows[0]
        items = await self.db.fetch(
            "SELECT sku, quantity, price_cents FROM order_items WHERE order_id = ? ORDER BY sku",
            order_id,
        )
        return Order(
            order_id=order_id,
            user_id=user_id,
            amount_cents=int(amount),
            status=status,
            items=[OrderItem(sku, int(q), int(p)) for sku, q, p in items],
        )

    # -- paying ------------------------------------------------------------------------------

    async def pay_order(self, order_id: str) -> str:
        """Pay: the order becomes paid and `order.paid` is delivered, or neither happens.

        Returns the txid. Raises `UnknownOrder` or `AlreadyPaid` before anything is sent,
        `PaymentDeclined` (after rolling the message back) when the charge fails, and
        `PaymentAborted` when a check-back rolled the attempt back first.
        """
        producer, event = await self._payable(order_id)

        async def mark_paid(connection: Any, txid: str) -> None:
            await self._mark_paid(self.db.tx(connection), txid, event)

        try:
            result = await self.txlog.send_in_transaction(producer, _message(event), mark_paid)
        except RolledBackByCheck as error:
            raise _aborted(order_id) from error
        return result.txid

    async def prepare_payment(self, order_id: str) -> tuple[Transaction, OrderPaid]:
        """Check the order can be paid and store the `order.paid` half; the caller runs
        `record_payment` and ends it (step by step, for the demo's faults)."""
        producer, event = await self._payable(order_id)
        txn = producer.begin()
        try:
            await txn.send(_message(event))
        except PrepareFailed:
            await txn.rollback()  # halves may exist: the check-back learns it from memory
            raise
        return txn, event

    async def record_payment(self, txid: str, event: OrderPaid) -> None:
        """The local transaction: record `txid` in the log, mark the order paid, charge it."""
        async with self.db.transaction() as tx:
            try:
                await self.txlog.record(tx.connection, txid)
            except RolledBackByCheck as error:
                raise _aborted(event.order_id) from error
            await self._mark_paid(tx, txid, event)

    async def _payable(self, order_id: str) -> tuple[TransactionProducer, OrderPaid]:
        if self._producer is None:
            raise RuntimeError("this OrderService has no producer; attach() one to pay")
        order = await self.get_order(order_id)
        if order.status == PAID:
            raise AlreadyPaid(f"order {order_id!r} is already paid")
        event = OrderPaid(
            order_id=order.order_id,
            user_id=order.user_id,
            amount_cents=order.amount_cents,
            items=order.items,
            paid_at=self._clock(),
        )
        return self._producer, event

    async def _mark_paid(self, tx: Tx, txid: str, event: OrderPaid) -> None:
        updated = await tx.execute(
            "UPDATE orders SET status = ?, paid_txid = ?, paid_at = ? "
            "WHERE order_id = ? AND status = ?",
            PAID,
            txid,
            event.paid_at,
            event.order_id,
            UNPAID,
        )
        if not updated:
            raise AlreadyPaid(f"order {event.order_id!r} is already paid")
        await self._charge(event)


def _message(event: OrderPaid) -> TxMessage:
    return TxMessage(TOPIC, event, keys=[event.order_id], tag=PAID_TAG)


def _aborted(order_id: str) -> PaymentAborted:
    return PaymentAborted(
        f"a payment of order {order_id!r} was rolled back by a check-back before it "
        "committed; pay again"
    )


def _validate(order_id: str, user_id: str, items: Sequence[OrderItem]) -> None:
    if not order_id or not user_id:
        raise InvalidOrder("an order needs an order id and a user id")
    if not items:
        raise InvalidOrder(f"order {order_id!r} has an empty cart: add items before ordering")
    skus = [item.sku for item in items]
    if len(set(skus)) != len(skus) or not all(skus):
        raise InvalidOrder(f"order {order_id!r}: every item needs a distinct, non-empty sku")
    for item in items:
        if item.quantity <= 0:
            raise InvalidOrder(f"order {order_id!r}: quantity of {item.sku} must be positive")
        if item.price_cents < 0:
            raise InvalidOrder(
                f"order {order_id!r}: negative amount ({item.price_cents} cents for {item.sku})"
            )
    if sum(item.quantity * item.price_cents for item in items) <= 0:
        raise InvalidOrder(f"order {order_id!r}: the amount must be positive")
