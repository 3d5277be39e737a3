"""`txactors partitions`: the partition count the coordinators publish, and changing it.

Reading is for anyone allowed to read the key (txactors/nats/partition_count.py). Changing it is an
operator's deliberate act with every coordinator stopped, using credentials that may write the
coordinators' bucket: a running coordinator would go on serving the old count, and the records
of a transaction still open stay under the partition the old count gave it, where no
coordinator of the new count looks (docs/operations.md, Partitions, says how to empty them).
"""

from __future__ import annotations

import nats.js.errors
from nats.aio.client import Client

from txactors.errors import ConfigError, TxActorsError
from txactors.nats.partition_count import (
    PartitionCountInvalid,
    check_count,
    parse_count,
    read_published,
)
from txactors.ops.leases import READ_TIMEOUT, NoLeases, list_leases
from txactors.wire import layout


class CoordinatorsRunning(TxActorsError):
    """The partition count cannot change while a coordinator runs (or its lease lives on)."""


async def partition_count(nc: Client, *, timeout: float = READ_TIMEOUT) -> int | None:
    """The partition count the coordinators publish; None while none is (no coordinator has
    run here). PartitionCountUnknown (a ConfigError) when it cannot be read in `timeout`."""
    return await read_published(nc, timeout)


async def live_coordinators(nc: Client) -> set[str]:
    """Owners of a live member key or lease in TXN_LEASE (empty once all stopped, or expired)."""
    try:
        table = await list_leases(nc)
    except NoLeases:
        return set()
    holders = {lease.owner for lease in table.leases if lease.owner is not None}
    return {member.owner for member in table.members} | holders


async def change_partition_count(nc: Client, partitions: int) -> int | None:
    """Publish `partitions` in place of the count in force, which is returned (None: none was).

    Refused (CoordinatorsRunning) while any coordinator is live. Transactions still open are
    the caller's to settle first (see the module docstring)."""
    check_count(partitions)
    live = await live_coordinators(nc)
    if live:
        raise CoordinatorsRunning(
            f"coordinators still run, or their leases have not expired yet: "
            f"{', '.join(sorted(live))}; stop every coordinator, then try again once "
            "`txactors lease list` shows none"
        )
    js = nc.jetstream()
    try:
        kv = await js.key_value(layout.META_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        raise ConfigError(
            f"no coordinator has run on this server (no {layout.META_BUCKET} bucket): the "
            "first one to start publishes its --partitions"
        ) from None
    value = str(partitions).encode()
    try:
        entry = await kv.get(layout.PARTITIONS_KEY)
    except nats.js.errors.KeyNotFoundError:  # never published, or deleted
        await kv.create(layout.PARTITIONS_KEY, value)
        return None
    await kv.update(layout.PARTITIONS_KEY, value, last=entry.revision)
    try:
        return parse_count(entry.value or b"")
    except PartitionCountInvalid:  # not a count anyone used: replaced all the same
        return None
