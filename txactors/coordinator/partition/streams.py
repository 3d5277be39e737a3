"""The coordinator's streams (DESIGN §4): TXN_HALF, TXN_OP, TXN_DISCARD and the checkpoint
bucket, declared (or widened) on start. TXN_HALF holds the half messages (halves.py, packs.py),
TXN_OP the op records (checkpoints.py); both are file-backed: a decision is durable when
JetStream acknowledged it."""

from __future__ import annotations

from typing import Final

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.kv import KeyValue

from txactors.nats.topics import DECLARE_DEADLINE, declare_stream, ensure_bucket
from txactors.wire import layout

DEDUPE_WINDOW: Final = 120.0
"""Seconds JetStream remembers a `Nats-Msg-Id`: covers a retried append after a timeout."""


async def ensure_streams(
    js: JetStreamContext,
    *,
    half_retention: float,
    replicas: int = 1,
    deadline: float = DECLARE_DEADLINE,
) -> KeyValue:
    """Create (or widen, `topics.declare_stream`) TXN_HALF, TXN_OP, TXN_DISCARD and the
    checkpoint bucket, retrying transient answers for `deadline` seconds each."""
    retention = half_retention * 2  # halves must outlive the retention decision about them
    await declare_stream(
        js,
        StreamConfig(
            name=layout.HALF_STREAM,
            subjects=[layout.half_subject_filter()],
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
            name=layout.OP_STREAM,
            subjects=[layout.op_subject_filter()],
            max_age=retention,
            duplicate_window=DEDUPE_WINDOW,
            allow_atomic=True,  # every partition's op records of a moment in one write
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
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
