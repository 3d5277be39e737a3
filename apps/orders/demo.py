"""The whole order demo in one call: seed, pay with faults, drain, reconcile.

`run_demo` is what `python -m apps.orders` and the tests run. It starts the coordinator,
one order-service producer and the three consumer groups in this process, spawns the
child processes the faults need, and returns the reconciliation (plus how each order's
payment went) once every group has caught up with the order database, or the drain
timeout passed.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio
import nats.js.errors
from nats.aio.client import Client
from rich.progress import Progress

from apps.common.db import Database, Storage
from apps.common.faults import Fault
from apps.orders.child import (
    AFTER_COMMIT,
    BEFORE_COMMIT,
    ChildConfig,
    kill_consumer_mid_apply,
    kill_producer_after_prepare,
)
from apps.orders.consumers import GroupHandler, add_to_cart, create_schema
from apps.orders.events import (
    CART,
    CONSUMER_GROUPS,
    LOGISTICS,
    ORDERS_DB,
    PAID_TAG,
    PRODUCER_GROUP,
    TOPIC,
    OrderItem,
    OrderPaid,
)
from apps.orders.faults import FaultPlan
from apps.orders.reconcile import Reconciliation, reconcile
from apps.orders.service import PAID, Charge, OrderService, PaymentDeclined
from txactors import layout
from txactors.admin import list_transactions
from txactors.consumer import Consumer
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.producer import TransactionProducer

CATALOG = {"book": 1_250, "mug": 899, "lamp": 4_500, "pen": 199, "desk": 25_000, "tea": 650}
DATABASES = (ORDERS_DB, *CONSUMER_GROUPS)


@dataclass(frozen=True, kw_only=True)
class Timing:
    """How quickly the check-back and redeliveries act; tests shrink everything."""

    coordinator: CoordinatorConfig
    decide_after: float
    """An unpaid attempt this old is rolled back by the check-back (see OrderService)."""
    ack_wait: float
    """A delivery unacked this long (its consumer died) goes to another consumer."""
    retry_delays: tuple[float, ...]
    drain_timeout: float

    def child(self, nats_url: str, storage: Storage, db: str) -> ChildConfig:
        return ChildConfig(
            nats_url=nats_url,
            storage=storage.to_args(),
            db=db,
            decide_after=self.decide_after,
            ack_wait=self.ack_wait,
            retry_delays=self.retry_delays,
        )


DEMO_TIMING = Timing(
    coordinator=CoordinatorConfig(
        transaction_timeout=1.0,
        check_interval=0.5,
        check_interval_max=2.0,
        check_answer_timeout=2.0,
    ),
    decide_after=3.0,
    ack_wait=3.0,
    retry_delays=(0.5, 1.0, 2.0, 5.0),
    drain_timeout=60.0,
)


@dataclass
class DemoReport:
    payments: Counter[str] = field(default_factory=Counter)
    """How each payment went, by outcome (paid, declined, end lost, …)."""
    handlers: dict[str, GroupHandler] = field(default_factory=dict)
    consumer_killed_at: str | None = None
    drained: bool = False
    seconds: float = 0.0
    reconciliation: Reconciliation | None = None

    @property
    def ok(self) -> bool:
        return self.drained and self.reconciliation is not None and self.reconciliation.ok


@asynccontextmanager
async def open_databases(storage: Storage) -> AsyncIterator[dict[str, Database]]:
    """Every service's database, emptied first: reconciliation assumes a fresh run."""
    async with AsyncExitStack() as stack:
        dbs: dict[str, Database] = {}
        for name in DATABASES:
            dbs[name] = await storage.open(name, fresh=True)
            stack.push_async_callback(dbs[name].close)
        yield dbs


async def run_demo(
    nc: Client,
    nats_url: str,
    storage: Storage,
    *,
    orders: int,
    concurrency: int,
    faults: Iterable[Fault],
    timing: Timing = DEMO_TIMING,
    seed: int = 7,
    progress: Progress | None = None,
) -> DemoReport:
    """Run the demo on `nc`, with a fresh database per service (DATABASES) in `storage`."""
    if orders < 1 or concurrency < 1:
        raise ValueError("orders and concurrency must be at least 1")
    progress = progress or Progress(disable=True)
    rng = random.Random(seed)
    report = DemoReport()
    started = time.monotonic()
    await _fresh_topic(nc)
    async with open_databases(storage) as dbs:
        order_ids = [f"order-{i:05d}" for i in range(orders)]
        plan = FaultPlan.draw(order_ids, faults, rng)
        service = OrderService(
            dbs[ORDERS_DB], charge=_declining(plan.declined), decide_after=timing.decide_after
        )
        await service.create_schema()
        for group in CONSUMER_GROUPS:
            await create_schema(group, dbs[group])
        await _seed(service, dbs[CART], order_ids, rng, progress)
        report.handlers = {
            group: GroupHandler(group, dbs[group], lose_first_ack=plan.lose_first_ack)
            for group in CONSUMER_GROUPS
        }

        def consumer(group: str) -> Consumer:
            return Consumer(
                nc,
                TOPIC,
                group,
                report.handlers[group],
                tags=[PAID_TAG],
                concurrency=concurrency,
                ack_wait=timing.ack_wait,
                retry_delays=timing.retry_delays,
                pull_expires=0.5,
            )

        async with (
            run_coordinator(nc, config=timing.coordinator),
            TransactionProducer(nc, PRODUCER_GROUP, service.check) as producer,
            AsyncExitStack() as consumers,
        ):
            service.attach(producer)
            late = {LOGISTICS} if plan.consumer_killed else set()
            for group in CONSUMER_GROUPS:
                if group not in late:
                    await consumers.enter_async_context(consumer(group))
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    _pay_all,
                    service,
                    order_ids,
                    plan,
                    timing,
                    nats_url,
                    storage,
                    concurrency,
                    report,
                    progress,
                )
                if plan.consumer_killed:
                    # The child takes the first logistics message and is killed holding it;
                    # only then does this process's logistics consumer start, so the
                    # redelivery (after ack_wait) is what brings that message here.
                    report.consumer_killed_at = await kill_consumer_mid_apply(
                        timing.child(nats_url, storage, LOGISTICS), LOGISTICS, timeout=30
                    )
            for group in late:
                await consumers.enter_async_context(consumer(group))
            report.drained = await _drain(nc, service.db, report, plan, timing, progress)
        report.reconciliation = await reconcile(
            dbs[ORDERS_DB], {group: dbs[group] for group in CONSUMER_GROUPS}, nc
        )
    report.seconds = time.monotonic() - started
    return report


async def _fresh_topic(nc: Client) -> None:
    """Reconciliation reads the whole topic: start it (and the groups' offsets) empty."""
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await nc.jetstream().delete_stream(layout.topic_stream(TOPIC))


async def _seed(
    service: OrderService,
    cart_db: Database,
    order_ids: list[str],
    rng: random.Random,
    progress: Progress,
) -> None:
    """Shoppers fill their carts and place orders from them (about three orders per user)."""
    users = max(1, len(order_ids) // 3)
    task = progress.add_task("create orders", total=len(order_ids))
    for i, order_id in enumerate(order_ids):
        user = f"user-{i % users:04d}"
        skus = rng.sample(sorted(CATALOG), rng.randint(1, 3))
        items = [OrderItem(sku, rng.randint(1, 3), CATALOG[sku]) for sku in skus]
        await add_to_cart(cart_db, user, items)
        await service.create_order(order_id, user, items)
        progress.advance(task)


def _declining(declined: frozenset[str]) -> Charge:
    """The payment gateway of the demo: declines the cards of the orders in `declined`."""

    async def charge(event: OrderPaid) -> None:
        if event.order_id in declined:
            raise PaymentDeclined(f"card declined for order {event.order_id}")

    return charge


async def _pay_all(
    service: OrderService,
    order_ids: list[str],
    plan: FaultPlan,
    timing: Timing,
    nats_url: str,
    storage: Storage,
    concurrency: int,
    report: DemoReport,
    progress: Progress,
) -> None:
    task = progress.add_task("pay orders", total=len(order_ids))
    limit = anyio.Semaphore(concurrency)
    child = timing.child(nats_url, storage, ORDERS_DB)

    async def pay(order_id: str) -> None:
        async with limit:
            if order_id in plan.killed_before_commit:
                await kill_producer_after_prepare(child, order_id, BEFORE_COMMIT)
                outcome = "producer killed before its local commit"
            elif order_id in plan.killed_after_commit:
                await kill_producer_after_prepare(child, order_id, AFTER_COMMIT)
                outcome = "producer killed after its local commit"
            elif order_id in plan.end_lost:
                txn, event = await service.prepare_payment(order_id)
                await service.record_payment(txn.txid, event)
                outcome = "end lost"  # no end is sent: the check-back must settle it
            else:
                try:
                    await service.pay_order(order_id)
                    outcome = "paid"
                except PaymentDeclined:
                    outcome = "declined (rolled back)"
            report.payments[outcome] += 1
            progress.advance(task)

    async with anyio.create_task_group() as tg:
        for order_id in order_ids:
            tg.start_soon(pay, order_id)


async def _drain(
    nc: Client,
    orders_db: Database,
    report: DemoReport,
    plan: FaultPlan,
    timing: Timing,
    progress: Progress,
) -> bool:
    """Wait until no transaction is open and every group applied every paid order (and
    absorbed the duplicates it was sent); False if `drain_timeout` passed first."""
    tasks = {group: progress.add_task(f"{group} applied", total=None) for group in report.handlers}
    with anyio.move_on_after(timing.drain_timeout):
        while True:
            rows = await orders_db.fetch("SELECT order_id FROM orders WHERE status = ?", PAID)
            paid = {order for (order,) in rows}
            duplicates = len(plan.lose_first_ack & paid)
            open_txns = [t for t in await list_transactions(nc) if t.state != "discarded"]
            done = not open_txns and all(
                h.applied >= len(paid) and h.absorbed >= duplicates
                for h in report.handlers.values()
            )
            for group, handler in report.handlers.items():
                progress.update(tasks[group], total=len(paid), completed=handler.applied)
            if done:
                return True
            await anyio.sleep(0.1)
    return False
