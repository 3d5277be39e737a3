"""The whole demo in one call: seed both banks, run transfers with faults, drain, reconcile.

Everything runs on one NATS server (embedded unless NATS_URL is set): the coordinator in
this process (in production it is its own process, `txactors coordinator`), alipay's
producer and yuebao's consumer in this process, and, for the crash faults, real child
processes of the same groups (`apps.transfer.crash`) that are SIGKILLed mid-flight.

How each fault is injected (`Fault`):
- local-failure: some transfers come from an account that cannot cover them; the debit is
  refused inside the local transaction, which rolls back the half message.
- producer-crash: a child alipay process prepares a few transfers, debits half of them, and
  is SIGKILLed before any end. The coordinator's check-backs go to this process (the group's
  survivor), whose transaction log finds the debited ones (COMMIT) and claims the others
  rolled back (ROLLBACK).
- lost-end: prepared and debited here, but the end is never sent; the check-back commits.
- consumer-crash: a child yuebao consumer takes the first message and is SIGKILLed inside its
  database transaction; this process's consumer starts after it died and gets the message
  once its ack wait runs out. The killed transaction left no trace, so it applies once.
- duplicate: some transfers' acks are "lost" after the credit committed (the handler raises,
  the consumer naks); the second delivery finds the message-apply record and does nothing.
"""

from __future__ import annotations

import enum
import random
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.abc import TaskGroup
from rich.console import Console
from rich.progress import Progress, TaskID

from apps.common.db import Storage
from apps.common.drain import wait_drained
from apps.common.faults import Child, Fault, FaultLog, child_process
from apps.common.fresh import start_clean
from apps.common.options import DEFAULT_CONCURRENCY, DEFAULT_SEED, where_nats
from apps.common.report import Reconciliation, Tally, progress_bar, publish
from apps.common.timing import Timing
from apps.transfer.bank import ALIPAY, YUEBAO, Bank, InsufficientFunds
from apps.transfer.messages import RECEIVER_GROUP, SENDER_GROUP, TOPIC, Transfer
from apps.transfer.receiver import Receiver
from apps.transfer.reconcile import Expectation, reconcile
from apps.transfer.sender import Sender
from txactors.consumer import Consumer
from txactors.coordinator.service import run_coordinator
from txactors.errors import PrepareFailed, RolledBackByCheck
from txactors.nats.config import ENV_VARS
from txactors.nats.connect import nats_session
from txactors.producer import TransactionProducer

CRASH_MODULE = "apps.transfer.crash"
OPENING = 100_000
"""Cents every account opens with (¥1,000), on top of what its planned transfers need."""
MAX_AMOUNT = 5_000


class Scenario(enum.StrEnum):
    ORDINARY = "ordinary"
    REFUSED = "insufficient funds"
    CRASH_DEBITED = "producer killed, had debited"
    CRASH_NOT_DEBITED = "producer killed, had not debited"
    LOST_END = "end lost"
    DUPLICATE = "delivered twice"


COMMITS = {
    Scenario.ORDINARY: True,
    Scenario.REFUSED: False,
    Scenario.CRASH_DEBITED: True,
    Scenario.CRASH_NOT_DEBITED: False,
    Scenario.LOST_END: True,
    Scenario.DUPLICATE: True,
}


@dataclass(frozen=True, slots=True)
class Planned:
    id: str
    source: str
    target: str
    amount: int
    scenario: Scenario

    def transfer(self) -> Transfer:
        """The transfer as sent now."""
        return Transfer(
            id=self.id,
            source=self.source,
            target=self.target,
            amount=self.amount,
            created_at=time.time(),
        )


@dataclass(frozen=True, slots=True)
class Plan:
    transfers: list[Planned]
    alipay: dict[str, int]
    yuebao: dict[str, int]

    def of(self, scenario: Scenario) -> list[Planned]:
        return [p for p in self.transfers if p.scenario is scenario]


CONSUMER_CRASHED = "consumer killed mid-apply"
FENCED = "rolled back by a check-back before its debit committed"
"""A transfer whose txid a check-back claimed rolled back in the transaction log before its
local transaction recorded it (`RolledBackByCheck`): the debit fails, nothing moves. The
producer running a transaction answers its checks UNKNOWN while it works, so only a check
served by another member of the group can do that (here: this process answering for the
crashing child while the child still debits). Rare; counted when it happens."""
POOR = "a-poor"
"""The account the insufficient-funds transfers come from: it opens with ¥1."""

TRANSFERS = "transfers"
COMMITTED = "committed: debited, announced, credited"
CAUSES = {
    Scenario.REFUSED: "refused: insufficient funds (local-failure fault)",
    Scenario.CRASH_NOT_DEBITED: "rolled back: producer killed before its debit (producer-crash)",
}
"""Why a planned transfer that never commits does not: its fault."""
UNEXPLAINED = "not debited, no cause seen (see the scenario rows)"


def prepare_failed(error: PrepareFailed) -> str:
    """The cause of a transfer whose prepare the coordinator did not confirm."""
    return f"refused: prepare not confirmed ({error.code or 'no answer'})"


def outcome_tallies(
    planned: Sequence[Planned], debited: Collection[str], causes: Mapping[str, str]
) -> list[Tally]:
    """How every planned transfer ended, by cause: committed (alipay debited it, which the
    checks prove was announced and credited once), or why not: its fault, or what the run
    saw (`causes`, by transfer id). Up front in the report, so a run that refuses many says
    how many and why."""
    ended: Counter[str] = Counter()
    for p in planned:
        if p.id in debited:
            ended[COMMITTED] += 1
        else:
            ended[causes.get(p.id) or CAUSES.get(p.scenario, UNEXPLAINED)] += 1
    section = f"{TRANSFERS} ({len(planned):,})"
    return [Tally(section=section, name=name, count=n) for name, n in ended.most_common()]


def make_plan(count: int, faults: frozenset[Fault], accounts: int, rng: random.Random) -> Plan:
    """`count` transfers between `accounts` accounts per bank, some set aside per fault."""
    share = max(1, count // 20)
    wanted = {
        Scenario.REFUSED: share if Fault.LOCAL_FAILURE in faults else 0,
        Scenario.CRASH_DEBITED: 2 if Fault.PRODUCER_CRASH in faults else 0,
        Scenario.CRASH_NOT_DEBITED: 2 if Fault.PRODUCER_CRASH in faults else 0,
        Scenario.LOST_END: share if Fault.LOST_END in faults else 0,
        Scenario.DUPLICATE: share if Fault.DUPLICATE in faults else 0,
    }
    scenarios = [s for s, n in wanted.items() for _ in range(n)][:count]
    scenarios += [Scenario.ORDINARY] * (count - len(scenarios))
    rng.shuffle(scenarios)
    sources = [f"a-{i:03d}" for i in range(1, accounts + 1)]
    targets = [f"b-{i:03d}" for i in range(1, accounts + 1)]
    alipay = dict.fromkeys(sources, OPENING)
    transfers = []
    for scenario in scenarios:
        source = POOR if scenario is Scenario.REFUSED else rng.choice(sources)
        amount = rng.randint(1, MAX_AMOUNT)
        if scenario is Scenario.REFUSED:
            amount += 100  # more than the ¥1 it has
        else:
            alipay[source] += amount  # ordinary transfers never run short
        id_ = f"{rng.getrandbits(64):016x}"
        transfers.append(Planned(id_, source, rng.choice(targets), amount, scenario))
    if Fault.LOCAL_FAILURE in faults:
        alipay[POOR] = 100
    return Plan(transfers, alipay, dict.fromkeys(targets, OPENING))


@dataclass(frozen=True, slots=True)
class DemoConfig:
    storage: Storage
    transfers: int = 200
    concurrency: int = DEFAULT_CONCURRENCY
    faults: frozenset[Fault] = frozenset(Fault)
    accounts: int = 20
    seed: int = DEFAULT_SEED
    timing: Timing = field(default_factory=Timing)


@dataclass(frozen=True, slots=True)
class DemoResult:
    reconciliation: Reconciliation
    seconds: float
    """From the first transfer until the pipeline drained."""
    drained: bool


async def run_demo(config: DemoConfig, console: Console | None = None) -> DemoResult:
    """Run the demo; `console` shows progress (None: quiet, e.g. in a benchmark)."""
    plan = make_plan(config.transfers, config.faults, config.accounts, random.Random(config.seed))
    storage = config.storage
    if console is not None:  # before opening: a database that cannot be opened is named here
        console.print(f"  alipay: {storage.describe(ALIPAY)}")
        console.print(f"  yuebao: {storage.describe(YUEBAO)}")
    alipay = Bank(await storage.open(ALIPAY, fresh=True))
    try:
        yuebao = Bank(await storage.open(YUEBAO, fresh=True))
        try:
            await alipay.seed(plan.alipay)
            await yuebao.seed(plan.yuebao)
            return await _run(config, plan, alipay, yuebao, console)
        finally:
            await yuebao.db.close()
    finally:
        await alipay.db.close()


async def _run(
    config: DemoConfig, plan: Plan, alipay: Bank, yuebao: Bank, console: Console | None
) -> DemoResult:
    timing = config.timing
    sender = await Sender.open(alipay)
    receiver = Receiver(yuebao, lose_ack_for={p.id for p in plan.of(Scenario.DUPLICATE)})
    faults = Faults()
    crashing = plan.of(Scenario.CRASH_DEBITED) + plan.of(Scenario.CRASH_NOT_DEBITED)
    ours = [p for p in plan.transfers if p not in crashing]
    committed = sum(COMMITS[p.scenario] for p in plan.transfers)
    async with (
        nats_session() as session,
        run_coordinator(session.nc, config=timing.coordinator),
        TransactionProducer(session.nc, SENDER_GROUP, sender.txlog.check) as producer,
        AsyncExitStack() as children,
    ):
        nc = session.nc
        await start_clean(
            nc, producer_group=SENDER_GROUP, topics=[TOPIC], consumer_groups=[RECEIVER_GROUP]
        )
        if console is not None:
            console.print(f"  {where_nats(session)}")
        env = {ENV_VARS["url"]: session.url}
        storage = config.storage.to_args()
        consumer = receiver.consumer(
            nc,
            concurrency=config.concurrency,
            ack_wait=timing.ack_wait,
            retry_delays=timing.retry_delays,
        )
        with progress_bar(console or Console(quiet=True)) as progress:
            sent = progress.add_task("transfers sent (alipay)", total=len(plan.transfers))
            credited = progress.add_task("credited once (yuebao)", total=committed)
            async with anyio.create_task_group() as services:
                if Fault.CONSUMER_CRASH in config.faults:
                    args = ("consumer", str(timing.ack_wait), *storage)
                    child = await children.enter_async_context(
                        child_process(CRASH_MODULE, *args, env=env)
                    )
                    await child.expect("READY")
                else:
                    await services.start(consumer.run)

                async def show_credits() -> None:
                    while True:
                        progress.update(credited, completed=await yuebao.credited_count())
                        await anyio.sleep(0.1)

                services.start_soon(show_credits)
                started = time.perf_counter()
                async with anyio.create_task_group() as work:
                    if Fault.CONSUMER_CRASH in config.faults:
                        work.start_soon(_consumer_crash, child, services, consumer, faults)
                    if crashing:
                        work.start_soon(
                            _producer_crash, crashing, storage, env, faults, progress, sent
                        )
                    causes = await _send_all(
                        ours, config.concurrency, sender, producer, progress, sent
                    )
                causes.update(faults.causes)
                drained = await wait_drained(
                    nc,
                    [(TOPIC, RECEIVER_GROUP)],
                    producer_group=SENDER_GROUP,
                    timeout=timing.drain_timeout,
                )
                seconds = time.perf_counter() - started
                progress.update(credited, completed=await yuebao.credited_count())
                await consumer.stop()
                services.cancel_scope.cancel()
        expectations = [
            Expectation(scenario, [p.id for p in plan.of(scenario) if p.id not in causes], commits)
            for scenario, commits in COMMITS.items()
            if plan.of(scenario)
        ]
        for cause in sorted(set(causes.values())):  # not planned: they must never apply
            ids = [id_ for id_, why in causes.items() if why == cause]
            expectations.append(Expectation(cause, ids, committed=False))
        if faults.crashed_apply:
            expectations.append(Expectation(CONSUMER_CRASHED, faults.crashed_apply, True))
        tallies = outcome_tallies(plan.transfers, (await alipay.sent()).keys(), causes)
        tallies += faults.log.tallies(
            config.faults, acks_lost=receiver.acks_lost, absorbed=receiver.duplicates
        )
        reconciliation = await reconcile(
            alipay, yuebao, nc=nc, expectations=expectations, tallies=tallies
        )
        await publish(nc, reconciliation)
    return DemoResult(reconciliation, seconds, drained)


async def _send_all(
    transfers: Sequence[Planned],
    concurrency: int,
    sender: Sender,
    producer: TransactionProducer,
    progress: Progress,
    task: TaskID,
) -> dict[str, str]:
    """Send `transfers`, `concurrency` at a time; returns why each transfer that ended
    without a debit for a reason its plan did not foresee did so, by id."""
    queue = list(reversed(transfers))
    causes: dict[str, str] = {}

    async def worker() -> None:
        while queue:
            planned = queue.pop()
            transfer = planned.transfer()
            try:
                if planned.scenario is Scenario.LOST_END:
                    txn = producer.begin()
                    await txn.send(sender.message(transfer))
                    await sender.debit(transfer, txn.txid)
                    # ...and the end is never sent: only the check-back can finish it.
                else:
                    await sender.transfer(producer, transfer)
            except InsufficientFunds:
                if planned.scenario is not Scenario.REFUSED:
                    raise
            except RolledBackByCheck:
                causes[planned.id] = FENCED
            except PrepareFailed as error:
                causes[planned.id] = prepare_failed(error)
            progress.advance(task)

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return causes


@dataclass
class Faults:
    """What the injected crashes did: the common log, and what only this demo needs."""

    log: FaultLog = field(default_factory=FaultLog)
    crashed_apply: list[str] = field(default_factory=list)
    """The transfer the consumer child was applying when it died."""
    causes: dict[str, str] = field(default_factory=dict)
    """Transfers the producer child meant to debit whose txid a check-back claimed first
    (they must roll back), by id."""


async def _producer_crash(
    crashing: Sequence[Planned],
    storage: list[str],
    env: dict[str, str],
    faults: Faults,
    progress: Progress,
    task: TaskID,
) -> None:
    """A child alipay process prepares `crashing` (debiting some) and is SIGKILLed."""
    plan = [
        (msgspec.structs.asdict(p.transfer()), p.scenario is Scenario.CRASH_DEBITED)
        for p in crashing
    ]
    args = ("producer", msgspec.json.encode(plan).decode(), *storage)
    async with child_process(CRASH_MODULE, *args, env=env) as child:
        for _ in crashing:
            # A child starting on a loaded machine (500 in flight) may take long to import.
            transfer_id, outcome = (await child.expect("PREPARED", timeout=60)).split()
            if outcome == "fenced":
                faults.causes[transfer_id] = FENCED
            progress.advance(task)
        faults.log.producer_exits.append(await child.wait())


async def _consumer_crash(
    child: Child, services: TaskGroup, consumer: Consumer, faults: Faults
) -> None:
    """Wait for the child consumer to die on its first message, then start ours: the
    message it held comes back to ours once its ack wait runs out."""
    try:
        faults.crashed_apply.append(await child.expect("APPLYING", timeout=60))
        faults.log.consumer_exits.append(await child.wait())
    finally:
        await services.start(consumer.run)
