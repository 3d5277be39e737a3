"""The order service: create orders, pay them, and answer check-backs from its own database.

Paying is the transactional message: the `order.paid` half is stored first, then ONE local
transaction marks the order paid (and charges it), then the end commits the message. If the
process dies in between, the coordinator asks any live instance of the group, and `check`
answers from the order's status.

Why a `payments` row per attempt: "unpaid and old → ROLLBACK" is only safe if an attempt
still running cannot commit after the checker said so. The local transaction and the
checker's rollback both insert the attempt's row (keyed by txid); whichever is first wins,
so a late local commit fails instead of paying an order whose message was rolled back.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from apps.common.db import Database, Tx
from apps.orders.events import PAID_TAG, TOPIC, OrderItem, OrderPaid
from txactors.errors import PrepareFailed
from txactors.producer import CheckView, Decision, Transaction, TransactionProducer, TxMessage

UNPAID = "unpaid"
PAID = "paid"
ABORTED = "aborted"

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, "
    "amount_cents BIGINT NOT NULL, status TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
    "paid_txid TEXT, paid_at DOUBLE PRECISION)",
    "CREATE TABLE IF NOT EXISTS order_items (order_id TEXT NOT NULL, sku TEXT NOT NULL, "
    "quantity BIGINT NOT NULL, price_cents BIGINT NOT NULL, PRIMARY KEY (order_id, sku))",
    "CREATE TABLE IF NOT EXISTS payments (txid TEXT PRIMARY KEY, order_id TEXT NOT NULL, "
    "state TEXT NOT NULL, at DOUBLE PRECISION NOT NULL)",
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
    """One instance of the order service: its database, and its transactional producer.

    `decide_after` is how old an unpaid attempt must be before a check-back rolls it back
    (younger ones answer UNKNOWN: the local transaction may still be running).
    """

    def __init__(
        self,
        db: Database,
        producer: TransactionProducer | None = None,
        *,
        charge: Charge = accept_all,
        decide_after: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self._producer = producer
        self._charge = charge
        self._decide_after = decide_after
        self._clock = clock

    def attach(self, producer: TransactionProducer) -> None:
        """The producer is created with `self.check` as its checker, so it comes second."""
        self._producer = producer

    async def create_schema(self) -> None:
        await self.db.script(SCHEMA)

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

        Returns the txid. Raises `UnknownOrder` or `AlreadyPaid` before anything is sent, and
        `PaymentDeclined` (after rolling the message back) when the charge fails.
        """
        txn, event = await self.prepare_payment(order_id)
        async with txn:
            await self.record_payment(txn.txid, event)
        return txn.txid

    async def prepare_payment(self, order_id: str) -> tuple[Transaction, OrderPaid]:
        """Check the order can be paid and store the `order.paid` half; the caller ends it."""
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
        txn = self._producer.begin()
        try:
            await txn.send(TxMessage(TOPIC, event, keys=[order_id], tag=PAID_TAG))
        except PrepareFailed:
            await txn.rollback()  # halves may exist: the check-back learns it from memory
            raise
        return txn, event

    async def record_payment(self, txid: str, event: OrderPaid) -> None:
        """The local transaction: claim the attempt, mark the order paid, charge it."""
        async with self.db.transaction() as tx:
            if not await _claim(tx, txid, event.order_id, PAID, self._clock()):
                raise PaymentAborted(
                    f"payment {txid} of order {event.order_id!r} was rolled back by a "
                    "check-back before it committed; pay again"
                )
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

    async def check(self, view: CheckView) -> Decision:
        """The check-back: paid by this attempt → COMMIT; else UNKNOWN while it is young,
        and ROLLBACK (fencing the attempt off) once it is older than `decide_after`."""
        event = view.messages[0].decode(OrderPaid)
        if await self._paid_by(view.txid, event.order_id):
            return Decision.COMMIT
        if self._clock() - event.paid_at < self._decide_after:
            return Decision.UNKNOWN
        async with self.db.transaction() as tx:
            await _claim(tx, view.txid, event.order_id, ABORTED, self._clock())
            rows = await tx.fetch("SELECT state FROM payments WHERE txid = ?", view.txid)
        return Decision.COMMIT if rows[0][0] == PAID else Decision.ROLLBACK

    async def _paid_by(self, txid: str, order_id: str) -> bool:
        rows = await self.db.fetch(
            "SELECT status, paid_txid FROM orders WHERE order_id = ?", order_id
        )
        return bool(rows) and rows[0] == (PAID, txid)


async def _claim(tx: Tx, txid: str, order_id: str, state: str, now: float) -> bool:
    """Insert the attempt's row with `state`; False when it was already decided."""
    return (
        await tx.execute(
            "INSERT INTO payments (txid, order_id, state, at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            txid,
            order_id,
            state,
            now,
        )
        == 1
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
