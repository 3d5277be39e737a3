"""The cost of a hop: inputs consumed, applied once and sent on, against applied once only.

N inputs are stored on a topic (shaped like committed messages) and read by a `Consumer`
group, 64 handlers at a time, whose handler writes one row in its own database per input:

- `apply once`: the row and the input's apply record in one local transaction
  (`apply_once_sqlite` / `apply_once_postgres`, what `idempotent=` does), nothing sent;
- `apply once + send on`: `apply_and_send` (what `sends=` does): the same row, the apply
  record and the log row of one outgoing message in one local transaction, its prepare
  awaited before the commit, its end (acked) after, then the ack;
- `apply once + send on, one-way end`: the same with a producer whose end is published and
  not waited for (`end_mode="oneway"`; a lost end is committed by its check-back, the log
  row being committed): the input is acked one round trip sooner.

A run lasts from the consumer's start until every input was handled; after a run that sends
on, every message sent is checked committed on its topic. On SQLite (a file in WAL mode,
`synchronous=FULL`, one writer) and on PostgreSQL (asyncpg, the test server on
127.0.0.1:5432, `synchronous_commit = on`, a pool of 64: a connection per handler, since a
hop holds its connection while its prepare travels), the server with `sync_interval:
always`, the coordinator in a process of its own (the CLI, as deployed). CPU is this
process's (consumer and producer) and the coordinator's, per input.

Run `python -m bench chain`.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import aiosqlite
import anyio
import asyncpg  # type: ignore[import-untyped]
import nats
from nats.aio.client import Client
from rich.console import Console
from rich.table import Table

from bench.consumer import BODY
from bench.deployed import PARTITIONS, Deployment, deployment
from txactors import ConsumedMessage, Consumer, TransactionProducer, TxMessage, apply_and_send
from txactors.app.chain import Outbox
from txactors.consumer.idempotent import apply_once_postgres, apply_once_sqlite
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.producer.txlog import TxLog
from txactors.producer.txlog.pg_asyncpg import AsyncpgTxLog
from txactors.producer.txlog.sqlite import SqliteTxLog
from txactors.wire import layout

PG_DSN = os.environ.get("TXBENCH_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
CONCURRENCY = 64
PG_POOL = 64
ROWS = "txbench_chain_rows"
SENT_ON = "apply once + send on"
INPUT, OUTPUT = "chainin", "chainout"

Handle = Callable[[ConsumedMessage], Awaitable[None]]


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu: float
    coordinator_cpu: float


async def _fill(nc: Client, topic: str, count: int) -> None:
    """`count` messages on `topic`'s stream, shaped like committed ones (id, txid headers)."""
    js = nc.jetstream()
    await ensure_topic_stream(js, topic)
    subject = layout.topic_subject(topic)
    acks = []
    for i in range(count):
        headers = {layout.MSG_ID_HEADER: f"in{i}:0", layout.TXID_HEADER: f"in{i}"}
        acks.append(await js.publish_async(subject, BODY, headers=headers))
    for ack in acks:
        await ack


async def _consume(dep: Deployment, nc: Client, topic: str, count: int, handle: Handle) -> Run:
    handled = 0
    done = anyio.Event()

    async def counted(message: ConsumedMessage) -> None:
        nonlocal handled
        await handle(message)
        handled += 1
        if handled == count:
            done.set()

    before = dep.snapshot()
    started = time.perf_counter()
    group = f"bench-{uuid.uuid4().hex[:8]}"
    async with Consumer(nc, topic, group, counted, concurrency=CONCURRENCY):
        await done.wait()
        seconds = time.perf_counter() - started
        usage = Deployment.usage(before, dep.snapshot())
    return Run(seconds, usage.cpu["producer"], usage.cpu.get("coordinator", 0.0))


# -- the two databases ----------------------------------------------------------------------


@dataclass
class Database:
    """One database for a pair of runs: how to apply once, and its log for sending on."""

    name: str
    apply_once: Callable[[str, str, Callable[[Any], Awaitable[object]]], Awaitable[bool]]
    txlog: TxLog[Any]
    insert: Callable[[Any, str, str | None], Awaitable[object]]
    """Write the row of input `msg_id` (sent on as `txid`) on a connection."""


@contextlib.asynccontextmanager
async def sqlite(directory: Path) -> AsyncIterator[Database]:
    path = directory / "chain.db"
    async with aiosqlite.connect(path, isolation_level=None) as conn:
        await conn.execute("PRAGMA journal_mode=WAL")  # kept in the file: the log's too
        await conn.execute(f"CREATE TABLE {ROWS} (msg_id TEXT NOT NULL, txid TEXT)")
        async with SqliteTxLog(path, "bench-chain") as txlog:

            async def apply_once(group: str, msg_id: str, work: Any) -> bool:
                return await apply_once_sqlite(conn, group, msg_id, work)

            async def insert(conn: Any, msg_id: str, txid: str | None) -> None:
                await conn.execute(f"INSERT INTO {ROWS} VALUES (?, ?)", (msg_id, txid))

            yield Database("SQLite", apply_once, txlog, insert)


@contextlib.asynccontextmanager
async def postgres() -> AsyncIterator[Database]:
    pool = await asyncpg.create_pool(PG_DSN, min_size=PG_POOL, max_size=PG_POOL)
    try:
        await pool.execute(f"DROP TABLE IF EXISTS {ROWS}")
        await pool.execute(f"CREATE TABLE {ROWS} (msg_id TEXT NOT NULL, txid TEXT)")

        async def apply_once(group: str, msg_id: str, work: Any) -> bool:
            return await apply_once_postgres(pool, group, msg_id, work)

        async def insert(conn: Any, msg_id: str, txid: str | None) -> None:
            await conn.execute(f"INSERT INTO {ROWS} VALUES ($1, $2)", msg_id, txid)

        txlog = AsyncpgTxLog(pool, "bench-chain")
        yield Database("PostgreSQL", apply_once, txlog, insert)
        await pool.execute(f"DROP TABLE IF EXISTS {ROWS}")
    finally:
        await pool.close()


async def _pair(dep: Deployment, nc: Client, db: Database, count: int, table: Table) -> None:
    """The runs on `db`: apply once, then apply once and send on (acked end, one-way end)."""
    await db.txlog.create_table()
    await db.txlog.create_applied_table()
    run = uuid.uuid4().hex[:6]
    source, sent_on = f"{INPUT}{run}", f"{OUTPUT}{run}"
    await _fill(nc, source, count)

    async def applied(message: ConsumedMessage) -> None:
        async def work(conn: Any) -> None:
            await db.insert(conn, message.msg_id, None)

        await db.apply_once(f"apply-{run}", message.msg_id, work)  # a group new to the table

    only = await _consume(dep, nc, source, count, applied)
    runs = [("apply once", only)]
    for end_mode, name in (("ack", SENT_ON), ("oneway", f"{SENT_ON}, one-way end")):
        group = f"chain-{end_mode}-{run}"
        hop = await _chained(dep, nc, db, (source, sent_on), count, group, end_mode)
        runs.append((name, hop))
        await _sent_on(nc, sent_on, count * (len(runs) - 1))
    for name, result in runs:
        table.add_row(
            f"{db.name}: {name}",
            f"{count / result.seconds:,.0f}",
            f"{result.seconds / only.seconds:.2f}x",
            f"{result.cpu / count * 1e6:,.0f}",
            f"{result.coordinator_cpu / count * 1e6:,.0f}",
        )


async def _chained(
    dep: Deployment,
    nc: Client,
    db: Database,
    topics: tuple[str, str],
    count: int,
    group: str,
    end_mode: str,
) -> Run:
    """Topic `source` read by `group`, whose handler applies once and sends on to `sent_on`
    with a producer ending in `end_mode`."""
    source, sent_on = topics
    async with TransactionProducer(
        nc, db.txlog.group, db.txlog.check, partitions=PARTITIONS, end_mode=end_mode
    ) as producer:

        async def chained(message: ConsumedMessage) -> None:
            async def work(conn: Any, out: Outbox[Any]) -> None:
                await db.insert(conn, message.msg_id, out.txid)
                await out.send(TxMessage(sent_on, BODY))

            await apply_and_send(db.txlog, producer, group, message, work)

        return await _consume(dep, nc, source, count, chained)


async def _sent_on(nc: Client, topic: str, count: int, timeout: float = 60.0) -> None:
    """Until `count` messages are committed on `topic` (a one-way end's come a little after
    its input's ack); AssertionError if they are not within `timeout` s."""
    info = None
    with anyio.move_on_after(timeout):
        while True:
            info = await nc.jetstream().stream_info(layout.topic_stream(topic))
            if info.state.messages >= count:
                break
            await anyio.sleep(0.1)
    assert info is not None and info.state.messages == count, f"{info} of {count} sent on"


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("INFO")  # the default a deployment runs with
    count = 300 if quick else 3_000
    table = Table(
        title=f"a hop: {count:,} inputs, applied once, and sent on (concurrency {CONCURRENCY})"
    )
    for column in ("handler", "inputs/s", "time vs apply once", "CPU µs/input", "coordinator"):
        table.add_column(column, justify="left" if column == "handler" else "right")
    async with deployment("always") as dep, dep.coordinators(1):
        nc = await nats.connect(dep.url)
        try:
            with TemporaryDirectory(prefix="txbench-chain-") as directory:
                async with sqlite(Path(directory)) as db:
                    await _pair(dep, nc, db, count, table)
            async with postgres() as db:
                await _pair(dep, nc, db, count, table)
        finally:
            await nc.close()
    Console(width=150).print(table)
    return [table]
