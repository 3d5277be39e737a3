"""The coordinator's streams for tests that drive its parts without a running coordinator."""

from __future__ import annotations

from collections.abc import Iterable

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from txactors.coordinator.partition.streams import ensure_partition_streams, ensure_streams


async def ensure_log_streams(
    js: JetStreamContext, *, half_retention: float, partitions: Iterable[int] = (0, 1)
) -> KeyValue:
    """The process's streams and `partitions`' own, as coordinators declare them; the
    checkpoint bucket."""
    checkpoints = await ensure_streams(js)
    for partition in partitions:
        await ensure_partition_streams(js, partition, half_retention=half_retention)
    return checkpoints
