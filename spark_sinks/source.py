"""The `txactors` streaming data source: committed topic streams as a Spark stream.

    spark.dataSource.register(TxactorsDataSource)
    df = (spark.readStream.format("txactors")
          .option("servers", "nats://127.0.0.1:4222").option("topics", "transfers")
          .option("schema", "apps.transfer.messages:Transfer").load())

Offsets are JetStream stream sequences, one per stream, with the stream's creation time:
`{"TOPIC_transfers": {"seq": 1200, "created": "…"}}` means "everything up to sequence 1200 of
the stream created then is in earlier batches". A topic stream only grows and its messages
never change, so re-reading a range after a crash gives the same rows: that, with Spark's
checkpoint and the file sink's commit log, is what makes the sink exactly once. A stream
deleted and created again under the same name is another stream (offsets.py).

Spark pickles the reader and runs `read` in Python workers, and `latestOffset` in a separate
driver-side Python process: so the reader holds only plain options, and every call opens its
own NATS connection (jetstream_read).

Options (keys are case-insensitive; Spark lower-cases them), named as Kafka's source names them
where they mean the same:
    servers                NATS URL(s), comma separated (required)
    topics                 topic names, comma separated (required); each stream must exist
    schema                 `module:Struct` for the payload; omitted → a raw `payload` column
    startingOffsets        earliest (default) | latest | {"topic": first seq, ...} (offsets.py)
    failOnDataLoss         true (default): purged sequences or a stream created again fail
                           the query; false: skip them / read the new stream, and log it once
    maxOffsetsPerTrigger   upper bound on sequences per micro-batch (default: no bound)
    parallelism            input partitions a batch is split into at most (default 2)
    user, password, token, creds_file, nkeys_seed, tls_ca, tls_cert, tls_key: NATS auth
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import pyarrow as pa  # type: ignore[import-untyped]
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from spark_sinks.errors import DataLoss, SinkError
from spark_sinks.jetstream_read import (
    AUTH_OPTIONS,
    Bounds,
    fetch_range,
    nats_config,
    run_sync,
    stream_bounds,
)
from spark_sinks.offsets import (
    Replaced,
    Starting,
    StreamPosition,
    data_loss_error,
    decode_offset,
    encode_offset,
    first_to_read,
    head_positions,
    initial_offsets,
    losses,
    parse_starting,
    replaced,
    require,
)
from spark_sinks.schema import BatchBuilder, load_struct, spark_schema
from txactors.wire.layout import topic_stream, validate_name

SOURCE_NAME: Final = "txactors"
STARTING_OFFSETS: Final = "startingOffsets"
FAIL_ON_DATA_LOSS: Final = "failOnDataLoss"
MAX_OFFSETS_PER_TRIGGER: Final = "maxOffsetsPerTrigger"
DEFAULT_PARALLELISM: Final = 2
MIN_PARTITION_SIZE: Final = 5_000
"""Sequences below which splitting a range further costs more (a connection and a consumer
per partition) than reading it in parallel saves."""

_log = logging.getLogger("spark_sinks.source")


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The parsed options; plain data, so the reader pickles to workers."""

    topics: tuple[str, ...]
    schema: str | None
    nats: dict[str, str]
    starting: Starting
    fail_on_data_loss: bool
    max_offsets_per_trigger: int | None
    parallelism: int

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        opts = {k.lower(): v for k, v in options.items()}
        topics = tuple(t.strip() for t in opts.get("topics", "").split(",") if t.strip())
        if not topics:
            raise SinkError("the txactors source needs option 'topics' (comma separated)")
        for topic in topics:
            validate_name("topic", topic)
        if not opts.get("servers"):
            raise SinkError("the txactors source needs option 'servers' (the NATS URL)")
        return cls(
            topics=topics,
            schema=opts.get("schema") or None,
            nats={k: v for k, v in opts.items() if k in AUTH_OPTIONS or k == "servers"},
            starting=parse_starting(opts.get(STARTING_OFFSETS.lower()), topics),
            fail_on_data_loss=_boolean(opts, FAIL_ON_DATA_LOSS, default=True),
            max_offsets_per_trigger=_positive(opts, MAX_OFFSETS_PER_TRIGGER),
            parallelism=_positive(opts, "parallelism") or DEFAULT_PARALLELISM,
        )


def _boolean(opts: Mapping[str, str], name: str, *, default: bool) -> bool:
    raw = opts.get(name.lower())
    if raw is None or raw == "":
        return default
    if raw.strip().lower() not in ("true", "false"):
        raise SinkError(f"option {name!r} must be true or false, not {raw!r}")
    return raw.strip().lower() == "true"


def _positive(opts: Mapping[str, str], name: str) -> int | None:
    raw = opts.get(name.lower())
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SinkError(f"option {name!r} must be a positive integer, not {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class SequenceRange(InputPartition):
    """One input partition: sequences [first, last] of one topic's stream."""

    topic: str
    first: int
    last: int


class TxactorsDataSource(DataSource):
    """Registered under the short name `txactors`; streaming reads only."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        parsed = SourceOptions.parse(self.options)
        return spark_schema(load_struct(parsed.schema) if parsed.schema else None)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return TxactorsStreamReader(SourceOptions.parse(self.options))


class TxactorsStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are {stream: StreamPosition.encode()}: the last sequence read, and the creation
    time of the stream it was read from, so a stream created again is not taken for the one
    that was read (offsets.losses)."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.streams = [topic_stream(t) for t in options.topics]
        self._target: dict[str, int] | None = None
        self._reported: set[tuple[object, ...]] = set()  # Loss keys already logged

    def prepareForTriggerAvailableNow(self) -> None:
        """availableNow: read up to today's heads in batches of maxOffsetsPerTrigger, then stop.

        (Without this, Spark asks a Python source for everything in one batch.)
        """
        self._target = {s: p.seq for s, p in self._heads(self._bounds()).items()}

    def initialOffset(self) -> dict[str, Any]:
        """Where a query without a checkpoint starts: `startingOffsets` against the streams."""
        return encode_offset(
            initial_offsets(self.options.starting, self.options.topics, self._bounds())
        )

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: ReadLimit | None = None
    ) -> dict[str, Any]:
        """The streams' heads, at most `limit` sequences past `start` (maxOffsetsPerTrigger
        comes back as the limit, via getDefaultReadLimit); Spark < 4.2 passes neither.

        Planning a batch is where lost sequences are noticed, as Kafka's source does: with
        failOnDataLoss they fail the query before the batch is written to the checkpoint.
        A stream created again is read from its beginning.
        """
        bounds = self._bounds()
        heads = self._heads(bounds)
        if self._target is not None:
            heads = {
                s: StreamPosition(min(p.seq, self._target.get(s, 0)), p.created)
                for s, p in heads.items()
            }
        if start is None:
            return encode_offset(heads)
        begun = self._positions(start)
        found = losses(self.options.topics, begun, bounds)
        if found and self.options.fail_on_data_loss:
            raise DataLoss(data_loss_error(found))
        anew = {topic_stream(loss.topic) for loss in found if isinstance(loss, Replaced)}
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = {}
        for stream in self.streams:
            now = heads[stream]
            begin = 0 if stream in anew else begun[stream].seq
            head = max(now.seq, begin)
            if budget is not None:
                head = min(head, begin + budget)
                budget -= head - begin
            end[stream] = StreamPosition(head, now.created)
        return encode_offset(end)

    def getDefaultReadLimit(self) -> ReadLimit:
        rows = self.options.max_offsets_per_trigger
        return ReadMaxRows(rows) if rows is not None else ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, Any]:
        return encode_offset(self._heads(self._bounds()))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[SequenceRange]:
        """The batch's sequence ranges; what the streams lost since `start` is said here, once
        (or fails the query): every batch passes here, also one re-run after a crash."""
        begun, until = self._positions(start), self._positions(end)
        bounds = self._bounds()
        found = losses(self.options.topics, begun, bounds)
        if found and self.options.fail_on_data_loss:
            raise DataLoss(data_loss_error(found))
        for loss in found:
            if loss.key not in self._reported:
                self._reported.add(loss.key)
                _log.warning("%s", loss.skipping())
        ranges = []
        for topic, stream in zip(self.options.topics, self.streams, strict=True):
            held = bounds.get(stream)
            if held is not None and replaced(until[stream], held.created, held.last):
                continue  # planned on a stream replaced since: the next batch reads the new one
            first = first_to_read(begun[stream], until[stream])
            ranges += split_range(topic, first, until[stream].seq, self.options.parallelism)
        return ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SequenceRange)
        struct = load_struct(self.options.schema) if self.options.schema else None
        builder = BatchBuilder(partition.topic, struct)
        config = nats_config(self.options.nats)
        chunks = fetch_range(config, partition.topic, partition.first, partition.last)
        for chunk in run_sync(chunks):
            yield builder.build(chunk)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: the source holds no consumer between batches."""

    def _positions(self, offset: Mapping[str, Any]) -> dict[str, StreamPosition]:
        found = decode_offset(offset)
        return {s: found.get(s, StreamPosition(0)) for s in self.streams}

    def _bounds(self) -> dict[str, Bounds | None]:
        return asyncio.run(stream_bounds(nats_config(self.options.nats), self.streams))

    def _heads(self, bounds: Mapping[str, Bounds | None]) -> dict[str, StreamPosition]:
        """Each stream's last sequence; a stream gone while the query runs is an error."""
        found = {
            s: require(bounds, s, t) for s, t in zip(self.streams, self.options.topics, strict=True)
        }
        return head_positions(found)


def split_range(topic: str, first: int, last: int, parallelism: int) -> list[SequenceRange]:
    """[first, last] in up to `parallelism` near-equal parts of at least MIN_PARTITION_SIZE."""
    count = last - first + 1
    if count <= 0:
        return []
    parts = max(1, min(parallelism, count // MIN_PARTITION_SIZE))
    size = math.ceil(count / parts)
    return [
        SequenceRange(topic, lo, min(lo + size - 1, last)) for lo in range(first, last + 1, size)
    ]


def register(spark: Any) -> None:
    """Make `spark.readStream.format("txactors")` available in this session."""
    spark.dataSource.register(TxactorsDataSource)
