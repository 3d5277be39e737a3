"""The outbox job: insert an order row into PostgreSQL and get its message to a JetStream
consumer, done the ways a Python user would: txactors against an outbox on the same job.

On a fresh embedded nats-server with `sync_interval: always` and the test PostgreSQL
(127.0.0.1:5432, trust, database `test`, `synchronous_commit = on`), each call is one order:

- `naive` (the floor, not atomic): commit the row, then one acked `js.publish`; a crash in
  between loses the message;
- `txactors`: `AsyncpgTxLog.send_in_transaction` (the row and the log row in one local
  transaction, the prepare out meanwhile, then the acked end), the coordinator in its own
  process started by the CLI; `txactors, one-way end`, the same with the one-way end (the
  call returns after the local commit and the end's publish, as an outbox's returns after
  its commit: the message is still guaranteed, the halves being stored before the commit
  and a lost end settled by the check-back); and `txactors, prepare first`, the acked calls
  with the prepare awaited before the local transaction starts (not overlapped with it);
- `nats-outbox`, `faststream-outbox` (the optional `bench-outbox` extra, when installed): the
  row and an outbox row in one transaction, each package's relay in a process of its own.

One consumer process (`bench.outbox_consumer`, a plain pull consumer) receives every run's
messages. The callers share a pool of their own per run, of at most `CONNECTIONS`
PostgreSQL connections (the server's 100 are shared with the relays and whatever else runs).
Concurrency 1 and 64, rounds interleaved (each round runs every way once). A run's
rate is calls / (last message consumed - start); its latency is the call's (what the caller
waits). The table gives each way's median over the rounds, its ratio to `naive` in the same
rounds, and one raw acked publish's p50 for the concurrency-1 target (commit p50 <= 4x).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import nats
from nats.aio.client import Client
from rich.console import Console
from rich.table import Table
from sqlalchemy.ext.asyncio import create_async_engine

from bench import outbox_relays, raw
from bench.deployed import PARTITIONS, ROOT, START_TIMEOUT, Deployment, deployment, python
from bench.outbox_relays import ORDERS
from bench.transactions import percentile, stamped
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.producer.txlog.pg_asyncpg import AsyncpgTxLog
from txactors.wire import layout

PG_DSN = os.environ.get("TXBENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
ALCHEMY_DSN = PG_DSN.replace("postgresql://", "postgresql+asyncpg://", 1)
GROUP = "benchoutbox"
CONCURRENCY = (1, 64)
CONSUMED_TIMEOUT = 300.0
TARGET_NAIVE_64 = 0.8
TARGET_C1_LATENCY = 4.0

Call = Callable[[bytes], Awaitable[None]]
"""One order: insert its row and get `body` on its way to the consumer."""
Way = Callable[[str, int], contextlib.AbstractAsyncContextManager[Call]]
"""A way to do the job: for a topic and a number of PostgreSQL connections, its call (and
whatever serves it: a relay) while entered."""
ONEWAY = "txactors, one-way end"
"""The same calls ending one-way: what the caller waits for is then what an outbox's waits
for (the local commit), like with like."""
SERIAL = "txactors, prepare first"
"""The same calls with the prepare awaited before the local transaction starts: what the
overlap saves."""
CONNECTIONS = 48
"""PostgreSQL connections of the callers at most (the test server allows 100, shared)."""


@dataclass(frozen=True)
class Run:
    way: str
    workers: int
    rate: float
    latencies: list[float]


@contextlib.asynccontextmanager
async def process(dep: Deployment, module: str, *args: str) -> AsyncIterator[Any]:
    """`python -m module args` beside the benchmark, entered once it printed `ready`; it
    leaves when its stdin closes."""
    child = await asyncio.create_subprocess_exec(
        *python(module),
        *args,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path[1:]])},
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=(dep.logs / f"{module}.log").open("ab"),
        limit=1 << 26,
    )
    assert child.stdout is not None and child.stdin is not None
    try:
        async with asyncio.timeout(START_TIMEOUT):  # after what the packages log there
            while (line := await child.stdout.readline()).strip() != b"ready":
                if not line:
                    raise RuntimeError(f"{module} did not start (see {dep.logs})")
        yield child
    finally:
        child.stdin.close()
        try:
            async with asyncio.timeout(10):
                await child.wait()
        except TimeoutError:
            child.terminate()
            await child.wait()


async def last_consumed(child: Any) -> float:
    async with asyncio.timeout(CONSUMED_TIMEOUT):
        line = await child.stdout.readline()
    last: float = json.loads(line)["last"]
    return last


async def measure(
    dep: Deployment, nc: Client, way: str, make: Way, count: int, workers: int, round_: int
) -> Run:
    """`count` calls over `workers` tasks, until the consumer had every message."""
    topic = f"ob-{re.sub('[^A-Za-z0-9]+', '-', way)}-{workers}-{round_}"
    await ensure_topic_stream(nc.jetstream(), topic)
    latencies: list[float] = []
    tickets = itertools.count()

    async def worker(call: Call) -> None:
        for i in tickets:
            if i >= count:
                return
            started = time.monotonic()
            await call(stamped())
            latencies.append(time.monotonic() - started)

    async with (
        make(topic, min(workers, CONNECTIONS)) as call,
        process(
            dep, "bench.outbox_consumer", dep.url, layout.topic_filter(topic), str(count)
        ) as consumer,
    ):
        started = time.monotonic()
        await asyncio.gather(*(worker(call) for _ in range(workers)))
        last = await last_consumed(consumer)
    await nc.jetstream().delete_stream(layout.topic_stream(topic))
    return Run(way, workers, count / (last - started), latencies)


@contextlib.asynccontextmanager
async def asyncpg_pool(size: int) -> AsyncIterator[Any]:
    pool = await asyncpg.create_pool(PG_DSN, min_size=size, max_size=size)
    try:
        yield pool
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def ways(dep: Deployment, nc: Client) -> AsyncIterator[dict[str, Way]]:
    """Each way to do the job: name → (topic, connections → its call, ready while entered,
    on a pool of its own with that many PostgreSQL connections)."""
    js = nc.jetstream()
    logs: dict[str, AsyncpgTxLog] = {}

    @contextlib.asynccontextmanager
    async def naive(topic: str, connections: int) -> AsyncIterator[Call]:
        subject = layout.topic_subject(topic)
        async with asyncpg_pool(connections) as pool:

            async def call(body: bytes) -> None:
                await pool.execute(f"INSERT INTO {ORDERS} (body) VALUES ($1)", body)
                await js.publish(subject, body)

            yield call

    def package(name: str) -> Way:
        @contextlib.asynccontextmanager
        async def relayed(topic: str, connections: int) -> AsyncIterator[Call]:
            engine = create_async_engine(ALCHEMY_DSN, pool_size=connections, max_overflow=0)
            try:
                await outbox_relays.create_tables(engine, name)
                async with (
                    process(dep, "bench.outbox_relays", name, dep.url, ALCHEMY_DSN, topic),
                    outbox_relays.producer_side(engine, name, topic) as call,
                ):
                    yield call
            finally:
                await engine.dispose()

        return relayed

    async def check(view: CheckView) -> Decision:
        return await logs[GROUP].check(view)

    async with (
        dep.coordinators(1),
        TransactionProducer(nc, GROUP, check, partitions=PARTITIONS) as producer,
        TransactionProducer(
            nc, GROUP, check, partitions=PARTITIONS, end_mode="oneway"
        ) as oneway_producer,
    ):

        def sending(through: TransactionProducer) -> Way:
            @contextlib.asynccontextmanager
            async def txactors(topic: str, connections: int) -> AsyncIterator[Call]:
                async with asyncpg_pool(connections) as pool:
                    txlog = logs[GROUP] = AsyncpgTxLog(pool, GROUP)
                    await txlog.create_table()

                    async def call(body: bytes) -> None:
                        async def work(conn: Any, txid: str) -> None:
                            await conn.execute(f"INSERT INTO {ORDERS} (body) VALUES ($1)", body)

                        await txlog.send_in_transaction(through, TxMessage(topic, body), work)

                    yield call

            return txactors

        @contextlib.asynccontextmanager
        async def serial(topic: str, connections: int) -> AsyncIterator[Call]:
            """The steps of `send_in_transaction` one after the other, not overlapped:
            the prepare's round trip, then the local transaction."""
            async with asyncpg_pool(connections) as pool:
                txlog = logs[GROUP] = AsyncpgTxLog(pool, GROUP)

                async def call(body: bytes) -> None:
                    async with producer.begin() as txn:
                        await txn.send(TxMessage(topic, body))
                        async with txlog.local() as local:
                            await txlog.record(local.connection, txn.txid)
                            await local.connection.execute(
                                f"INSERT INTO {ORDERS} (body) VALUES ($1)", body
                            )
                            await local.commit()

                yield call

        packages = {name: package(name) for name in outbox_relays.available()}
        yield {
            "naive": naive,
            "txactors": sending(producer),
            ONEWAY: sending(oneway_producer),
            SERIAL: serial,
            **packages,
        }


def report(runs: list[Run], raw_p50: float, rounds: int) -> Table:
    table = Table(title=f"The outbox job (PostgreSQL row + its JetStream message), {rounds} rounds")
    for column in ("way", "concurrency", "orders/s (median)", "vs naive", "call p50 / p99 ms"):
        table.add_column(column, justify="right" if column != "way" else "left")
    for workers in CONCURRENCY:
        naive_rates = [r.rate for r in runs if r.way == "naive" and r.workers == workers]
        for way in dict.fromkeys(r.way for r in runs):
            mine = [r for r in runs if r.way == way and r.workers == workers]
            rates = [r.rate for r in mine]
            ratio = statistics.median(a / b for a, b in zip(rates, naive_rates, strict=True))
            latencies = [s for r in mine for s in r.latencies]
            p50 = percentile(latencies, 0.5)
            cells = [f"{ratio:.2f}"]
            if way == "txactors" and workers == 64:
                cells[0] += f" {'✓' if ratio >= TARGET_NAIVE_64 else '✗'} >= {TARGET_NAIVE_64}"
            latency = f"{p50 * 1e3:.2f} / {percentile(latencies, 0.99) * 1e3:.2f}"
            if way in ("txactors", ONEWAY) and workers == 1:
                times = p50 / raw_p50
                ok = "✓" if times <= TARGET_C1_LATENCY else "✗"
                latency += f" ({times:.1f}x one acked publish {ok} <= {TARGET_C1_LATENCY:g}x)"
            table.add_row(way, str(workers), f"{statistics.median(rates):,.0f}", *cells, latency)
    table.caption = f"one raw acked publish: p50 {raw_p50 * 1e3:.2f} ms"
    return table


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("ERROR")
    rounds = 1 if quick else 3
    counts = {1: 100 if quick else 200, 64: 640 if quick else 1280}
    runs: list[Run] = []
    async with deployment("always") as dep:
        nc = await nats.connect(dep.url)
        try:
            async with asyncpg_pool(1) as pool:
                await pool.execute(f"DROP TABLE IF EXISTS {ORDERS}")
                await pool.execute(f"CREATE TABLE {ORDERS} (id BIGSERIAL PRIMARY KEY, body BYTEA)")
            _, raw_latencies = await raw.pipelined(nc, stamped(), counts[1], 1, "outboxraw")
            async with ways(dep, nc) as each:
                for round_ in range(rounds):
                    for workers in CONCURRENCY:
                        for way, make in each.items():
                            run = await measure(
                                dep, nc, way, make, counts[workers], workers, round_
                            )
                            runs.append(run)
        finally:
            await nc.close()
    missing = sorted({"nats-outbox", "faststream-outbox"} - {r.way for r in runs})
    table = report(runs, percentile(raw_latencies, 0.5), rounds)
    if missing:
        table.caption = f"{table.caption}; not installed: {', '.join(missing)} (extra bench-outbox)"
    Console(width=200).print(table)
    return [table]
