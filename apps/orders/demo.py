"""The whole order demo in one call: seed, pay with faults, drain, reconcile.

`run_demo` is what `python -m apps.orders` and the tests run. It starts the coordinator,
one order-service producer, the three consumer groups (logistics sending `shipment.booked`
with a producer of its own) and notifications in this process, spawns the
child processes the faults need, and returns the reconciliation (plus how each order's
payment went) once every group has caught up with the order database, or the drain
timeout passed.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio
from nats.aio.client import Client
from rich.progress import Progress

from apps.common.db import Database, Storage
from apps.common.drain import wait_drained
from apps.common.faults import Fault, FaultLog
from apps.common.fresh import start_clean
from apps.common.options import DEFAULT_CONCURRENCY, DEFAULT_SEED
from apps.common.report import Reconciliation, Tally, publish
from apps.common.timing import Timing
from apps.orders.child import (
    AFTER_COMMIT,
    BEFORE_COMMIT,
    ChildConfig,
    kill_consumer_mid_apply,
    kill_producer_after_prepare,
)
from apps.orders.consumers import GroupHandler, add_to_cart, create_schema, open_chain_log
from apps.orders.events import (
    ALL_GROUPS,
    BOOKED_TAG,
    CART,
    CONSUMER_GROUPS,
    LOGISTICS,
    NOTIFICATIONS,
    ORDERS_DB,
    PAID_TAG,
    PRODUCER_GROUP,
    SHIPMENTS_TOPIC,
    TOPIC,
    OrderItem,
    OrderPaid,
)
from apps.orders.faults import FaultPlan
from apps.orders.reconcile import Expectation, reconcile
from apps.orders.service import Charge, OrderService, PaymentAborted, PaymentDeclined
from txactors.consumer import Consumer
from txactors.coordinator.service import run_coordinator
from txactors.errors import PrepareFailed
from txactors.producer import TransactionProducer

CATALOG = {"book": 1_250, "mug": 899, "lamp": 4_500, "pen": 199, "desk": 25_000, "tea": 650}
DATABASES = (ORDERS_DB, *ALL_GROUPS)
GROUP_TOPICS = {**{group: (TOPIC, PAID_TAG) for group in CONSUMER_GROUPS},
                NOTIFICATIONS: (SHIPMENTS_TOPIC, BOOKED_TAG)}  # fmt: skip
"""Each group's topic and tag: the three of `order.paid`, and the hop after logistics."""

PAID = "paid"
DECLINED = "declined (rolled back)"
FENCED = "rolled back by a check-back before the local commit"
KILLED_BEFORE = "producer killed before its local commit"
KILLED_AFTER = "producer killed after its local commit"
END_LOST = "end lost"
ENDS_PAID = {
    PAID: True,
    END_LOST: True,
    KILLED_AFTER: True,
    DECLINED: False,
    KILLED_BEFORE: False,
    FENCED: False,
}
"""How each way a payment can go must end: paid and announced, or neither (any other way,
such as a prepare the coordinator did not confirm, is unpaid)."""


def prepare_failed(error: PrepareFailed) -> str:
    """The outcome of a payment whose prepare the coordinator did not confirm."""
    return f"refused: prepare not confirmed ({error.code or 'no answer'})"


def ends_paid(outcome: str) -> bool:
    return ENDS_PAID.get(outcome, False)


def payment_tallies(outcomes: Mapping[str, str]) -> list[Tally]:
    """How every payment ended, by cause, up front in the report: so a run in which many
    were refused or rolled back says how many and why."""
    ended = Counter(
        f"{'paid' if ends_paid(outcome) else 'not paid'}: {outcome}"
        for outcome in outcomes.values()
    )
    section = f"payments ({len(outcomes):,})"
    return [Tally(section=section, name=name, count=n) for name, n in ended.most_common()]


def delivery_tallies(handlers: Mapping[str, GroupHandler]) -> list[Tally]:
    return [
        Tally(section="deliveries", name=f"{group}: applied", count=handler.applied)
        for group, handler in handlers.items()
    ]


@dataclass
class DemoReport:
    outcomes: dict[str, str] = field(default_factory=dict)
    """How each order's payment went (PAID, DECLINED, …), by order id."""
    handlers: dict[str, GroupHandler] = field(default_factory=dict)
    consumer_killed_at: str | None = None
    drained: bool = False
    seconds: float = 0.0
    reconciliation: Reconciliation | None = None

    @property
    def payments(self) -> Counter[str]:
        return Counter(self.outcomes.values())

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
    concurrency: int = DEFAULT_CONCURRENCY,
    faults: Iterable[Fault],
    timing: Timing | None = None,
    seed: int = DEFAULT_SEED,
    progress: Progress | None = None,
) -> DemoReport:
    """Run the demo on `nc`, with a fresh database per service (DATABASES) in `storage`,
    and publish its reconciliation (see apps.common.report)."""
    if orders < 1 or concurrency < 1:
        raise ValueError("orders and concurrency must be at least 1")
    timing = timing or Timing()
    faults = frozenset(faults)
    progress = progress or Progress(disable=True)
    rng = random.Random(seed)
    report = DemoReport()
    log = FaultLog()
    started = time.monotonic()
    async with open_databases(storage) as dbs:
        order_ids = [f"order-{i:05d}" for i in range(orders)]
        plan = FaultPlan.draw(order_ids, faults, rng)
        service = OrderService(dbs[ORDERS_DB], charge=_declining(plan.declined))
        await service.create_schema()
        for group in ALL_GROUPS:
            await create_schema(group, dbs[group])
        logistics_log = await open_chain_log(dbs[LOGISTICS])
        await _seed(service, dbs[CART], order_ids, rng, progress)
        report.handlers = {
            group: GroupHandler(group, dbs[group], lose_first_ack=plan.lose_first_ack)
            for group in ALL_GROUPS
        }

        def consumer(group: str) -> Consumer:
            topic, tag = GROUP_TOPICS[group]
            return Consumer(
                nc,
                topic,
                group,
                report.handlers[group],
                tags=[tag],
                concurrency=concurrency,
                ack_wait=timing.ack_wait,
                retry_delays=timing.retry_delays,
                pull_expires=0.5,
            )

        async with (
            run_coordinator(nc, config=timing.coordinator),
            TransactionProducer(nc, PRODUCER_GROUP, service.txlog.check) as producer,
            TransactionProducer(nc, LOGISTICS, logistics_log.check) as logistics_producer,
            AsyncExitStack() as consumers,
        ):
            await start_clean(nc, producer_group=LOGISTICS, topics=[], consumer_groups=[])
            await start_clean(
                nc,
                producer_group=PRODUCER_GROUP,
                topics=[TOPIC, SHIPMENTS_TOPIC],
                consumer_groups=ALL_GROUPS,
            )
            service.attach(producer)
            report.handlers[LOGISTICS].chain = (logistics_log, logistics_producer)
            late = {LOGISTICS} if plan.consumer_killed else set()
            for group in ALL_GROUPS:
                if group not in late:
                    await consumers.enter_async_context(consumer(group))
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    _pay_all,
                    service,
                    order_ids,
                    plan,
                    ChildConfig.of(timing, nats_url, storage, ORDERS_DB),
                    concurrency,
                    report,
                    log,
                    progress,
                )
                if plan.consumer_killed:
                    # The child takes the first logistics message and is killed holding it;
                    # only then does this process's logistics consumer start, so the
                    # redelivery (after ack_wait) is what brings that message here.
                    child = ChildConfig.of(timing, nats_url, storage, LOGISTICS)
                    report.consumer_killed_at, code = await kill_consumer_mid_apply(
                        child, LOGISTICS, timeout=30
                    )
                    log.consumer_exits.append(code)
            for group in late:
                await consumers.enter_async_context(consumer(group))
            report.drained = await _drain(nc, report, timing, progress)
            report.seconds = time.monotonic() - started
            expectations = [
                Expectation(outcome, ids, ends_paid(outcome))
                for outcome, ids in _by_outcome(report.outcomes).items()
            ]
            handlers = report.handlers.values()
            tallies = payment_tallies(report.outcomes) + delivery_tallies(report.handlers)
            tallies += log.tallies(
                faults,
                acks_lost=sum(handler.acks_lost for handler in handlers),
                absorbed=sum(handler.absorbed for handler in handlers),
            )
            report.reconciliation = await reconcile(
                dbs[ORDERS_DB],
                {group: dbs[group] for group in ALL_GROUPS},
                nc,
                expectations=expectations,
                tallies=tallies,
            )
            await publish(nc, report.reconciliation)
    return report


def _by_outcome(outcomes: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for order_id, outcome in sorted(outcomes.items()):
        grouped.setdefault(outcome, []).append(order_id)
    return grouped


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
    child: ChildConfig,
    concurrency: int,
    report: DemoReport,
    log: FaultLog,
    progress: Progress,
) -> None:
    task = progress.add_task("pay orders", total=len(order_ids))
    limit = anyio.Semaphore(concurrency)

    async def pay(order_id: str) -> None:
        async with limit:
            if order_id in plan.killed_before_commit:
                _, code = await kill_producer_after_prepare(child, order_id, BEFORE_COMMIT)
                log.producer_exits.append(code)
                outcome = KILLED_BEFORE
            elif order_id in plan.killed_after_commit:
                _, code = await kill_producer_after_prepare(child, order_id, AFTER_COMMIT)
                log.producer_exits.append(code)
                outcome = KILLED_AFTER
            elif order_id in plan.end_lost:
                outcome = await _pay_without_end(service, order_id)
            else:
                try:
                    await service.pay_order(order_id)
                    outcome = PAID
                except PaymentDeclined:
                    outcome = DECLINED
                except PaymentAborted:  # a loaded machine: the check-back rolled it back
                    outcome = FENCED
                except PrepareFailed as error:
                    outcome = prepare_failed(error)
            report.outcomes[order_id] = outcome
            progress.advance(task)

    async with anyio.create_task_group() as tg:
        for order_id in order_ids:
            tg.start_soon(pay, order_id)


async def _pay_without_end(service: OrderService, order_id: str) -> str:
    """Prepare and pay locally, but never send the end: the check-back must settle it."""
    try:
        txn, event = await service.prepare_payment(order_id)
        await service.record_payment(txn.txid, event)
    except PaymentAborted:
        return FENCED
    except PrepareFailed as error:
        return prepare_failed(error)
    return END_LOST


async def _drain(nc: Client, report: DemoReport, timing: Timing, progress: Progress) -> bool:
    """Wait until no transaction is open and every group handled everything (see
    apps.common.drain); False if `drain_timeout` passed first."""
    tasks = {group: progress.add_task(f"{group} applied", total=None) for group in report.handlers}
    paid = sum(ends_paid(outcome) for outcome in report.outcomes.values())

    async def show_progress() -> bool:
        for group, handler in report.handlers.items():
            progress.update(tasks[group], total=paid, completed=handler.applied)
        return True

    drained = await wait_drained(
        nc,
        [(GROUP_TOPICS[group][0], group) for group in ALL_GROUPS],  # logistics before the hop
        producer_group=[PRODUCER_GROUP, LOGISTICS],
        timeout=timing.drain_timeout,
        also=show_progress,
    )
    await show_progress()
    return drained
