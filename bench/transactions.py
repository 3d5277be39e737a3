"""Transactional messages end to end, next to raw acked JetStream publishes in the same run.

- rate and latency, once per flush setting of nats-server (`sync_interval: always`, the
  durable default, and `interval`, nats-server's lazy two-minute default), each on a server of its
  own: `send_in_transaction` (prepare, a trivial local transaction, commit) until a consumer
  has the message, at concurrency 1 and 64; next to raw acked publishes of the same single
  messages on the same server: one at a time, and 256 in flight. Goals: at concurrency 64
  with `always`, at least as many committed transactions per second as raw publishes with 256
  in flight (group commit makes the transactional path cheaper per message than a plain
  durable publish); otherwise >= 1/3 of raw.
- check cycle: the cost of one checker cycle with 1,000 open transactions after 100,000
  resolved ones, against the same cycle with no history (must not grow with history).
- recovery: time for a restarted coordinator to rebuild 10,000 open transactions.
- duplicate and unexpected check-backs in a check-heavy run (both must be 0).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from prometheus_client import CollectorRegistry
from rich.console import Console
from rich.table import Table

from txactors import layout
from txactors.consumer import ConsumedMessage, Consumer
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
from txactors.logs import configure_logging
from txactors.metrics import CoordinatorMetrics
from txactors.producer import CheckView, TransactionProducer, TxMessage
from txactors.server import EmbeddedNatsServer, Fsync
from txactors.topics import ensure_topic_stream

BODY = b"x" * 128


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def p50_p99(seconds: list[float]) -> str:
    return f"{percentile(seconds, 0.5) * 1e3:.1f} / {percentile(seconds, 0.99) * 1e3:.1f}"


async def run_workers(count: int, workers: int, one: Callable[[int], Awaitable[None]]) -> float:
    """Seconds to run `one(i)` for i < count spread over `workers` tasks."""
    if count % workers:
        raise ValueError(f"count {count} must be a multiple of workers {workers}")
    per_worker = count // workers
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for w in range(workers):

            async def worker(w: int = w) -> None:
                for i in range(per_worker):
                    await one(w * per_worker + i)

            tg.start_soon(worker)
    return time.perf_counter() - started


async def raw_publishes(nc: Client, count: int, in_flight: int) -> tuple[float, list[float]]:
    """(acked msg/s, latencies) of single-message publishes, `in_flight` awaiting their acks."""
    js = nc.jetstream(publish_async_max_pending=max(in_flight, 1))
    await ensure_topic_stream(js, "rawbench")
    latencies: list[float] = []
    pending: collections.deque[tuple[float, asyncio.Future[Any]]] = collections.deque()
    subject = layout.topic_subject("rawbench")

    async def settle_oldest() -> None:
        sent, future = pending.popleft()
        await future
        latencies.append(time.perf_counter() - sent)

    started = time.perf_counter()
    for i in range(count):
        if len(pending) >= in_flight:
            await settle_oldest()
        future = await js.publish_async(subject, BODY, headers={"Nats-Msg-Id": f"r{i}"})
        pending.append((time.perf_counter(), future))
    while pending:
        await settle_oldest()
    seconds = time.perf_counter() - started
    await js.purge_stream(layout.topic_stream("rawbench"))
    return count / seconds, latencies


async def transactions(
    nc: Client, producer: TransactionProducer, count: int, workers: int, topic: str
) -> tuple[float, list[float], list[float]]:
    """(committed tx/s until the consumer had all, commit latencies, end-to-end latencies)."""
    sent_at: dict[str, float] = {}
    e2e: list[float] = []
    all_in = anyio.Event()

    async def handle(message: ConsumedMessage) -> None:
        e2e.append(time.perf_counter() - sent_at[message.keys[0]])
        if len(e2e) == count:
            all_in.set()

    commit_latencies: list[float] = []

    async def one(i: int) -> None:
        key = f"{topic}-{i}"
        sent_at[key] = started = time.perf_counter()
        result = await producer.send_in_transaction(
            TxMessage(topic, BODY, keys=[key]), lambda m, a: Decision.COMMIT
        )
        assert result.state == "committed", result
        commit_latencies.append(time.perf_counter() - started)

    async with Consumer(nc, topic, "bench", handle, concurrency=64):
        started = time.perf_counter()
        await run_workers(count, workers, one)
        await all_in.wait()
        seconds = time.perf_counter() - started
    return count / seconds, commit_latencies, e2e


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


SETTINGS: tuple[Fsync, ...] = ("always", "interval")
"""The embedded server's fsync settings compared: `sync_interval: always` (the durable
default) and nats-server's own default (acknowledge at once, flush every two minutes)."""
RAW_IN_FLIGHT = 256


async def rates(table: Table, setting: Fsync, scale: float) -> None:
    """Transactions at concurrency 1 and 64 next to raw publishes, on one server of `setting`."""
    async with EmbeddedNatsServer(fsync=setting) as server:
        nc = await nats.connect(server.url)
        try:
            async with (
                run_coordinator(nc),
                TransactionProducer(nc, "bench", lambda v: Decision.COMMIT) as producer,
            ):
                for workers, count, in_flight in (
                    (1, int(2000 * scale), 1),
                    (64, int(20000 * scale), RAW_IN_FLIGHT),
                ):
                    count = max(count // workers, 1) * workers
                    raw_rate, raw_lat = await raw_publishes(nc, count, in_flight)
                    rate, commit_lat, e2e_lat = await transactions(
                        nc, producer, count, workers, f"bench{workers}"
                    )
                    ratio = rate / raw_rate
                    goal = 1.0 if (setting, workers) == ("always", 64) else 1 / 3
                    table.add_row(
                        f"{setting}: committed tx/s until consumed, concurrency {workers} "
                        f"(raw: {in_flight} in flight)",
                        f"{rate:,.0f}",
                        f"{raw_rate:,.0f}",
                        f"{ratio:.0%}",
                        f"{'✓' if ratio >= goal else '✗'} >= {goal:.0%}",
                    )
                    table.add_row(
                        f"  {setting}: latency p50 / p99 ms, concurrency {workers} "
                        "(commit; consumed)",
                        f"{p50_p99(commit_lat)}; {p50_p99(e2e_lat)}",
                        p50_p99(raw_lat),
                        "-",
                        "-",
                    )
        finally:
            await nc.close()


async def main(*, quick: bool = False) -> None:
    configure_logging("ERROR")
    console = Console(width=150)
    scale = 0.1 if quick else 1.0
    table = Table(title="transactional messages vs raw acked JetStream publishes (same run)")
    for column in ("measure", "txactors", "raw JetStream", "ratio", "goal"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    for setting in SETTINGS:
        await rates(table, setting, scale)

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
    console.print(table)
