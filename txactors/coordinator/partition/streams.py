"""The coordinator's streams (DESIGN §4). Each partition's log stands alone: its halves
(`txn.half.<p>`: halves.py, packs.py) and its op records (`txn.op.<p>`: checkpoints.py) in
one stream of its own, `TXN_LOG_<p>`, file-backed (a decision is durable when JetStream
acknowledged it), declared by the coordinator that takes the partition
(`ensure_partition_streams`). On a cluster each log is a raft group of its own with its
leader on any node, so a node loss pauses only the partitions whose logs it led, and the
writes of many partitions go to many leaders. What every partition shares is declared once
per process (`ensure_streams`): TXN_DISCARD and the checkpoint bucket.

One stream per partition, not one for its halves and one for its op records: a partition
serves only while both have a leader, and two streams elect theirs apart, so a node loss
would pause every partition that had either led there (up to twice as many) and a cluster
would run twice as many raft groups. Readers filter by subject, and every sequence the
partition keeps (checkpoint, op floor, fence) is a position in the one stream, so nothing
else changes: the two subjects' records interleave, each read skips the other's.
"""

from __future__ import annotations

from typing import Final

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.kv import KeyValue

from txactors.nats.topics import DECLARE_DEADLINE, declare_stream, ensure_bucket
from txactors.wire import layout

DEDUPE_WINDOW: Final = 120.0
"""Seconds JetStream remembers a `Nats-Msg-Id`: covers a retried append after a timeout."""


def log_retention(half_retention: float) -> float:
    """Seconds a partition's halves and op records are kept: halves must outlive the
    retention decision about them."""
    return half_retention * 2


async def ensure_streams(
    js: JetStreamContext, *, replicas: int = 1, deadline: float = DECLARE_DEADLINE
) -> KeyValue:
    """Create (or widen, `topics.declare_stream`) TXN_DISCARD and the checkpoint bucket,
    retrying transient answers for `deadline` seconds each."""
    await declare_stream(
        js,
        StreamConfig(
            name=layout.DISCARD_STREAM,
            subjects=[layout.discard_subject_filter()],
            duplicate_window=DEDUPE_WINDOW,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
    return await ensure_bucket(
        js,
        KeyValueConfig(
            bucket=layout.CHECKPOINT_BUCKET, history=1, storage=StorageType.FILE, replicas=replicas
        ),
        deadline=deadline,
    )


async def ensure_partition_streams(
    js: JetStreamContext,
    partition: int,
    *,
    half_retention: float,
    replicas: int = 1,
    deadline: float = DECLARE_DEADLINE,
) -> None:
    """Create (or widen) `partition`'s log, TXN_LOG_<p>."""
    await declare_stream(
        js,
        StreamConfig(
            name=layout.log_stream(partition),
            subjects=[layout.half_subject(partition), layout.op_subject(partition)],
            max_age=log_retention(half_retention),
            duplicate_window=DEDUPE_WINDOW,
            allow_direct=True,
            allow_atomic=True,  # halves (op records) queued meanwhile are written as one batch
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
