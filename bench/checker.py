"""The checker's side of the transactional benchmark: bookkeeping cost, recovery, exactness.

- check cycle: the cost of one checker cycle with 1,000 open transactions after 100,000
  resolved ones, against the same cycle with no history (must not grow with history).
- recovery: time for a restarted coordinator to rebuild 10,000 open transactions.
- duplicate and unexpected check-backs in a check-heavy run (both must be 0).
"""

from __future__ import annotations

import random
import time
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from prometheus_client import CollectorRegistry
from rich.table import Table

from bench.workers import run_workers
from txactors.coordinator import (
    CheckAnswered,
    CoordinatorConfig,
    Decision,
    End,
    Half,
    HalvesStored,
    OpPersisted,
    PersistOp,
    Publish,
    Published,
    SendCheck,
    TransactionTable,
)
from txactors.coordinator.service import run_coordinator
from txactors.embedded.server import EmbeddedNatsServer
from txactors.observe.metrics import CoordinatorMetrics
from txactors.producer import CheckView, TransactionProducer, TxMessage

BODY = b"x" * 128


def check_cycle_cost(history: int, open_count: int = 1000, cycles: int = 10) -> float:
    """Seconds per checker cycle over `open_count` open transactions after `history` resolved.

    A cycle: every open transaction's check falls due (`tick`), is sent, answered UNKNOWN,
    and its `checked` record persisted: the whole bookkeeping of one round of check-backs.
    """
    config = CoordinatorConfig(check_max=cycles + 1, check_jitter=0.0)
    table = TransactionTable(config, rng=random.Random(7))
    now, seq, op_seq = 1_000_000.0, 0, 0

    def store(txid: str) -> None:
        nonlocal seq
        seq += 1
        half = Half(index=0, topic="t", seq=seq, born=now)
        event = HalvesStored(txid=txid, token="k", group="g", producer="p", halves=(half,))
        table.handle(event, now)

    def settle(actions: list[Any]) -> None:
        nonlocal op_seq
        while actions:
            follow: list[Any] = []
            for action in actions:
                if isinstance(action, PersistOp):
                    op_seq += 1
                    follow += table.handle(OpPersisted(op_id=action.op_id, seq=op_seq), now)
                elif isinstance(action, Publish):
                    follow += table.handle(Published(txid=action.txid, index=action.index), now)
                elif isinstance(action, SendCheck):
                    answer = CheckAnswered(
                        txid=action.txid, check_id=action.check_id, resolution=Decision.UNKNOWN
                    )
                    follow += table.handle(answer, now)
            actions = follow

    for i in range(history):
        store(f"done-{i}")
        end = End(txid=f"done-{i}", token="k", decision=Decision.COMMIT, request_id="r")
        settle(table.handle(end, now))
    for i in range(open_count):
        store(f"open-{i}")
    started = time.perf_counter()
    for _ in range(cycles):
        now += config.check_interval_max + config.max_immunity  # everything is due
        actions = table.tick(now)
        assert sum(isinstance(a, SendCheck) for a in actions) == open_count
        settle(actions)
    return (time.perf_counter() - started) / cycles


async def recovery_seconds(nc: Client, open_count: int) -> float:
    config = CoordinatorConfig(transaction_timeout=3600)
    async with (
        run_coordinator(nc, config=config),
        TransactionProducer(nc, "recovery", lambda v: Decision.UNKNOWN) as producer,
    ):

        async def one(i: int) -> None:
            await producer.begin().send(TxMessage("recovery", BODY))

        await run_workers(max(open_count // 64, 1) * 64, 64, one)
    started = time.perf_counter()
    async with run_coordinator(nc, config=config):
        return time.perf_counter() - started


async def check_storm(nc: Client, count: int) -> tuple[float, float, int]:
    """(duplicate checks, unexpected answers, checks sent) with UNKNOWN-then-decided txns."""
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    config = CoordinatorConfig(
        transaction_timeout=0.2,
        check_interval=0.2,
        check_interval_max=0.5,
        check_max=5,
        check_answer_timeout=2.0,
    )
    asked: dict[str, int] = {}

    async def checker(view: CheckView) -> Decision:
        asked[view.txid] = asked.get(view.txid, 0) + 1
        await anyio.sleep(random.uniform(0, 0.05))
        return Decision.UNKNOWN if asked[view.txid] < 3 else Decision.COMMIT

    async with (
        run_coordinator(nc, config=config, metrics=metrics),
        TransactionProducer(nc, "storm", checker, checker_concurrency=16) as producer,
    ):

        async def one(i: int) -> None:
            await producer.send_in_transaction(
                TxMessage("storm", BODY), lambda m, a: Decision.UNKNOWN
            )

        count = max(count // 32, 1) * 32
        await run_workers(count, 32, one)
        with anyio.fail_after(60):
            while (  # noqa: ASYNC110 (polling a metric: there is no event to wait on)
                registry.get_sample_value("txactors_commits_total", {"partition": "0"}) or 0
            ) < count:
                await anyio.sleep(0.1)
    sample = registry.get_sample_value
    return (
        sample("txactors_duplicate_checks_total", {"partition": "0"}) or 0.0,
        sample("txactors_unexpected_check_answers_total", {"partition": "0"}) or 0.0,
        sum(asked.values()),
    )


async def checks(table: Table, scale: float) -> None:
    """The check cycle, check storm and recovery rows, on a fresh `fsync always` server."""
    async with EmbeddedNatsServer(fsync="always") as server:
        nc = await nats.connect(server.url)
        try:
            history = int(100_000 * scale)
            fresh, aged = check_cycle_cost(0), check_cycle_cost(history)
            table.add_row(
                f"check cycle, 1,000 open: after {history:,} resolved vs none (ms)",
                f"{aged * 1e3:,.1f}",
                f"{fresh * 1e3:,.1f}",
                f"{aged / fresh:.2f}x",
                "≈ 1x (no growth)",
            )
            duplicates, unexpected, checks = await check_storm(nc, int(500 * scale))
            table.add_row(
                f"duplicate / unexpected check-backs ({checks:,} checks)",
                f"{duplicates:.0f} / {unexpected:.0f}",
                "-",
                "-",
                "✓ 0 / 0" if duplicates == unexpected == 0 else "✗",
            )
            open_count = int(10_000 * scale)
            table.add_row(
                f"always: recovery with {open_count:,} open transactions (s)",
                f"{await recovery_seconds(nc, open_count):.2f}",
                "-",
                "-",
                "-",
            )
        finally:
            await nc.close()
