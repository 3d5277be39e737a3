"""The sink job: one streaming query per topic, from its stream into its Parquet store.

    spark = local_session(Path("warehouse"))
    run_sink(spark, Path("warehouse"), {"transfers": Transfer}, servers="nats://…", once=True)
    spark.sql("select event_date, sum(amount) from transfers group by event_date").show()

Exactly once comes from Spark, not from us: each query checkpoints its offsets (stream
sequences) before a batch and the file sink appends the batch's files to `_spark_metadata`
only when they are all written; a rerun resumes at the last committed batch and rewrites
exactly that batch, from the same sequences. A run killed mid-batch can leave part files
that no commit names: readers through Spark (the catalog views, `spark.read.parquet`) never
see them; a reader that lists the directory itself (pyarrow, DuckDB) would (docs/spark.md).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from spark_sinks.catalog import checkpoint_dir, register_views, store_dir
from spark_sinks.jetstream_read import AUTH_OPTIONS
from spark_sinks.schema import load_struct, payload_columns, spark_schema, struct_path
from spark_sinks.source import SOURCE_NAME
from txactors.layout import topic_stream

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery
    from pyspark.sql.types import StructType

    from txactors.config import NatsConfig

POLL_INTERVAL: Final = 0.5
PARTITION_COLUMNS: Final = ("topic", "event_date")

Schema = type[msgspec.Struct] | str | None
"""A topic's payload type: a Struct, its `module:Name` path, or None for raw bytes."""


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """One finished micro-batch of one topic: what `txactors sink run` prints."""

    topic: str
    batch_id: int
    rows: int
    end_seq: int
    head_seq: int | None
    seconds: float

    @property
    def lag(self) -> int | None:
        """Messages the stream holds beyond this batch (None if the source did not say)."""
        return None if self.head_seq is None else max(self.head_seq - self.end_seq, 0)


ProgressCallback = Callable[[BatchProgress], None]


def run_sink(
    spark: SparkSession,
    warehouse: Path,
    topics: Mapping[str, Schema],
    *,
    nats: NatsConfig,
    once: bool = True,
    interval: float = 10.0,
    max_rows_per_batch: int | None = None,
    parallelism: int | None = None,
    on_progress: ProgressCallback | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Sink `topics` into `warehouse`; returns the rows written by this run.

    `once`: catch up with every stream and return (availableNow). Otherwise run micro-batches
    every `interval` seconds until `stop` is set (or KeyboardInterrupt). `nats.url` must name
    the server (the source runs in other processes, so it cannot share an embedded one).
    """
    if nats.url is None:
        raise ValueError("run_sink needs a NATS URL; start the embedded server first")
    warehouse = warehouse.resolve()
    asyncio.run(_ensure_streams(nats, list(topics)))
    queries = {
        topic: _start(
            spark, warehouse, topic, schema, nats, once, interval, max_rows_per_batch, parallelism
        )
        for topic, schema in topics.items()
    }
    schemas = {topic: _schema_of(schema) for topic, schema in topics.items()}
    registered: set[str] = set()
    seen: dict[str, int] = dict.fromkeys(topics, -1)
    rows = 0

    def report(topic: str, query: StreamingQuery) -> None:
        nonlocal rows
        for progress in _new_progress(topic, query, seen):
            rows += progress.rows
            if on_progress is not None:
                on_progress(progress)
            # Continuous runs name a new topic's table as soon as it has rows; a catch-up
            # run does it once at the end (each look at the catalog costs ~0.5 s).
            if not once and progress.rows and topic not in registered:
                register_views(spark, warehouse, schemas)
                registered.add(topic)

    try:
        while not (stop is not None and stop.is_set()):
            for topic, query in queries.items():
                report(topic, query)
            stopped = [q for q in queries.values() if not q.isActive]
            # One failed query ends the run: its error is raised below.
            if len(stopped) == len(queries) or any(q.exception() for q in stopped):
                break
            time.sleep(POLL_INTERVAL)
    finally:
        for query in queries.values():
            if query.isActive:
                query.stop()
    for query in queries.values():
        error = query.exception()
        if error is not None:
            raise error
    for topic, query in queries.items():  # batches that finished after the last poll
        report(topic, query)
    register_views(spark, warehouse, schemas)
    return rows


def _schema_of(schema: Schema) -> StructType:
    struct = load_struct(schema) if isinstance(schema, str) else schema
    return spark_schema(struct)


def _start(
    spark: SparkSession,
    warehouse: Path,
    topic: str,
    schema: Schema,
    nats: NatsConfig,
    once: bool,
    interval: float,
    max_rows_per_batch: int | None,
    parallelism: int | None,
) -> StreamingQuery:
    options = source_options(nats, [topic], schema, max_rows_per_batch, parallelism)
    writer = (
        spark.readStream.format(SOURCE_NAME)
        .options(**options)
        .load()
        .writeStream.format("parquet")
        .queryName(f"txactors_sink_{topic}")
        .option("path", str(store_dir(warehouse, topic)))
        .option("checkpointLocation", str(checkpoint_dir(warehouse, topic)))
        .partitionBy(*PARTITION_COLUMNS)
        .outputMode("append")
    )
    writer = (
        writer.trigger(availableNow=True)
        if once
        else writer.trigger(processingTime=f"{interval} seconds")
    )
    return writer.start()


def source_options(
    nats: NatsConfig,
    topics: list[str],
    schema: Schema = None,
    max_rows_per_batch: int | None = None,
    parallelism: int | None = None,
) -> dict[str, str]:
    """Options for `spark.readStream.format("txactors")` (see spark_sinks.source)."""
    assert nats.url is not None
    options = {"servers": nats.url, "topics": ",".join(topics)}
    if schema is not None:
        if not isinstance(schema, str):
            payload_columns(schema)  # fail here, not in a worker, on an unmappable field
            schema = struct_path(schema)
        options["schema"] = schema
    if max_rows_per_batch is not None:
        options["max_rows_per_batch"] = str(max_rows_per_batch)
    if parallelism is not None:
        options["parallelism"] = str(parallelism)
    for name in AUTH_OPTIONS:
        value = getattr(nats, name)
        if value is not None:
            options[name] = value
    return options


def _new_progress(topic: str, query: StreamingQuery, seen: dict[str, int]) -> list[BatchProgress]:
    found = []
    for progress in query.recentProgress:
        batch_id = int(progress["batchId"])
        # An idle trigger reports a progress with no rows under the next batch's id; only
        # batches that moved rows are reported (and the real batch keeps its id).
        rows = int(progress["numInputRows"])
        if batch_id <= seen[topic] or not rows or not progress.get("sources"):
            continue
        seen[topic] = batch_id
        source = progress["sources"][0]
        stream = topic_stream(topic)
        found.append(
            BatchProgress(
                topic=topic,
                batch_id=batch_id,
                rows=rows,
                end_seq=_seq(source.get("endOffset"), stream) or 0,
                head_seq=_seq(source.get("latestOffset"), stream),
                seconds=int(progress.get("batchDuration", 0)) / 1000,
            )
        )
    return found


def _seq(offset: Any, stream: str) -> int | None:
    if isinstance(offset, str):
        offset = json.loads(offset)
    if isinstance(offset, dict) and stream in offset:
        return int(offset[stream])
    return None


async def _ensure_streams(nats: NatsConfig, topics: list[str]) -> None:
    """Declare the topic streams, so a topic nothing was committed to yet reads as empty."""
    from spark_sinks.jetstream_read import connect
    from txactors.topics import ensure_topic_stream

    nc = await connect(nats)
    try:
        for topic in topics:
            await ensure_topic_stream(nc.jetstream(), topic)
    finally:
        await nc.close()
