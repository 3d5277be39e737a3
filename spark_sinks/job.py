"""The sink job: one streaming query per topic, from its stream into its Parquet store.

    spark = local_session(Path("warehouse"))
    run_sink(spark, Path("warehouse"), {"transfers": Transfer}, nats=NatsConfig(url=…))
    spark.sql("select event_date, sum(amount) from transfers group by event_date").show()

Exactly once comes from Spark, not from us: each query checkpoints its offsets (stream
sequences) before a batch and the file sink appends the batch's files to `_spark_metadata`
only when they are all written; a rerun resumes at the last committed batch and rewrites
exactly that batch, from the same sequences. A run killed mid-batch can leave part files
that no commit names: readers through Spark (the tables, `spark.read.parquet`) never see
them; a reader that lists the directory itself (pyarrow, DuckDB, Hive) would (docs/spark.md).

Before any query starts, `plan` (spark_sinks.planning) settles what can be settled without
Spark; what a run reports is in spark_sinks.progress. Both are importable from here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from spark_sinks.catalog import PARTITION_COLUMNS, register_tables, store_dir
from spark_sinks.errors import SinkError
from spark_sinks.jetstream_read import AUTH_OPTIONS
from spark_sinks.planning import Plan, Schema, TopicPlan, plan, struct_path_of
from spark_sinks.progress import (
    STILL_RUNNING_EVERY,
    BatchProgress,
    BatchRunning,
    BatchStarted,
    CaughtUp,
    Progress,
    ProgressCallback,
    ProgressWatch,
    Skipped,
)
from spark_sinks.source import (
    FAIL_ON_DATA_LOSS,
    MAX_OFFSETS_PER_TRIGGER,
    SOURCE_NAME,
    STARTING_OFFSETS,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from txactors.nats.config import NatsConfig

__all__ = [
    "PARTITION_COLUMNS",
    "POLL_INTERVAL",
    "STILL_RUNNING_EVERY",
    "BatchProgress",
    "BatchRunning",
    "BatchStarted",
    "CaughtUp",
    "Plan",
    "Progress",
    "ProgressCallback",
    "Schema",
    "Skipped",
    "TopicPlan",
    "plan",
    "run_sink",
    "source_options",
]

POLL_INTERVAL: Final = 0.5


def run_sink(
    spark: SparkSession,
    warehouse: Path,
    topics: Mapping[str, Schema] | Plan,
    *,
    nats: NatsConfig,
    once: bool = True,
    interval: float = 10.0,
    checkpoint_location: Path | None = None,
    starting_offsets: str | None = None,
    fail_on_data_loss: bool = True,
    max_offsets_per_trigger: int | None = None,
    parallelism: int | None = None,
    on_progress: ProgressCallback | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Sink `topics` into `warehouse`; returns the rows written by this run.

    `once`: catch up with every stream and return (availableNow); a topic already caught up
    starts no query. Otherwise run micro-batches every `interval` seconds until `stop` is set
    (or KeyboardInterrupt). `topics` may be a `plan` made earlier with the same options.
    `nats.url` must name the server (the source runs in other processes).
    """
    planned = (
        topics
        if isinstance(topics, Plan)
        else plan(
            warehouse,
            topics,
            nats=nats,
            checkpoint_location=checkpoint_location,
            starting_offsets=starting_offsets,
            fail_on_data_loss=fail_on_data_loss,
        )
    )
    emit = on_progress or (lambda _: None)
    for message in planned.skipped:
        emit(Skipped(message))
    options = {
        FAIL_ON_DATA_LOSS: str(fail_on_data_loss).lower(),
        MAX_OFFSETS_PER_TRIGGER: max_offsets_per_trigger,
        "parallelism": parallelism,
    }
    work = [t for t in planned.topics if not (once and t.caught_up)]
    queries = {
        t.topic: _start(spark, planned.warehouse, t, nats, once, interval, options) for t in work
    }
    watch = ProgressWatch(planned, queries, emit, waiting=not once)
    try:
        while queries and not (stop is not None and stop.is_set()):
            watch.poll()
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
            raise _own_error(error) or error
    watch.poll()  # batches that finished after the last poll
    register_tables(spark, planned.warehouse, {t.topic: t.schema for t in planned.topics})
    if once:
        emit(CaughtUp(watch.seqs(), waiting=False))
    return watch.rows


def _start(
    spark: SparkSession,
    warehouse: Path,
    topic: TopicPlan,
    nats: NatsConfig,
    once: bool,
    interval: float,
    extra: Mapping[str, object],
) -> StreamingQuery:
    options = source_options(nats, [topic.topic], topic.struct_path)
    options[STARTING_OFFSETS] = json.dumps(topic.start)
    options.update({k: str(v) for k, v in extra.items() if v is not None})
    writer = (
        spark.readStream.format(SOURCE_NAME)
        .options(**options)
        .load()
        .writeStream.format("parquet")
        .queryName(f"txactors_sink_{topic.topic}")
        .option("path", str(store_dir(warehouse, topic.topic)))
        .option("checkpointLocation", str(topic.checkpoint))
        .partitionBy(*PARTITION_COLUMNS)
        .outputMode("append")
    )
    writer = (
        writer.trigger(availableNow=True)
        if once
        else writer.trigger(processingTime=f"{interval} seconds")
    )
    return writer.start()


def source_options(nats: NatsConfig, topics: list[str], schema: Schema = None) -> dict[str, str]:
    """Options for `spark.readStream.format("txactors")`: servers, topics, schema and auth."""
    assert nats.url is not None
    options = {"servers": nats.url, "topics": ",".join(topics)}
    path = struct_path_of(schema)
    if path is not None:
        options["schema"] = path
    for name in AUTH_OPTIONS:
        value = getattr(nats, name)
        if value is not None:
            options[name] = value
    return options


def _own_error(error: BaseException) -> SinkError | None:
    """Our error raised in the source's Python process, out of Spark's wrapping, as one line.

    Spark hands back a StreamingQueryException whose text holds the Python traceback; its
    last line is `spark_sinks.errors.<Class>: <message>`.
    """
    from spark_sinks import errors

    text = str(error)
    for name in ("DataLoss", "StreamMissing", "SchemaError", "SinkError"):
        marker = f"spark_sinks.errors.{name}: "
        at = text.rfind(marker)
        if at >= 0:
            message = text[at + len(marker) :].splitlines()[0].strip()
            found: SinkError = getattr(errors, name)(message)
            return found
    return None
