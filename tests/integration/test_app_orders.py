"""The order demo end to end on a real nats-server: no faults, each fault, SQLite and PostgreSQL.

Every run ends with the reconciliation of apps/orders/reconcile.py: the three consumer
groups' databases must agree exactly with the order database. The PostgreSQL runs need the
server on 127.0.0.1:5432 (TXACTORS_TEST_PG_DSN overrides the DSN); they fail, not skip,
without it. Each test works in schemas of its own, dropped after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from nats.aio.client import Client

from apps.common.db import Database, Storage
from apps.common.faults import Fault, FaultLog
from apps.common.report import RECONCILIATION_TOPIC, Reconciliation
from apps.common.timing import Timing
from apps.orders.consumers import create_schema
from apps.orders.demo import (
    DATABASES,
    DECLINED,
    FENCED,
    PAID,
    DemoReport,
    open_databases,
    payment_tallies,
    run_demo,
)
from apps.orders.events import (
    ALL_GROUPS,
    CONSUMER_GROUPS,
    LOGISTICS,
    ORDERS_DB,
    POINTS,
    OrderItem,
    OrderPaid,
)
from apps.orders.reconcile import reconcile
from apps.orders.service import (
    AlreadyPaid,
    InvalidOrder,
    OrderService,
    PaymentAborted,
    UnknownOrder,
)
from tests.support.txn import FAST, topic_ids, topic_messages
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.producer import CheckView, Decision, MessageView, TransactionProducer, TxMessage

ROOT = Path(__file__).resolve().parents[2]
PG_DSN = os.environ.get("TXACTORS_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")

TIMING = Timing(
    coordinator=CoordinatorConfig(**FAST),
    ack_wait=1.0,
    retry_delays=(0.1, 0.2, 0.5),
    drain_timeout=30.0,
)

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest_asyncio.fixture(params=BACKENDS)
async def storage(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Storage]:
    if request.param == "sqlite":
        yield Storage.sqlite(tmp_path / "db")
        return
    store = Storage.postgres(PG_DSN, prefix=f"t_{uuid.uuid4().hex[:10]}_")
    try:
        yield store
    finally:
        for name in DATABASES:
            await store.drop(name)


def url_of(nc: Client) -> str:
    assert nc.connected_url is not None
    return nc.connected_url.geturl()


async def demo(nc: Client, storage: Storage, *faults: Fault, orders: int = 12) -> DemoReport:
    report = await run_demo(
        nc, url_of(nc), storage, orders=orders, concurrency=4, faults=faults, timing=TIMING
    )
    assert report.reconciliation is not None
    assert report.reconciliation.mismatches == []
    assert report.drained
    assert report.ok
    return report


# -- end to end ---------------------------------------------------------------------------


async def test_every_paid_order_reaches_every_group_once(
    private_nc: Client, storage: Storage
) -> None:
    report = await demo(private_nc, storage)
    assert report.payments == {"paid": 12}
    assert set(report.handlers) == {*CONSUMER_GROUPS, "notifications"}
    for handler in report.handlers.values():
        assert (handler.applied, handler.absorbed) == (12, 0)
    assert len(await topic_ids(private_nc, "orders")) == 12
    assert len(await topic_ids(private_nc, "shipments")) == 12  # the hop: sent by logistics


async def test_declined_payment_is_rolled_back_and_delivers_nothing(
    private_nc: Client, storage: Storage
) -> None:
    report = await demo(private_nc, storage, Fault.LOCAL_FAILURE)
    declined = report.payments["declined (rolled back)"]
    assert declined >= 1
    assert report.payments["paid"] == 12 - declined
    assert len(await topic_ids(private_nc, "orders")) == 12 - declined


async def test_killed_producers_are_settled_by_the_surviving_instance(
    private_nc: Client, storage: Storage
) -> None:
    """One child dies before its local commit (rolled back), one after (committed)."""
    report = await demo(private_nc, storage, Fault.PRODUCER_CRASH)
    assert report.payments["producer killed before its local commit"] == 1
    assert report.payments["producer killed after its local commit"] == 1
    assert len(await topic_ids(private_nc, "orders")) == 11


async def test_lost_end_is_committed_by_the_check_back(
    private_nc: Client, storage: Storage
) -> None:
    report = await demo(private_nc, storage, Fault.LOST_END)
    assert report.payments["end lost"] >= 1
    assert len(await topic_ids(private_nc, "orders")) == 12


async def test_consumer_killed_mid_apply_is_redelivered_and_applied_once(
    private_nc: Client, storage: Storage
) -> None:
    """Logistics' handler is killed with its `shipment.booked` prepared: that transaction is
    rolled back by its check-back, and the redelivery books and sends once."""
    report = await demo(private_nc, storage, Fault.CONSUMER_CRASH)
    assert report.consumer_killed_at is not None
    assert report.handlers[LOGISTICS].applied == 12
    assert report.handlers["notifications"].applied == 12
    assert len(await topic_ids(private_nc, "shipments")) == 12


async def test_duplicate_deliveries_are_absorbed(private_nc: Client, storage: Storage) -> None:
    report = await demo(private_nc, storage, Fault.DUPLICATE)
    for handler in report.handlers.values():
        assert handler.applied == 12
        assert handler.absorbed >= 1


async def test_all_faults_at_once(private_nc: Client, storage: Storage) -> None:
    report = await demo(private_nc, storage, *Fault, orders=30)
    assert sum(report.payments.values()) == 30


async def test_500_payments_at_once_with_every_fault_reconcile_and_say_how_each_ended(
    private_nc: Client, storage: Storage
) -> None:
    """The load a user tries, with the demo's own timing: the verdict is OK and the report
    counts every payment, by how it ended (only the planned faults leave an order unpaid)."""
    report = await run_demo(
        private_nc, url_of(private_nc), storage, orders=500, concurrency=500, faults=Fault
    )
    assert report.reconciliation is not None
    assert report.reconciliation.mismatches == []
    assert report.ok
    ended = {
        tally.name: tally.count
        for tally in report.reconciliation.tallies
        if tally.section == "payments (500)"
    }
    assert sum(ended.values()) == 500
    assert ended["not paid: declined (rolled back)"] == 50
    assert ended["not paid: producer killed before its local commit"] == 1
    assert ended["paid: paid"] >= 400, ended  # nothing else is refused for the load


def test_payments_are_tallied_by_how_they_ended_and_fault_counts_are_no_mismatch() -> None:
    outcomes = {"o1": PAID, "o2": PAID, "o3": DECLINED, "o4": FENCED, "o5": "refused: odd"}
    tallies = payment_tallies(outcomes)
    assert {tally.section for tally in tallies} == {"payments (5)"}
    assert {tally.name: tally.count for tally in tallies} == {
        "paid: paid": 2,
        "not paid: declined (rolled back)": 1,
        f"not paid: {FENCED}": 1,
        "not paid: refused: odd": 1,
    }
    # Fewer redeliveries absorbed than acks lost, no child killed: counted, not checked.
    faults = FaultLog().tallies(frozenset(Fault), acks_lost=30, absorbed=12)
    assert Reconciliation(app="orders", checks=[], tallies=tallies + faults).ok


async def test_reconciliation_sees_a_double_apply(private_nc: Client, storage: Storage) -> None:
    """The checks are not vacuous: one extra shipment and one lost point are both caught."""
    await demo(private_nc, storage, orders=4)
    async with AsyncExitStack() as stack:
        dbs = {name: await storage.open(name) for name in DATABASES}
        for db in dbs.values():
            stack.push_async_callback(db.close)
        await dbs[LOGISTICS].script(
            ["INSERT INTO shipments SELECT * FROM shipments WHERE order_id = 'order-00001'"]
        )
        await dbs[POINTS].script(["UPDATE user_points SET points = points - 1"])
        groups = {g: dbs[g] for g in ALL_GROUPS}
        async with run_coordinator(private_nc, config=CoordinatorConfig(**FAST)):
            result = await reconcile(dbs[ORDERS_DB], groups, private_nc)
    assert not result.ok
    failed = {(check.section, check.name) for check in result.mismatches}
    assert failed == {
        (LOGISTICS, "paid orders shipped once"),
        (LOGISTICS, "shipped twice or more"),
        (POINTS, "users whose points are those of their paid orders"),
        (POINTS, "points of all users"),
    }


async def test_the_reconciliation_is_published(private_nc: Client, storage: Storage) -> None:
    report = await demo(private_nc, storage, orders=3)
    published = await topic_messages(private_nc, RECONCILIATION_TOPIC)
    decoded = [msgspec.msgpack.decode(m.data, type=Reconciliation) for m in published]
    assert decoded == [report.reconciliation]
    assert decoded[0].app == "orders"


async def test_a_rerun_on_the_same_server_starts_clean(
    private_nc: Client, storage: Storage
) -> None:
    """The second run finds the first one's topic, offsets and a transaction it left open;
    it starts clean anyway (another seed: other orders paid)."""
    first = await demo(private_nc, storage, Fault.LOCAL_FAILURE, orders=8)
    async with (
        run_coordinator(private_nc, config=CoordinatorConfig(**FAST)),
        TransactionProducer(private_nc, "order-service", lambda view: Decision.UNKNOWN) as left,
    ):
        txn = left.begin()  # an earlier run's payment, never ended, its process gone
        await txn.send(TxMessage("orders", event("order-00001", at=0.0), tag="paid"))
    second = await run_demo(
        private_nc,
        url_of(private_nc),
        storage,
        orders=8,
        concurrency=4,
        faults=[Fault.LOCAL_FAILURE],
        timing=TIMING,
        seed=2,
    )
    assert second.reconciliation is not None
    assert second.reconciliation.mismatches == [], second.reconciliation.mismatches
    assert second.ok and first.ok
    assert second.outcomes != first.outcomes  # another seed: not the same orders declined
    assert len(await topic_ids(private_nc, "orders")) == second.payments["paid"]


# -- the order service itself -------------------------------------------------------------


ITEMS = [OrderItem("book", 2, 1_250)]


async def test_bad_input_is_refused_and_changes_nothing(
    private_nc: Client, storage: Storage
) -> None:
    async with (
        open_databases(storage) as dbs,
        run_coordinator(private_nc, config=CoordinatorConfig(**FAST)),
    ):
        service = OrderService(dbs[ORDERS_DB])
        await service.create_schema()
        async with TransactionProducer(
            private_nc, "order-service", service.txlog.check
        ) as producer:
            service.attach(producer)
            await service.create_order("o-1", "u-1", ITEMS)
            before = await snapshot(dbs[ORDERS_DB])

            with pytest.raises(InvalidOrder, match="empty cart"):
                await service.create_order("o-2", "u-1", [])
            with pytest.raises(InvalidOrder, match="negative amount"):
                await service.create_order("o-2", "u-1", [OrderItem("mug", 1, -899)])
            with pytest.raises(InvalidOrder, match="quantity"):
                await service.create_order("o-2", "u-1", [OrderItem("mug", 0, 899)])
            with pytest.raises(InvalidOrder, match="already exists"):
                await service.create_order("o-1", "u-2", ITEMS)
            with pytest.raises(UnknownOrder, match="no order 'nope'"):
                await service.pay_order("nope")
            assert await snapshot(dbs[ORDERS_DB]) == before
            assert await topic_ids(private_nc, "orders") == []

            txid = await service.pay_order("o-1")
            paid = await snapshot(dbs[ORDERS_DB])
            with pytest.raises(AlreadyPaid, match="already paid"):
                await service.pay_order("o-1")
            assert await snapshot(dbs[ORDERS_DB]) == paid
            assert await topic_ids(private_nc, "orders") == [f"{txid}:0"]


async def snapshot(db: Database) -> list[tuple[object, ...]]:
    orders = await db.fetch("SELECT * FROM orders ORDER BY order_id")
    items = await db.fetch("SELECT * FROM order_items ORDER BY order_id, sku")
    logged = await db.fetch("SELECT txid, decision FROM txactors_txlog ORDER BY txid")
    return [*orders, *items, *logged]


async def test_check_backs_are_answered_from_the_transaction_log(storage: Storage) -> None:
    """Recorded with the payment → COMMIT; not recorded → ROLLBACK at once, claimed in the
    log, so the late local commit of that attempt is refused and no order is paid without
    its message."""
    async with open_databases(storage) as dbs:
        service = OrderService(dbs[ORDERS_DB])
        await service.create_schema()
        for group in CONSUMER_GROUPS:
            await create_schema(group, dbs[group])
        await service.create_order("o-1", "u-1", ITEMS)
        await service.create_order("o-2", "u-1", ITEMS)
        paid = event("o-1", at=1_000.0)
        await service.record_payment("tx-paid", paid)
        slow = event("o-2", at=1_000.0)

        check = service.txlog.check
        assert await check(view("tx-paid", paid)) is Decision.COMMIT
        assert await check(view("tx-slow", slow)) is Decision.ROLLBACK
        with pytest.raises(PaymentAborted, match="rolled back by a check-back"):
            await service.record_payment("tx-slow", slow)
        assert (await service.get_order("o-2")).status == "unpaid"
        assert await check(view("tx-slow", slow)) is Decision.ROLLBACK
        assert await check(view("tx-paid", paid)) is Decision.COMMIT


def event(order_id: str, *, at: float) -> OrderPaid:
    return OrderPaid(order_id=order_id, user_id="u-1", amount_cents=2_500, items=ITEMS, paid_at=at)


def view(txid: str, paid: OrderPaid) -> CheckView:
    body = msgspec.msgpack.encode(paid)
    message = MessageView(0, "orders", body, (paid.order_id,), "paid", {})
    return CheckView(txid=txid, group="order-service", check_times=0, messages=(message,))


# -- the command ----------------------------------------------------------------------------


def run_command(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    return subprocess.run(
        [sys.executable, "-m", "apps.orders", *args],
        cwd=ROOT,
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_command_runs_the_demo_and_reconciles(tmp_path: Path) -> None:
    args = ("--orders", "6", "--concurrency", "2", "--faults", "none", "--data-dir", str(tmp_path))
    result = run_command(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reconciled: " in result.stdout and ", 0 mismatches" in result.stdout
    assert "MISMATCH" not in result.stdout
    assert "payments (6)" in result.stdout and "paid: paid" in result.stdout
    assert {p.name for p in tmp_path.glob("*.db")} == {f"{name}.db" for name in DATABASES}


def test_the_command_refuses_an_unknown_fault() -> None:
    result = run_command("--faults", "meteor")
    assert result.returncode == 2
    assert "unknown fault 'meteor'" in result.stderr
