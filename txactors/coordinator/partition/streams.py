"""The coordinator's streams (DESIGN §4). Each partition's log stands alone: its halves in
`TXN_HALF_<p>` (halves.py, packs.py), its op records in `TXN_OP_<p>` (checkpoints.py), both
file-backed (a decision is durable when JetStream acknowledged it), declared by the
coordinator that takes the partition (`ensure_partition_streams`). On a cluster each is a raft
group of its own with its leader on any node, so a node loss pauses only the partitions whose
streams it led, and the writes of many partitions go to many leaders. What every partition
shares is declared once per process (`ensure_streams`): TXN_DISCARD and the checkpoint bucket.

Halves and op records are on two streams rather than one: a half's write and a decision's
write of the same partition then go to disk side by side instead of one behind the other, and
the follower of late halves (late.py) wakes only when halves were written.
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
    """Create (or widen) `partition`'s TXN_HALF_<p> and TXN_OP_<p>."""
    retention = log_retention(half_retention)
    await declare_stream(
        js,
        StreamConfig(
            name=layout.half_stream(partition),
            subjects=[layout.half_subject(partition)],
            max_age=retention,
            duplicate_window=DEDUPE_WINDOW,
            allow_direct=True,
            allow_atomic=True,  # halves queued meanwhile are written as one batch
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
    await declare_stream(
        js,
        StreamConfig(
            name=layout.op_stream(partition),
            subjects=[layout.op_subject(partition)],
            max_age=retention,
            duplicate_window=DEDUPE_WINDOW,
            allow_atomic=True,  # many op records of a moment in one write
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
