"""The `txactors` streaming data source: committed topic streams as a Spark stream.

    spark.dataSource.register(TxactorsDataSource)
    df = (spark.readStream.format("txactors")
          .option("servers", "nats://127.0.0.1:4222").option("topics", "transfers")
          .option("schema", "apps.transfer.messages:Transfer").load())

Offsets are JetStream stream sequences, one per stream: `{"TOPIC_transfers": 1200}` means
"everything up to sequence 1200 is in earlier batches". A topic stream only grows and its
messages never change, so re-reading a range after a crash gives the same rows: that, with
Spark's checkpoint and the file sink's commit log, is what makes the sink exactly once.

Spark pickles the reader and runs `read` in Python workers, and `latestOffset` in a separate
driver-side Python process: so the reader holds only plain options, and every call opens its
own NATS connection (jetstream_read).

Options (keys are case-insensitive; Spark lower-cases them):
    servers             NATS URL(s), comma separated (required)
    topics              topic names, comma separated (required)
    schema              `module:Struct` for the payload; omitted → a raw `payload` column
    max_rows_per_batch  upper bound on sequences per micro-batch (default: no bound)
    parallelism         input partitions a batch is split into at most (default 2)
    user, password, token, creds_file, nkeys_seed, tls_ca, tls_cert, tls_key: NATS auth
"""

from __future__ import annotations

import asyncio
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

from spark_sinks.errors import SinkError
from spark_sinks.jetstream_read import fetch_range, nats_config, run_sync, stream_heads
from spark_sinks.schema import BatchBuilder, load_struct, spark_schema
from txactors.layout import topic_stream, validate_name

SOURCE_NAME: Final = "txactors"
DEFAULT_PARALLELISM: Final = 2
MIN_PARTITION_SIZE: Final = 5_000
"""Sequences below which splitting a range further costs more (a connection and a consumer
per partition) than reading it in parallel saves."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The parsed options; plain data, so the reader pickles to workers."""

    topics: tuple[str, ...]
    schema: str | None
    nats: dict[str, str]
    max_rows_per_batch: int | None
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
        max_rows = _positive(opts, "max_rows_per_batch")
        parallelism = _positive(opts, "parallelism") or DEFAULT_PARALLELISM
        return cls(
            topics=topics,
            schema=opts.get("schema") or None,
            nats={k: v for k, v in opts.items() if k not in _NOT_NATS},
            max_rows_per_batch=max_rows,
            parallelism=parallelism,
        )


_NOT_NATS: Final = frozenset({"topics", "schema", "max_rows_per_batch", "parallelism", "path"})


def _positive(opts: Mapping[str, str], name: str) -> int | None:
    raw = opts.get(name)
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
    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.streams = [topic_stream(t) for t in options.topics]
        self._target: dict[str, int] | None = None

    def prepareForTriggerAvailableNow(self) -> None:
        """availableNow: read up to today's heads in batches of max_rows_per_batch, then stop.

        (Without this, Spark asks a Python source for everything in one batch.)
        """
        self._target = self._heads()

    def initialOffset(self) -> dict[str, int]:
        return dict.fromkeys(self.streams, 0)

    def latestOffset(
        self, start: dict[str, int] | None = None, limit: ReadLimit | None = None
    ) -> dict[str, int]:
        """The streams' heads, at most `limit` sequences past `start` (max_rows_per_batch
        comes back as the limit, via getDefaultReadLimit); Spark < 4.2 passes neither."""
        heads = self._heads()
        if self._target is not None:
            heads = {s: min(seq, self._target.get(s, 0)) for s, seq in heads.items()}
        if start is None:
            return heads
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = {}
        for stream in self.streams:
            begin = int(start.get(stream, 0))
            head = max(heads[stream], begin)
            if budget is not None:
                head = min(head, begin + budget)
                budget -= head - begin
            end[stream] = head
        return end

    def getDefaultReadLimit(self) -> ReadLimit:
        rows = self.options.max_rows_per_batch
        return ReadMaxRows(rows) if rows is not None else ReadAllAvailable()

    def reportLatestOffset(self) -> dict[str, int]:
        return self._heads()

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[SequenceRange]:
        ranges = []
        for topic, stream in zip(self.options.topics, self.streams, strict=True):
            first, last = int(start.get(stream, 0)) + 1, int(end.get(stream, 0))
            ranges += split_range(topic, first, last, self.options.parallelism)
        return ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, SequenceRange)
        struct = load_struct(self.options.schema) if self.options.schema else None
        builder = BatchBuilder(partition.topic, struct)
        config = nats_config(self.options.nats)
        chunks = fetch_range(config, partition.topic, partition.first, partition.last)
        for chunk in run_sync(chunks):
            yield builder.build(chunk)

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release: the source holds no consumer between batches."""

    def _heads(self) -> dict[str, int]:
        return asyncio.run(stream_heads(nats_config(self.options.nats), self.streams))


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
