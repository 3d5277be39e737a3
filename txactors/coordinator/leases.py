"""Who owns which partition: leases in the TXN_LEASE KV bucket.

A lease is the key `<partition>` holding the owner's id. It is taken with a create (only if
absent), kept with an update conditioned on its revision, and given back with a delete; the
bucket's TTL drops the key of an owner that died, so a standby takes over. An owner that cannot
renew for most of the TTL stops serving on its own, before anyone else can take the lease (as
Kafka's members leave a group when their session times out). TXN_OP appends are fenced besides,
so even a stalled owner that wakes up late cannot write behind its successor.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from txactors import layout
from txactors.coordinator.store import ensure_bucket
from txactors.logs import get_logger

log = get_logger(__name__)

_LEASE_TROUBLE = (nats.errors.Error, TimeoutError, OSError)


async def lease_bucket(js: JetStreamContext, *, ttl: float, replicas: int) -> KeyValue:
    return await ensure_bucket(
        js,
        KeyValueConfig(
            bucket=layout.LEASE_BUCKET,
            history=1,
            ttl=ttl,
            storage=StorageType.FILE,
            replicas=replicas,
        ),
    )


class Leases:
    """Take, keep and give back partition leases for one coordinator process."""

    def __init__(self, kv: KeyValue, owner: str) -> None:
        self._kv = kv
        self.owner = owner

    async def take(self, partition: int) -> int | None:
        """The lease's revision if it was free and is ours now; None if someone holds it."""
        try:
            return await self._kv.create(str(partition), self.owner.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        except _LEASE_TROUBLE as error:
            log.warning("lease_take_failed", partition=partition, error=repr(error))
            return None

    async def renew(self, partition: int, revision: int) -> int | None:
        """The new revision; None if the lease is gone or someone else's (we lost it).

        Raises on a transport problem: the caller decides whether it still holds the lease.
        """
        try:
            return await self._kv.update(str(partition), self.owner.encode(), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def give_back(self, partition: int, revision: int) -> None:
        try:
            await self._kv.delete(str(partition), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, *_LEASE_TROUBLE) as error:
            log.info("lease_not_given_back", partition=partition, error=repr(error))

    async def holder(self, partition: int) -> str | None:
        try:
            entry = await self._kv.get(str(partition))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value.decode() if entry.value else None
