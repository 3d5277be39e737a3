"""What travels between the order service, its three consumer groups, and the next hop.

One place for the topic, the tag, the group names and the event body, so the producer, the
consumers, the child processes and the reconciliation cannot disagree about them.
"""

from __future__ import annotations

from typing import Final

import msgspec

TOPIC: Final = "orders"
PAID_TAG: Final = "paid"
PRODUCER_GROUP: Final = "order-service"
"""The producer group: every instance of the order service answers its check-backs."""
LOGISTICS: Final = "logistics"
POINTS: Final = "points"
CART: Final = "cart"
CONSUMER_GROUPS: Final = (LOGISTICS, POINTS, CART)
ORDERS_DB: Final = "orders"
"""The order service's own database, next to one per consumer group."""
SHIPMENTS_TOPIC: Final = "shipments"
BOOKED_TAG: Final = "booked"
"""`shipment.booked`: sent by logistics' handler, in its own transaction, as it books one."""
NOTIFICATIONS: Final = "notifications"
"""The group told of each booked shipment (one hop after logistics); its own database."""
ALL_GROUPS: Final = (*CONSUMER_GROUPS, NOTIFICATIONS)


class OrderItem(msgspec.Struct, frozen=True):
    sku: str
    quantity: int
    price_cents: int


class OrderPaid(msgspec.Struct, frozen=True, kw_only=True):
    """`order.paid`: everything a consumer needs, so none of them reads the order database."""

    order_id: str
    user_id: str
    amount_cents: int
    items: list[OrderItem]
    paid_at: float
    """When the payment attempt began (epoch seconds); the checker judges its age by it."""


def points_for(amount_cents: int) -> int:
    """Loyalty points earned by a payment: one per whole unit of currency."""
    return amount_cents // 100


class ShipmentBooked(msgspec.Struct, frozen=True, kw_only=True):
    """`shipment.booked`: logistics booked the shipment of a paid order."""

    order_id: str
    user_id: str
    quantity: int
