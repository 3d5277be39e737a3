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

Before any query starts, `plan` settles what can be settled without Spark (schemas, that each
stream exists, purged sequences, where each query stands), so a mistake is one line and a
run with nothing new needs no JVM (spark_sinks.cli).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from spark_sinks.catalog import (
    PARTITION_COLUMNS,
    checkpoint_dir,
    default_checkpoints,
    needs_registering,
    register_tables,
    store_dir,
)
from spark_sinks.checkpoint import Position, pin_start, pinned_start, position
from spark_sinks.errors import DataLoss, SinkError
from spark_sinks.jetstream_read import AUTH_OPTIONS, Bounds, stream_bounds
from spark_sinks.offsets import (
    as_starting,
    check_not_rewound,
    data_loss_error,
    initial_offsets,
    lost,
    parse_starting,
    require,
)
from spark_sinks.schema import load_struct, payload_columns, spark_schema, struct_path
from spark_sinks.source import (
    FAIL_ON_DATA_LOSS,
    MAX_OFFSETS_PER_TRIGGER,
    SOURCE_NAME,
    STARTING_OFFSETS,
)
from txactors.layout import topic_stream

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery
    from pyspark.sql.types import StructType

    from txactors.config import NatsConfig

POLL_INTERVAL: Final = 0.5
STILL_RUNNING_EVERY: Final = 15.0
"""Seconds between "still reading" lines while one batch runs."""

Schema = type[msgspec.Struct] | str | None
"""A topic's payload type: a Struct, its `module:Name` path, or None for raw bytes."""


# -- what a run reports ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchStarted:
    """A micro-batch was planned: it reads sequences [first, last] of the topic's stream."""

    topic: str
    batch_id: int
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class BatchRunning:
    """A batch still runs after `seconds` (sent every STILL_RUNNING_EVERY seconds)."""

    topic: str
    batch_id: int
    seconds: float


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """One finished micro-batch of one topic."""

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


@dataclass(frozen=True, slots=True)
class CaughtUp:
    """Every topic has read its stream to `seqs` (topic → last sequence read)."""

    seqs: dict[str, int]
    waiting: bool  # a continuous run waits for more; a catch-up run is done


@dataclass(frozen=True, slots=True)
class Skipped:
    """Sequences purged before they were read, skipped because failOnDataLoss is off."""

    message: str


Progress = BatchStarted | BatchRunning | BatchProgress | CaughtUp | Skipped
ProgressCallback = Callable[[Progress], None]


# -- before Spark: what each topic's query will do -------------------------------------------


@dataclass(frozen=True, slots=True)
class TopicPlan:
    topic: str
    struct_path: str | None
    schema: StructType
    checkpoint: Path
    start: dict[str, int]  # the pinned startingOffsets: {topic: first sequence to read}
    position: Position
    bounds: Bounds

    @property
    def read_up_to(self) -> int:
        """The last sequence in a committed batch (or before the start, for a new query)."""
        committed = self.position.committed
        if committed is not None:
            return committed.get(topic_stream(self.topic), 0)
        return self.start[self.topic] - 1

    @property
    def caught_up(self) -> bool:
        return self.position.planned is None and self.read_up_to >= self.bounds.last


@dataclass(frozen=True, slots=True)
class Plan:
    warehouse: Path
    topics: list[TopicPlan]
    skipped: list[str] = field(default_factory=list)  # data loss let through, to report

    @property
    def caught_up(self) -> bool:
        return all(t.caught_up for t in self.topics)

    def needs_registering(self) -> bool:
        return any(needs_registering(self.warehouse, t.topic, t.schema) for t in self.topics)

    def seqs(self) -> dict[str, int]:
        return {t.topic: t.read_up_to for t in self.topics}


def plan(
    warehouse: Path,
    topics: Mapping[str, Schema],
    *,
    nats: NatsConfig,
    checkpoint_location: Path | None = None,
    starting_offsets: str | None = None,
    fail_on_data_loss: bool = True,
    pin: bool = True,
) -> Plan:
    """Check everything that can fail before Spark starts, and say where each query stands.

    SchemaError for a Struct that will not import or map, StreamMissing for a topic without a
    stream (never created here: the sink only reads), DataLoss for sequences purged since the
    last run (unless `fail_on_data_loss` is off). A new query's `startingOffsets` are resolved
    and pinned in its checkpoint (`pin`), so a rerun of its first batch starts at the same place.
    """
    if nats.url is None:
        raise ValueError("the sink needs a NATS URL; start the embedded server first")
    warehouse = warehouse.resolve()
    checkpoints = (checkpoint_location or default_checkpoints(warehouse)).resolve()
    paths = {topic: _struct_path(schema) for topic, schema in topics.items()}
    schemas = {topic: _schema_of(path) for topic, path in paths.items()}
    starting = parse_starting(starting_offsets, list(topics))
    streams = [topic_stream(t) for t in topics]
    bounds = asyncio.run(stream_bounds(nats, streams))
    plans = []
    losses = []
    for topic in topics:
        stream = topic_stream(topic)
        held = require(bounds, stream, topic)
        checkpoint = checkpoint_dir(checkpoints, topic)
        start = pinned_start(checkpoint)
        if start is None:
            fresh = initial_offsets(_for(starting, topic), [topic], bounds)
            start = as_starting(fresh, [topic])
            if pin:
                pin_start(checkpoint, start)
        topic_plan = TopicPlan(
            topic, paths[topic], schemas[topic], checkpoint, start, position(checkpoint), held
        )
        read = {stream: topic_plan.read_up_to}
        check_not_rewound(read, bounds)
        losses += lost(read, bounds)
        plans.append(topic_plan)
    if losses and fail_on_data_loss:
        raise DataLoss(data_loss_error(losses))
    return Plan(warehouse, plans, [f"{loss.describe()}; skipped" for loss in losses])


def _for(starting: str | dict[str, int], topic: str) -> str | dict[str, int]:
    return starting if isinstance(starting, str) else {topic: starting[topic]}


def _struct_path(schema: Schema) -> str | None:
    if schema is None or isinstance(schema, str):
        return schema
    return struct_path(schema)


def _schema_of(path: str | None) -> StructType:
    """The query's schema; imports and maps the Struct here, not in a worker, so it fails early."""
    struct = load_struct(path) if path is not None else None
    if struct is not None:
        payload_columns(struct)
    return spark_schema(struct)


# -- the run ---------------------------------------------------------------------------------


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
    watch = _Watch(planned, queries, emit, waiting=not once)
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
    path = _struct_path(schema)
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


class _Watch:
    """Turns the queries' checkpoints and progress into Progress events, as the run polls."""

    def __init__(
        self,
        planned: Plan,
        queries: Mapping[str, StreamingQuery],
        emit: ProgressCallback,
        *,
        waiting: bool,
    ) -> None:
        self.plans = {t.topic: t for t in planned.topics}
        self.queries = queries
        self.emit = emit
        self.waiting = waiting
        self.rows = 0
        self.read = {t.topic: t.read_up_to for t in planned.topics}
        self.heads = {t.topic: t.bounds.last for t in planned.topics}
        self.finished = {t.topic: t.position.committed_batch or -1 for t in planned.topics}
        self.running: dict[str, tuple[int, float, float]] = {}  # batch, since, last said
        self.idle_said = False

    def seqs(self) -> dict[str, int]:
        return dict(self.read)

    def poll(self) -> None:
        now = time.monotonic()
        for topic, query in self.queries.items():
            self._finished_batches(topic, query)
            self._running_batch(topic, now)
        if self.waiting and not self.running and not self.idle_said and self._all_caught_up():
            self.idle_said = True
            self.emit(CaughtUp(self.seqs(), waiting=True))

    def _running_batch(self, topic: str, now: float) -> None:
        checkpoint = self.plans[topic].checkpoint
        where = position(checkpoint)
        batch = where.planned_batch
        if batch is None or batch <= self.finished[topic] or where.planned is None:
            self.running.pop(topic, None)
            return
        if topic not in self.running or self.running[topic][0] != batch:
            stream = topic_stream(topic)
            first = (where.committed or {}).get(stream, self.read[topic]) + 1
            last = where.planned.get(stream, first - 1)
            self.running[topic] = (batch, now, now)
            self.idle_said = False
            if last >= first:
                self.emit(BatchStarted(topic, batch, first, last))
            return
        _, since, said = self.running[topic]
        if now - said >= STILL_RUNNING_EVERY:
            self.running[topic] = (batch, since, now)
            self.emit(BatchRunning(topic, batch, now - since))

    def _finished_batches(self, topic: str, query: StreamingQuery) -> None:
        stream = topic_stream(topic)
        for progress in query.recentProgress:
            batch_id = int(progress["batchId"])
            source = (progress.get("sources") or [{}])[0]
            head = _seq(source.get("latestOffset"), stream)
            if head is not None:
                self.heads[topic] = head
            # An idle trigger reports a progress with no rows under the next batch's id; only
            # batches that moved rows are reported (and the real batch keeps its id).
            end = _seq(source.get("endOffset"), stream)
            read_before = self.read[topic]
            if end is not None:
                self.read[topic] = max(self.read[topic], end)
            rows = int(progress["numInputRows"])
            if batch_id <= self.finished[topic] or not rows:
                continue
            self.finished[topic] = batch_id
            seen = self.running.pop(topic, None)
            if seen is None or seen[0] != batch_id:  # it ran between two polls: say it started
                start = _seq(source.get("startOffset"), stream)
                first = (read_before if start is None else start) + 1
                self.emit(BatchStarted(topic, batch_id, first, end or first + rows - 1))
            self.idle_said = False
            self.rows += rows
            self.emit(
                BatchProgress(
                    topic=topic,
                    batch_id=batch_id,
                    rows=rows,
                    end_seq=end or 0,
                    head_seq=head,
                    seconds=int(progress.get("batchDuration", 0)) / 1000,
                )
            )

    def _all_caught_up(self) -> bool:
        return all(self.read[t] >= self.heads[t] for t in self.queries)


def _seq(offset: Any, stream: str) -> int | None:
    if isinstance(offset, str):
        offset = json.loads(offset)
    if isinstance(offset, dict) and stream in offset:
        return int(offset[stream])
    return None
