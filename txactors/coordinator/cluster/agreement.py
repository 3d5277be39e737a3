"""The coordinators agree on one partition count and publish it (txactors/nats/partition_count.py).

The first coordinator to start creates the key (only if absent); every later one reads it and
refuses to start with another count: two counts at once would send a txid to two partitions.
The count changes only on purpose, with every coordinator stopped (ops/partitions.py,
`txactors partitions set`).
"""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from txactors.coordinator.partition.store import ensure_bucket
from txactors.nats.partition_count import PartitionCountMismatch, parse_count, where_published
from txactors.nats.topics import DECLARE_DEADLINE, declaring
from txactors.wire import layout


async def meta_bucket(js: JetStreamContext, *, replicas: int) -> KeyValue:
    """TXN_META, with direct gets allowed: clients read it without stream info or consumers."""
    return await ensure_bucket(
        js,
        KeyValueConfig(
            bucket=layout.META_BUCKET,
            history=1,
            storage=StorageType.FILE,
            replicas=replicas,
            direct=True,
        ),
    )


async def agree_partition_count(
    kv: KeyValue, partitions: int, *, deadline: float = DECLARE_DEADLINE
) -> None:
    """Publish `partitions` if no count is published yet; PartitionCountMismatch (one line for
    the operator) if another one is. Transient answers (the bucket electing a leader while a
    cluster boots) are retried for `deadline` seconds; a create whose answer was lost is then
    found in place, with our count."""
    await declaring(
        f"the partition count in KV bucket {layout.META_BUCKET}",
        lambda: _agree(kv, partitions),
        deadline=deadline,
    )


async def _agree(kv: KeyValue, partitions: int) -> None:
    try:
        try:
            await kv.create(layout.PARTITIONS_KEY, str(partitions).encode())
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        entry = await kv.get(layout.PARTITIONS_KEY)
    except nats.js.errors.KeyNotFoundError as error:
        # The create found the key and a read did not (ours, or the one nats-py's `create`
        # makes to tell a deleted key apart): a replica still behind its leader answered the
        # direct get (the bucket allows them), or the key went in between. Either passes once
        # the bucket has settled: a transient answer, tried again.
        raise nats.js.errors.ServiceUnavailableError(
            description=f"{where_published()} is not readable yet"
        ) from error
    published = parse_count(entry.value or b"")
    if published != partitions:
        raise PartitionCountMismatch(
            f"this coordinator has --partitions {partitions}, but the coordinators' partition "
            f"count is {published} ({where_published()}): start it with --partitions "
            f"{published}; to change the count see docs/operations.md (Partitions)"
        )
