"""Producer, coordinator (with its checker) and consumer together, on a real nats-server.

These are the guarantees a user relies on, tested as RocketMQ's own integration test does:
many transactions with every possible outcome, then a look at exactly what was delivered,
what was discarded, and how often each producer was asked about each transaction.
"""

from __future__ import annotations

import collections
import enum
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from tests.support.txn import FAST, topic_ids
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.service import run_coordinator
from txactors.observe.metrics import CoordinatorMetrics
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]


class Outcome(enum.Enum):
    COMMIT_NOW = "commit now"
    ROLLBACK_NOW = "rollback now"
    CHECK_COMMITS = "unknown, then the check says commit"
    CHECK_ROLLS_BACK = "unknown, then the check says rollback"
    UNKNOWN_FOREVER = "unknown forever"


LOCAL = {
    Outcome.COMMIT_NOW: Decision.COMMIT,
    Outcome.ROLLBACK_NOW: Decision.ROLLBACK,
    Outcome.CHECK_COMMITS: Decision.UNKNOWN,
    Outcome.CHECK_ROLLS_BACK: Decision.UNKNOWN,
    Outcome.UNKNOWN_FOREVER: Decision.UNKNOWN,
}
CHECK = {
    Outcome.CHECK_COMMITS: Decision.COMMIT,
    Outcome.CHECK_ROLLS_BACK: Decision.ROLLBACK,
    Outcome.UNKNOWN_FOREVER: Decision.UNKNOWN,
}


class CheckLedger:
    """A checker that answers from a table and records every check-back it gets."""

    def __init__(self) -> None:
        self.answers: dict[str, Decision] = {}
        self.checks: collections.Counter[str] = collections.Counter()
        self.in_flight: set[str] = set()
        self.overlapping: list[str] = []
        self.after_final: list[str] = []
        self.final: set[str] = set()

    async def __call__(self, view: CheckView) -> Decision:
        if view.txid in self.in_flight:
            self.overlapping.append(view.txid)
        if view.txid in self.final:
            self.after_final.append(view.txid)
        self.in_flight.add(view.txid)
        try:
            self.checks[view.txid] += 1
            await anyio.sleep(0.01)  # a real checker reads a database
            answer = self.answers.get(view.txid, Decision.UNKNOWN)
            if answer is not Decision.UNKNOWN:
                self.final.add(view.txid)
            return answer
        finally:
            self.in_flight.discard(view.txid)


@asynccontextmanager
async def recording_consumer(nc: Client, topic: str, group: str) -> AsyncIterator[list[str]]:
    received: list[str] = []

    async def handle(message: ConsumedMessage) -> None:
        received.append(message.msg_id)

    async with Consumer(nc, topic, group, handle, concurrency=8):
        yield received


async def discarded_txids(nc: Client) -> list[str]:
    js = nc.jetstream()
    return [
        (m.headers or {})[layout.TXID_HEADER]
        async for m in read_subject(js, layout.DISCARD_STREAM, layout.discard_subject_filter(), 1)
    ]


async def test_five_outcomes_deliver_exactly_the_committed_set(private_nc: Client) -> None:
    check_max = 3
    config = CoordinatorConfig(check_max=check_max, **FAST)
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry)
    ledger = CheckLedger()
    kinds: dict[str, Outcome] = {}
    async with (
        run_coordinator(private_nc, config=config, metrics=metrics),
        recording_consumer(private_nc, "orders", "audit") as received,
        TransactionProducer(private_nc, "shop", ledger) as producer,
    ):

        async def one(outcome: Outcome, n: int) -> None:
            message = TxMessage("orders", f"{outcome.name}-{n}".encode(), keys=[str(n)])
            result = await producer.send_in_transaction(
                message, lambda message, arg: LOCAL[outcome]
            )
            kinds[result.txid] = outcome
            if outcome in CHECK:
                ledger.answers[result.txid] = CHECK[outcome]
            else:
                ledger.final.add(result.txid)

        async with anyio.create_task_group() as tg:
            for outcome in Outcome:
                for n in range(8):
                    tg.start_soon(one, outcome, n)

        committed = {
            t for t, k in kinds.items() if k in (Outcome.COMMIT_NOW, Outcome.CHECK_COMMITS)
        }
        forever = {t for t, k in kinds.items() if k is Outcome.UNKNOWN_FOREVER}

        async def settled() -> bool:
            return (
                len(received) >= len(committed)
                and set(await discarded_txids(private_nc)) >= forever
            )

        await eventually(settled, timeout=20)
        await anyio.sleep(config.check_interval_max * 3)  # room for anything that should not come

    assert sorted(received) == sorted(f"{t}:0" for t in committed), "committed, once each"
    assert sorted(await discarded_txids(private_nc)) == sorted(forever)
    for txid, outcome in kinds.items():
        if outcome in (Outcome.COMMIT_NOW, Outcome.ROLLBACK_NOW):
            assert ledger.checks[txid] == 0, f"{outcome}: decided before any check was due"
        elif outcome is Outcome.UNKNOWN_FOREVER:
            assert ledger.checks[txid] == check_max
        else:
            assert ledger.checks[txid] == 1, f"{outcome}: one check decides it"
    assert ledger.overlapping == [], "never two checks of one transaction at once"
    assert ledger.after_final == [], "never a check after the final answer"
    assert registry.get_sample_value("txactors_duplicate_checks_total", {"partition": "0"}) == 0.0
    assert registry.get_sample_value("txactors_commits_total", {"partition": "0"}) == len(committed)
    assert registry.get_sample_value("txactors_discards_total", {"partition": "0"}) == len(forever)


async def test_default_timing_fifteen_checks_then_discard_on_a_virtual_clock(
    private_nc: Client,
) -> None:
    """RocketMQ's defaults (6 s timeout, 30 s checks growing, 15 checks): hours of checking,
    run in well under a second of real time by moving the coordinator's clock."""
    now = [1_000_000.0]
    ledger = CheckLedger()
    config = CoordinatorConfig()
    assert (config.transaction_timeout, config.check_max) == (6.0, 15)
    async with (
        run_coordinator(private_nc, config=config, clock=lambda: now[0]),
        TransactionProducer(private_nc, "shop", ledger) as producer,
    ):
        result = await producer.send_in_transaction(
            TxMessage("orders", b"x"), lambda message, arg: Decision.UNKNOWN
        )

        async def discarded() -> bool:
            now[0] += 600.0  # ten virtual minutes per poll
            return result.txid in await discarded_txids(private_nc)

        await eventually(discarded, timeout=30)
    assert ledger.checks[result.txid] == 15
    assert ledger.overlapping == []
    assert await topic_ids(private_nc, "orders") == []


@pytest.mark.parametrize("commit_locally", [True, False], ids=["local-commit", "no-commit"])
async def test_producer_killed_between_prepare_and_end_is_resolved_by_another_instance(
    private_nc: Client, tmp_path: Path, commit_locally: bool
) -> None:
    url = private_nc.connected_url.geturl() if private_nc.connected_url else ""
    marker = tmp_path / "local-commit"
    async with run_coordinator(private_nc, config=CoordinatorConfig(**FAST)):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        peer = [sys.executable, "-m", "tests.peers.dying_producer", url, str(marker)]
        result = await anyio.run_process(
            [*peer, "1" if commit_locally else "0"], cwd=ROOT, env=env, check=False
        )
        assert result.returncode == -signal.SIGKILL, result.stderr.decode()
        txid = result.stdout.decode().split("TXID", 1)[1].split()[0]
        assert marker.exists() == commit_locally

        async def look_at_the_database(view: CheckView) -> Decision:
            return Decision.COMMIT if marker.exists() else Decision.ROLLBACK

        async with TransactionProducer(private_nc, "bank", look_at_the_database):

            async def resolved() -> bool:
                ids = await topic_ids(private_nc, "transfers")
                listed = await private_nc.request(
                    layout.admin_subject(0),
                    b'{"type":"ListTransactions","version":2}',
                    timeout=2,
                    headers={"Content-Type": "application/json"},
                )
                return bool(ids) or b'"transactions":[]' in listed.data

            await eventually(resolved, timeout=20)
        expected = [f"{txid}:0"] if commit_locally else []
        assert await topic_ids(private_nc, "transfers") == expected
