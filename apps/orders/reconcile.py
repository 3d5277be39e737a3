"""Reconciliation: do the topic and the consumer groups' databases agree with the orders?

The order database is the truth: an order is paid (by one transaction) or it is not. From it
alone follows what every other place must hold, and each check counts what is really there:

- topic `orders`: exactly one `order.paid` per paid order, carrying the txid that paid it,
  and none for an unpaid (declined, rolled back) order;
- logistics: exactly one shipment per paid order, none for unpaid ones;
- points: each user's balance is the points of their paid orders;
- cart: each user's cart holds exactly the items of their unpaid orders (every order was
  placed from the cart; paying takes its items out);
- topic `shipments`: exactly one `shipment.booked` per paid order, sent by logistics'
  handler in the transaction that booked it, none for an unpaid one;
- notifications: exactly one notice per paid order, none for unpaid ones;
- each group applied as many messages as there are paid orders (its `message_apply` rows;
  logistics, whose handler sends, in `txactors_applied`).

A demo adds what it intended (`Expectation`s: which orders must end paid, which never) and
the common pipeline rows (nothing open, unhandled or dead-lettered); how its payments ended
and what its faults did are tallies, reported but never a mismatch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client

from apps.common.db import Database
from apps.common.drain import pipeline_checks
from apps.common.report import Check, Reconciliation, Tally
from apps.orders.events import (
    CART,
    LOGISTICS,
    NOTIFICATIONS,
    POINTS,
    PRODUCER_GROUP,
    SHIPMENTS_TOPIC,
    TOPIC,
    OrderPaid,
    ShipmentBooked,
    points_for,
)
from apps.orders.service import PAID
from txactors.consumer.idempotent import TABLE as APPLY_TABLE
from txactors.coordinator.partition.recovery import read_subject
from txactors.producer.txlog.schema import APPLIED_TABLE
from txactors.wire import layout

APP = "orders"


@dataclass(frozen=True, slots=True)
class Expectation:
    """Orders `ids` (one way their payment went) must all end paid and announced, or all
    unpaid and never announced."""

    scenario: str
    ids: Sequence[str]
    paid: bool


@dataclass(frozen=True)
class Truth:
    """What the order database says: paid orders (with their txid) and every order's items."""

    paid: dict[str, tuple[str, int, str]]  # order_id -> (user_id, amount_cents, txid)
    items: list[tuple[str, str, str, int]]  # (order_id, user_id, sku, quantity)

    @classmethod
    async def read(cls, orders_db: Database) -> Truth:
        paid = await orders_db.fetch(
            "SELECT order_id, user_id, amount_cents, paid_txid FROM orders WHERE status = ?", PAID
        )
        items = await orders_db.fetch(
            "SELECT o.order_id, o.user_id, i.sku, i.quantity FROM orders o "
            "JOIN order_items i ON i.order_id = o.order_id"
        )
        return cls(
            paid={order: (user, int(amount), txid) for order, user, amount, txid in paid},
            items=[(order, user, sku, int(quantity)) for order, user, sku, quantity in items],
        )


async def reconcile(
    orders_db: Database,
    group_dbs: Mapping[str, Database],
    nc: Client,
    *,
    expectations: Sequence[Expectation] = (),
    tallies: Sequence[Tally] = (),
) -> Reconciliation:
    truth = await Truth.read(orders_db)
    announced = await read_topic(nc)
    booked = await read_bookings(nc)
    checks = [
        *check_topic(announced, truth),
        *await check_logistics(group_dbs[LOGISTICS], truth),
        *await check_points(group_dbs[POINTS], truth),
        *await check_cart(group_dbs[CART], truth),
        *check_bookings(booked, truth),
        *await check_notifications(group_dbs[NOTIFICATIONS], truth),
    ]
    for group, db in group_dbs.items():
        checks.append(await check_applied(group, db, truth))
    checks += check_scenarios(expectations, announced, truth)
    topics = [(SHIPMENTS_TOPIC if group == NOTIFICATIONS else TOPIC, group) for group in group_dbs]
    checks += await pipeline_checks(nc, [PRODUCER_GROUP, LOGISTICS], topics)
    return Reconciliation(app=APP, checks=checks, tallies=[*tallies])


async def read_topic(nc: Client) -> dict[str, list[str | None]]:
    """The txid of every `order.paid` on the topic, by order id."""
    announced: dict[str, list[str | None]] = {}
    js = nc.jetstream()
    async for msg in read_subject(js, layout.topic_stream(TOPIC), layout.topic_filter(TOPIC), 1):
        event = msgspec.msgpack.decode(msg.data, type=OrderPaid)
        announced.setdefault(event.order_id, []).append((msg.headers or {}).get(layout.TXID_HEADER))
    return announced


async def read_bookings(nc: Client) -> Counter[str]:
    """How many `shipment.booked` are on their topic, by order id."""
    booked: Counter[str] = Counter()
    js = nc.jetstream()
    stream, subjects = layout.topic_stream(SHIPMENTS_TOPIC), layout.topic_filter(SHIPMENTS_TOPIC)
    async for msg in read_subject(js, stream, subjects, 1):
        booked[msgspec.msgpack.decode(msg.data, type=ShipmentBooked).order_id] += 1
    return booked


def check_bookings(booked: Counter[str], truth: Truth) -> list[Check]:
    section = f"topic {SHIPMENTS_TOPIC}"
    return [
        Check(
            section=section,
            name="paid orders' shipments booked once (sent by logistics' handler)",
            expected=len(truth.paid),
            actual=sum(booked[order] == 1 for order in truth.paid),
        ),
        *_never_twice_never_unpaid(section, "booked", booked, truth),
    ]


async def check_notifications(db: Database, truth: Truth) -> list[Check]:
    notified = Counter(order for (order,) in await db.fetch("SELECT order_id FROM notifications"))
    return [
        Check(
            section=NOTIFICATIONS,
            name="paid orders notified once",
            expected=len(truth.paid),
            actual=sum(notified[order] == 1 for order in truth.paid),
        ),
        *_never_twice_never_unpaid(NOTIFICATIONS, "notified", notified, truth),
    ]


def check_topic(announced: Mapping[str, list[str | None]], truth: Truth) -> list[Check]:
    section = f"topic {TOPIC}"
    return [
        Check(
            section=section,
            name="paid orders announced once, by the txid that paid them",
            expected=len(truth.paid),
            actual=sum(
                announced.get(order) == [txid] for order, (_, _, txid) in truth.paid.items()
            ),
        ),
        *_never_twice_never_unpaid(
            section, "announced", Counter({o: len(t) for o, t in announced.items()}), truth
        ),
    ]


async def check_logistics(db: Database, truth: Truth) -> list[Check]:
    rows = await db.fetch("SELECT order_id FROM shipments")
    shipped = Counter(order for (order,) in rows)
    return [
        Check(
            section=LOGISTICS,
            name="paid orders shipped once",
            expected=len(truth.paid),
            actual=sum(shipped[order] == 1 for order in truth.paid),
        ),
        *_never_twice_never_unpaid(LOGISTICS, "shipped", shipped, truth),
    ]


async def check_points(db: Database, truth: Truth) -> list[Check]:
    expected: Counter[str] = Counter()
    for user, amount, _ in truth.paid.values():
        expected[user] += points_for(amount)
    rows = await db.fetch("SELECT user_id, points FROM user_points")
    found = Counter({user: int(points) for user, points in rows})
    users = set(expected) | set(found)
    return [
        Check(
            section=POINTS,
            name="users whose points are those of their paid orders",
            expected=len(users),
            actual=sum(found[user] == expected[user] for user in users),
        ),
        Check(
            section=POINTS,
            name="points of all users",
            expected=expected.total(),
            actual=found.total(),
        ),
    ]


async def check_cart(db: Database, truth: Truth) -> list[Check]:
    expected: Counter[tuple[str, str]] = Counter()
    for order, user, sku, quantity in truth.items:
        if order not in truth.paid:
            expected[user, sku] += quantity
    rows = await db.fetch("SELECT user_id, sku, quantity FROM cart_items")
    found = Counter({(user, sku): int(quantity) for user, sku, quantity in rows})
    lines = set(expected) | set(found)
    return [
        Check(
            section=CART,
            name="cart lines holding their unpaid orders' items",
            expected=len(lines),
            actual=sum(found[line] == expected[line] for line in lines),
        ),
        Check(
            section=CART,
            name="items left in carts",
            expected=expected.total(),
            actual=found.total(),
        ),
    ]


async def check_applied(group: str, db: Database, truth: Truth) -> Check:
    applied = 0
    table = APPLIED_TABLE if group == LOGISTICS else APPLY_TABLE  # logistics' handler sends
    if await _has_table(db, table):  # created by the first apply
        rows = await db.fetch(f"SELECT COUNT(*) FROM {table} WHERE consumer_group = ?", group)
        applied = int(rows[0][0])
    return Check(
        section="exactly once",
        name=f"{group}: messages applied (one per paid order)",
        expected=len(truth.paid),
        actual=applied,
    )


def check_scenarios(
    expectations: Sequence[Expectation],
    announced: Mapping[str, list[str | None]],
    truth: Truth,
) -> list[Check]:
    checks = []
    for expectation in expectations:
        if expectation.paid:
            name, expected = "paid, announced once", len(expectation.ids)
            actual = sum(
                order in truth.paid and len(announced.get(order, ())) == 1
                for order in expectation.ids
            )
        else:
            name, expected = "unpaid, orders paid or announced", 0  # none may be
            actual = sum(order in truth.paid or order in announced for order in expectation.ids)
        checks.append(
            Check(
                section="scenarios",
                name=f"{expectation.scenario}: {name}",
                expected=expected,
                actual=actual,
            )
        )
    return checks


def _never_twice_never_unpaid(
    section: str, done: str, seen: Counter[str], truth: Truth
) -> list[Check]:
    return [
        Check(
            section=section,
            name=f"{done} twice or more",
            expected=0,
            actual=sum(n > 1 for n in seen.values()),
        ),
        Check(
            section=section,
            name=f"{done}, never paid (declined / rolled back)",
            expected=0,
            actual=sum(order not in truth.paid for order in seen),
        ),
    ]


async def _has_table(db: Database, name: str) -> bool:
    if db.kind == "sqlite":
        sql = "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?"
    else:
        sql = "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = ?"
    return bool(await db.fetchval(sql, name))
