"""Before Spark starts: what each topic's query will do, settled without a JVM.

`plan` checks schemas, that each stream exists, purged sequences and where each query
stands, so a mistake is one line and a run with nothing new needs no JVM (spark_sinks.cli).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from spark_sinks.catalog import checkpoint_dir, default_checkpoints, needs_registering
from spark_sinks.checkpoint import PinnedStart, Position, pin_start, pinned_start, position
from spark_sinks.errors import DataLoss, SinkError
from spark_sinks.jetstream_read import Bounds, stream_bounds
from spark_sinks.offsets import (
    Loss,
    Replaced,
    StreamPosition,
    as_starting,
    data_loss_error,
    initial_offsets,
    losses,
    parse_starting,
    replaced,
    require,
)
from spark_sinks.schema import load_struct, payload_columns, spark_schema, struct_path
from txactors.wire.layout import topic_stream

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

    from txactors.nats.config import NatsConfig

Schema = type[msgspec.Struct] | str | None
"""A topic's payload type: a Struct, its `module:Name` path, or None for raw bytes."""


@dataclass(frozen=True, slots=True)
class TopicPlan:
    topic: str
    struct_path: str | None
    schema: StructType
    checkpoint: Path
    start: dict[str, int]  # the pinned startingOffsets: {topic: first sequence to read}
    position: Position
    bounds: Bounds
    start_created: str | None = None  # the stream `start` was resolved against

    @property
    def read(self) -> StreamPosition:
        """The last sequence in a committed batch and the stream it was read from; for a new
        query, the one before its start, on the stream the start was resolved against."""
        committed = self.position.committed
        if committed is not None:
            return committed.get(topic_stream(self.topic), StreamPosition(0))
        return StreamPosition(self.start[self.topic] - 1, self.start_created)

    @property
    def never_ran(self) -> bool:
        """No batch of this query was ever planned: Spark holds nothing of it yet."""
        return self.position.committed is None and self.position.planned is None

    @property
    def read_up_to(self) -> int:
        return self.read.seq

    @property
    def caught_up(self) -> bool:
        """Nothing for Spark to do: no batch pending, the stream read is this one, and read
        to its end. A checkpoint from before the stream's identity was kept is not caught up:
        one batch records it."""
        read = self.read
        if self.position.committed is not None and read.created is None:
            return False
        return (
            self.position.planned is None
            and not replaced(read, self.bounds.created, self.bounds.last)
            and read.seq >= self.bounds.last
        )


@dataclass(frozen=True, slots=True)
class Plan:
    warehouse: Path
    topics: list[TopicPlan]
    skipped: list[str] = field(default_factory=list)  # queries moved to a new stream: to say

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
    last run or a stream deleted and created again (unless `fail_on_data_loss` is off: then
    the source says what it skips, once, when it plans the batch). A new query's
    `startingOffsets` are resolved and pinned in its checkpoint (`pin`), so a rerun of its
    first batch starts at the same place; a query that never ran whose stream was created
    again since is started on the new stream instead, from its first sequence, and `skipped`
    says so (the source never sees that start).
    """
    if nats.url is None:
        raise SinkError("the sink needs a NATS URL; start the embedded server first")
    warehouse = warehouse.resolve()
    checkpoints = (checkpoint_location or default_checkpoints(warehouse)).resolve()
    paths = {topic: struct_path_of(schema) for topic, schema in topics.items()}
    schemas = {topic: _schema_of(path) for topic, path in paths.items()}
    starting = parse_starting(starting_offsets, list(topics))
    streams = [topic_stream(t) for t in topics]
    bounds = asyncio.run(stream_bounds(nats, streams))
    plans = []
    found: list[Loss] = []
    skipped: list[str] = []
    for topic in topics:
        stream = topic_stream(topic)
        held = require(bounds, stream, topic)
        checkpoint = checkpoint_dir(checkpoints, topic)
        pinned = pinned_start(checkpoint)
        if pinned is None:
            fresh = initial_offsets(_for(starting, topic), [topic], bounds)
            pinned = PinnedStart(as_starting(fresh, [topic]), held.created)
            if pin:
                pin_start(checkpoint, pinned)
        topic_plan = TopicPlan(
            topic, paths[topic], schemas[topic], checkpoint, pinned.start, position(checkpoint),
            held, pinned.created,
        )  # fmt: skip
        lost = losses([topic], {stream: topic_plan.read}, bounds)
        anew = [loss for loss in lost if isinstance(loss, Replaced)]
        if anew and topic_plan.never_ran and not fail_on_data_loss:
            pinned = PinnedStart({topic: max(held.first, 1)}, held.created)
            if pin:
                pin_start(checkpoint, pinned)
            topic_plan = replace(topic_plan, start=pinned.start, start_created=pinned.created)
            skipped += [loss.skipping() for loss in anew]
        else:
            found += lost
        plans.append(topic_plan)
    if found and fail_on_data_loss:
        raise DataLoss(data_loss_error(found))
    return Plan(warehouse, plans, skipped)


def _for(starting: str | dict[str, int], topic: str) -> str | dict[str, int]:
    return starting if isinstance(starting, str) else {topic: starting[topic]}


def struct_path_of(schema: Schema) -> str | None:
    if schema is None or isinstance(schema, str):
        return schema
    return struct_path(schema)


def _schema_of(path: str | None) -> StructType:
    """The query's schema; imports and maps the Struct here, not in a worker, so it fails early."""
    struct = load_struct(path) if path is not None else None
    if struct is not None:
        payload_columns(struct)
    return spark_schema(struct)
