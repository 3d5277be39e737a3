"""Reconciliation: do the consumer groups' databases agree with the order database?

The order database is the truth: an order is paid or it is not. From it alone follows what
every other place must hold, and each check compares that with what is really there:

- topic `orders`: exactly one `order.paid` per paid order, carrying the txid that paid it,
  and none for an unpaid (declined, rolled back) order;
- logistics: exactly one shipment per paid order, none for unpaid ones;
- points: each user's balance is the points of their paid orders;
- cart: each user's cart holds exactly the items of their unpaid orders (every order was
  placed from the cart; paying takes its items out);
- each group applied each message once (its `message_apply` rows).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client
from rich import box
from rich.table import Table

from apps.common.db import Database
from apps.orders.events import CART, LOGISTICS, POINTS, TOPIC, OrderPaid, points_for
from apps.orders.service import PAID
from txactors import layout
from txactors.consumer.idempotent import TABLE as APPLY_TABLE
from txactors.coordinator.recovery import read_subject

SHOWN_PROBLEMS = 5


@dataclass(frozen=True)
class Check:
    """One line of the reconciliation table."""

    name: str
    expected: int
    found: int
    what: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and self.expected == self.found


@dataclass(frozen=True)
class Reconciliation:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def mismatches(self) -> int:
        return sum(len(check.problems) or (not check.ok) for check in self.checks)

    def table(self) -> Table:
        table = Table(title="reconciliation", box=box.SIMPLE_HEAD)
        table.add_column("check")
        table.add_column("counts")
        table.add_column("expected", justify="right")
        table.add_column("found", justify="right")
        table.add_column("result")
        for check in self.checks:
            result = "[green]ok[/]" if check.ok else f"[red]{len(check.problems)} mismatches[/]"
            table.add_row(check.name, check.what, str(check.expected), str(check.found), result)
        return table

    def problems(self) -> list[str]:
        return [
            f"{check.name}: {problem}"
            for check in self.checks
            for problem in check.problems[:SHOWN_PROBLEMS]
        ]


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
    orders_db: Database, group_dbs: Mapping[str, Database], nc: Client
) -> Reconciliation:
    truth = await Truth.read(orders_db)
    checks = [
        await check_topic(nc, truth),
        await check_logistics(group_dbs[LOGISTICS], truth),
        await check_points(group_dbs[POINTS], truth),
        await check_cart(group_dbs[CART], truth),
    ]
    for group, db in group_dbs.items():
        checks.append(await check_applied(group, db, truth))
    return Reconciliation(checks)


async def check_topic(nc: Client, truth: Truth) -> Check:
    js = nc.jetstream()
    seen: Counter[str] = Counter()
    problems = []
    async for msg in read_subject(js, layout.topic_stream(TOPIC), layout.topic_filter(TOPIC), 1):
        event = msgspec.msgpack.decode(msg.data, type=OrderPaid)
        seen[event.order_id] += 1
        txid = (msg.headers or {}).get(layout.TXID_HEADER)
        paid = truth.paid.get(event.order_id)
        if paid is not None and paid[2] != txid:
            problems.append(f"{event.order_id} announced by {txid}, paid by {paid[2]}")
    problems += _exactly_once(seen, truth.paid, "message")
    return Check(f"topic {TOPIC}", len(truth.paid), seen.total(), "order.paid messages", problems)


async def check_logistics(db: Database, truth: Truth) -> Check:
    rows = await db.fetch("SELECT order_id FROM shipments")
    seen = Counter(order for (order,) in rows)
    problems = _exactly_once(seen, truth.paid, "shipment")
    return Check(LOGISTICS, len(truth.paid), seen.total(), "shipments", problems)


async def check_points(db: Database, truth: Truth) -> Check:
    expected: Counter[str] = Counter()
    for user, amount, _ in truth.paid.values():
        expected[user] += points_for(amount)
    found = Counter(
        {
            user: int(points)
            for user, points in await db.fetch("SELECT user_id, points FROM user_points")
        }
    )
    problems = [
        f"{user} has {found[user]} points, expected {expected[user]}"
        for user in sorted(set(expected) | set(found))
        if found[user] != expected[user]
    ]
    return Check(POINTS, expected.total(), found.total(), "points", problems)


async def check_cart(db: Database, truth: Truth) -> Check:
    expected: Counter[tuple[str, str]] = Counter()
    for order, user, sku, quantity in truth.items:
        if order not in truth.paid:
            expected[user, sku] += quantity
    rows = await db.fetch("SELECT user_id, sku, quantity FROM cart_items")
    found = Counter({(user, sku): int(quantity) for user, sku, quantity in rows})
    problems = [
        f"{user}'s cart holds {found[user, sku]} x {sku}, expected {expected[user, sku]}"
        for user, sku in sorted(set(expected) | set(found))
        if found[user, sku] != expected[user, sku]
    ]
    return Check(CART, expected.total(), found.total(), "items left in carts", problems)


async def check_applied(group: str, db: Database, truth: Truth) -> Check:
    applied = 0
    if await _has_table(db, APPLY_TABLE):  # created by the first apply
        rows = await db.fetch(f"SELECT COUNT(*) FROM {APPLY_TABLE} WHERE consumer_group = ?", group)
        applied = int(rows[0][0])
    problems = [] if applied == len(truth.paid) else [f"{applied} messages applied"]
    return Check(f"{group} applied", len(truth.paid), applied, "messages applied once", problems)


async def _has_table(db: Database, name: str) -> bool:
    if db.kind == "sqlite":
        sql = "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?"
    else:
        sql = "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = ?"
    return bool(await db.fetchval(sql, name))


def _exactly_once(seen: Counter[str], paid: Mapping[str, object], thing: str) -> list[str]:
    problems = [f"paid order {order} has no {thing}" for order in sorted(paid) if not seen[order]]
    problems += [f"order {order} has {n} {thing}s" for order, n in sorted(seen.items()) if n > 1]
    problems += [
        f"unpaid order {order} has a {thing}" for order in sorted(seen) if order not in paid
    ]
    return problems
