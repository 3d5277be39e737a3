"""The coordinators agree on one partition count, publish it (txactors/nats/partition_count.py)
and keep it.

The first coordinator to start creates the key (only if absent); every later one reads it and
refuses to start with another count: two counts at once would send a txid to two partitions.
The count changes only on purpose, with every coordinator stopped (ops/partitions.py,
`txactors partitions set`). So while one runs, any other value in the key is nobody's
decision (on a server without permissions any client may write it): each running coordinator
watches the key and puts its count back (`keep_partition_count`), and a starting one replaces a
value that is no count at all (it cannot be one a coordinator served).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import Final

import anyio
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from txactors.nats.partition_count import (
    PartitionCountInvalid,
    PartitionCountMismatch,
    parse_count,
    where_published,
)
from txactors.nats.retry import LINK_TROUBLE, describe
from txactors.nats.topics import DECLARE_DEADLINE, declaring, ensure_bucket
from txactors.observe.logs import get_logger
from txactors.wire import layout

log = get_logger(__name__)

READ_EVERY: Final = 5.0
"""Seconds without news from the watch after which the key is read directly: a watch that
went quiet (its consumer lost with a node) leaves a change unseen no longer than this."""
RESTORE_PAUSE: Final = 1.0
"""Least seconds between two restores by one coordinator. Should a coordinator with another
count ever run beside this one (started in the instant the key held its count), the two
write the key in turn at this pace, each logging it, rather than as fast as watches go."""


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
    """Publish `partitions` if no count is published yet (or the key holds no count);
    PartitionCountMismatch (one line for the operator) if another one is. Transient answers
    (the bucket electing a leader while a cluster boots) are retried for `deadline` seconds;
    a create whose answer was lost is then found in place, with our count."""
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
    try:
        published = parse_count(entry.value or b"")
    except PartitionCountInvalid:  # no client routes by it: nobody's count to keep
        if not await _put_back(kv, entry.value, entry.revision, partitions):
            raise nats.js.errors.ServiceUnavailableError(
                description=f"{where_published()} changed while being replaced"
            ) from None
        return
    if published != partitions:
        raise PartitionCountMismatch(
            f"this coordinator has --partitions {partitions}, but the coordinators' partition "
            f"count is {published} ({where_published()}): start it with --partitions "
            f"{published}; to change the count see docs/operations.md (Partitions)"
        )


async def keep_partition_count(
    kv: KeyValue,
    partitions: int,
    *,
    restored: Callable[[], None],
    retry: float,
    read_every: float = READ_EVERY,
) -> None:
    """Put `partitions` back whenever the key holds anything else, until cancelled; call
    `restored` for each value this coordinator replaced (another one may replace it first).
    NATS trouble is logged and the key watched again `retry` seconds later: never raised."""
    while True:
        try:
            await _keep(kv, partitions, restored, read_every)
        except LINK_TROUBLE as error:
            log.warning("partition_count_watch_failed", error=describe(error))
        await anyio.sleep(retry)


async def _keep(
    kv: KeyValue, partitions: int, restored: Callable[[], None], read_every: float
) -> None:
    watcher = await kv.watch(layout.PARTITIONS_KEY)
    try:
        while True:
            try:
                entry = await watcher.updates(read_every)  # type: ignore[no-untyped-call]
            except nats.errors.TimeoutError:
                entry = await _read(kv)
            if entry is None:  # the watch's "no more pending", or never written
                continue
            gone = entry.operation in (KV_DEL, KV_PURGE)
            found = None if gone else (entry.value or b"")
            if await _put_back(kv, found, entry.revision, partitions):
                restored()
                await anyio.sleep(RESTORE_PAUSE)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0), suppress(*LINK_TROUBLE):
            await watcher.stop()  # type: ignore[no-untyped-call]


async def _read(kv: KeyValue) -> KeyValue.Entry | None:
    """The key's last entry: its value, or its delete marker (None: never written)."""
    try:
        return await kv.get(layout.PARTITIONS_KEY)
    except nats.js.errors.KeyNotFoundError as gone:
        marker: KeyValue.Entry | None = gone.entry
        return marker


async def _put_back(
    kv: KeyValue, found: bytes | None, revision: int | None, partitions: int
) -> bool:
    """Write `partitions` over `found` (None: deleted) at `revision` unless it is our count
    already; False if it is, or if the key was written since (by another coordinator
    putting it back: the watch shows that write next)."""
    if found is not None:
        with suppress(PartitionCountInvalid):
            if parse_count(found) == partitions:
                return False
    ours = str(partitions).encode()
    try:
        if revision is None:
            await kv.create(layout.PARTITIONS_KEY, ours)
        else:
            await kv.update(layout.PARTITIONS_KEY, ours, last=revision)
    except nats.js.errors.KeyWrongLastSequenceError:
        return False
    log.error(
        "partition_count_restored",
        found=None if found is None else layout.shown(found.decode("ascii", errors="replace")),
        partitions=partitions,
        key=where_published(),
    )
    return True
