"""The Spark sink's backfill, next to what its two halves can do alone, in the same run.

A topic of 200,000 committed messages (a `Transfer` Struct, coordinator headers), then:
- (a) source → tables: `run_sink` catching up the whole topic into the partitioned Parquet
  store (read, decode, write, commit), rows/s over the run's wall time;
- (b) raw nats-py: one process fetching the same messages with a pull consumer, no decoding;
- (c) Spark alone: the same rows from a cached in-memory DataFrame written to the same layout;
- per-batch fixed cost: a warm one-message batch (planning, task launch, commit);
- read method: the same range by pull consumer (what the source does) and by direct gets
  (`$JS.API.STREAM.MSG.GET`, 64 in flight), in one process.
Goal: (a) >= 70% of (b).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from decimal import Decimal
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client
from rich.console import Console
from rich.table import Table

from spark_sinks.jetstream_read import fetch_range
from spark_sinks.job import PARTITION_COLUMNS, BatchProgress, run_sink
from spark_sinks.session import local_session
from tests.support.spark_models import Currency, Transfer
from txactors.actors.loop import run as run_on_loop
from txactors.embedded.server import EmbeddedNatsServer
from txactors.nats.config import NatsConfig
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.wire import layout

TOPIC = "bench_transfers"


async def publish(nc: Client, topic: str, count: int, prefix: str = "tx") -> None:
    """Committed-looking messages (the coordinator's headers), published 1,000 at a time."""
    js = nc.jetstream()
    await ensure_topic_stream(js, topic)
    now = f"{time.time():.6f}"
    for start in range(0, count, 1_000):
        acks = []
        for i in range(start, min(start + 1_000, count)):
            body = msgspec.msgpack.encode(
                Transfer(
                    f"t{i}", f"acct-{i % 97}", f"acct-{i % 89}", Decimal(i) / 100, Currency.EUR
                )
            )
            headers = {
                layout.MSG_ID_HEADER: layout.message_id(f"{prefix}{i}", 0),
                layout.TXID_HEADER: f"{prefix}{i}",
                layout.GROUP_HEADER: "bank",
                layout.KEYS_HEADER: f"t{i}",
                layout.COMMITTED_AT_HEADER: now,
            }
            acks.append(await js.publish_async(layout.topic_subject(topic), body, headers=headers))
        await asyncio.gather(*acks)


async def raw_fetch(nc: Client, topic: str, count: int) -> float:
    """(b): seconds for nats-py to pull every message of the topic, nothing else."""
    from nats.js.api import AckPolicy, ConsumerConfig

    js = nc.jetstream()
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0)
    sub = await js.pull_subscribe(layout.topic_filter(topic), stream=layout.topic_stream(topic),
                                  config=config)  # fmt: skip
    start = time.perf_counter()
    seen = 0
    while seen < count:
        seen += len(await sub.fetch(min(2_000, count - seen), timeout=5))
    elapsed = time.perf_counter() - start
    await sub.unsubscribe()
    return elapsed


async def source_fetch(url: str, topic: str, count: int) -> float:
    """The source's own read path (pull consumer, header parsing), without Spark."""
    start = time.perf_counter()
    seen = 0
    async for chunk in fetch_range(NatsConfig(url=url), topic, 1, count):
        seen += len(chunk)
    assert seen == count
    return time.perf_counter() - start


async def direct_gets(nc: Client, topic: str, count: int, in_flight: int = 64) -> float:
    """Reading by sequence instead: one `get_msg` per message, `in_flight` at a time."""
    js = nc.jetstream()
    stream = layout.topic_stream(topic)
    start = time.perf_counter()
    for first in range(1, count + 1, in_flight):
        last = min(first + in_flight, count + 1)
        await asyncio.gather(*(js.get_msg(stream, seq) for seq in range(first, last)))
    return time.perf_counter() - start


async def publish_one(url: str, topic: str) -> None:
    nc = await nats.connect(url)
    try:
        await publish(nc, topic, 1, prefix=f"one{time.time_ns()}-")
    finally:
        await nc.close()


def spark_runs(url: str, count: int, parallelism: int) -> dict[str, float]:
    """(a), (c) and the per-batch cost, in one SparkSession (its start-up is not counted)."""
    root = Path(tempfile.mkdtemp(prefix="txactors-bench-spark-"))
    try:
        spark = local_session(root / "warehouse")
        nats_config = NatsConfig(url=url)
        # Warm up: the first batch of a session starts Python workers and the metastore.
        run_sink(spark, root / "warehouse", {"bench_warmup": Transfer}, nats=nats_config)
        start = time.perf_counter()
        rows = run_sink(
            spark, root / "warehouse", {TOPIC: Transfer}, nats=nats_config, parallelism=parallelism
        )
        source = time.perf_counter() - start
        assert rows == count, rows
        run_on_loop(publish_one(url, "bench_warmup"))
        events: list[object] = []  # batches, and the other progress events run_sink reports
        start = time.perf_counter()
        run_sink(spark, root / "warehouse", {"bench_warmup": Transfer}, nats=nats_config,
                 on_progress=events.append)  # fmt: skip
        per_run = time.perf_counter() - start
        per_batch = sum(e.seconds for e in events if isinstance(e, BatchProgress))

        cached = spark.table(TOPIC).cache()
        assert cached.count() == count
        start = time.perf_counter()
        cached.write.partitionBy(*PARTITION_COLUMNS).parquet(str(root / "from_memory"))
        memory = time.perf_counter() - start
        spark.stop()
        return {"source": source, "per_batch": per_batch, "per_run": per_run, "memory": memory}
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("WARNING")
    count = 20_000 if quick else 200_000
    console = Console()
    with tempfile.TemporaryDirectory(prefix="txactors-bench-nats-") as data:
        async with EmbeddedNatsServer(Path(data)) as server:
            nc = await nats.connect(server.url)
            try:
                await publish(nc, TOPIC, count)
                await publish(nc, "bench_warmup", 1)
                raw = await raw_fetch(nc, TOPIC, count)
                ours = await source_fetch(server.url, TOPIC, count)
                sample = min(count, 20_000)
                direct = await direct_gets(nc, TOPIC, sample)
                pull = await source_fetch(server.url, TOPIC, sample)
            finally:
                await nc.close()
            spark = await asyncio.to_thread(spark_runs, server.url, count, 2)

    table = Table(title=f"Spark sink backfill, {count:,} messages")
    for column in ("measure", "value", "vs (b)"):
        table.add_column(column, justify="right" if column != "measure" else "left")

    def rate(seconds: float, n: int = count) -> str:
        return f"{n / seconds:,.0f} rows/s"

    table.add_row("(a) source → partitioned tables", rate(spark["source"]),
                  f"{raw / spark['source']:.0%}")  # fmt: skip
    table.add_row("(b) raw nats-py pull fetch", rate(raw), "100%")
    table.add_row("(c) Spark write from cached DataFrame", rate(spark["memory"]), "")
    table.add_row("source read path alone (no Spark)", rate(ours), f"{raw / ours:.0%}")
    table.add_row("per-batch fixed cost (1-row batch)", f"{spark['per_batch']:.2f} s", "")
    table.add_row("per-run fixed cost (1-row run)", f"{spark['per_run']:.2f} s", "")
    table.add_row(f"read {sample:,}: pull consumer", rate(pull, sample), "")
    table.add_row(f"read {sample:,}: direct get x64 in flight", rate(direct, sample), "")
    console.print(table)
    return [table]
