"""Who owns which partition: leases in the TXN_LEASE KV bucket.

A lease is the key `<partition>` holding the owner's id. It is taken with a create (only if
absent), kept with an update conditioned on its revision, and given back with a delete
conditioned on it too; the bucket's TTL drops the key of an owner that died, so a standby takes
over. An owner that cannot renew for most of the TTL stops serving on its own, before anyone
else can take the lease (as Kafka's members leave a group when their session times out). TXN_OP
appends are fenced besides, so even a stalled owner that wakes up late cannot write behind its
successor.

Each coordinator also announces itself with a key `member.<owner>` (its `MemberInfo`), put
with the leases' renewals and deleted when it leaves, so that the members can split the
partitions between them (balance.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KV_DEL, KV_PURGE, VALID_KEY_RE, KeyValue

from txactors.coordinator.cluster.balance import MEMBER_PREFIX, MemberInfo
from txactors.errors import ConfigError, ungrouped
from txactors.nats.retry import LINK_TROUBLE
from txactors.nats.topics import ensure_bucket
from txactors.observe.logs import get_logger
from txactors.wire import layout

log = get_logger(__name__)

_GONE = (KV_DEL, KV_PURGE)
VIEW_READS = 32
"""Gets of one view in flight at once (a bucket holds a key per partition and per member)."""


class LeaseView(msgspec.Struct, frozen=True, kw_only=True):
    """The bucket as read once: its live members and who holds which partition."""

    members: dict[str, MemberInfo]
    holders: dict[int, str]


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

    def __init__(self, js: JetStreamContext, kv: KeyValue, owner: str) -> None:
        if not VALID_KEY_RE.match(owner):
            raise ConfigError(f"a coordinator's owner id must be a valid KV key, got {owner!r}")
        self._js = js
        self._kv = kv
        self._stream = layout.bucket_stream(layout.LEASE_BUCKET)
        self._prefix = layout.bucket_key_prefix(layout.LEASE_BUCKET)
        self.owner = owner
        self.member_key = f"{MEMBER_PREFIX}{owner}"

    async def take(self, partition: int) -> int | None:
        """The lease's revision if it was free and is ours now; None if someone holds it."""
        try:
            return await self._kv.create(str(partition), self.owner.encode())
        except nats.js.errors.KeyWrongLastSequenceError:
            return None
        except LINK_TROUBLE as error:
            log.warning("lease_take_failed", partition=partition, error=repr(error))
            return None

    async def renew(self, partition: int, revision: int) -> int | None:
        """The new revision; None if the lease is gone or someone else's (we lost it).

        A renewal whose answer was lost (the bucket electing a leader) may have landed: the
        retry's revision is then stale, but the key still holds our id, and nobody can have
        written it in between (every write is conditioned), so the lease is still ours.
        Raises on a transport problem: the caller decides whether it still holds the lease.
        """
        try:
            return await self._kv.update(str(partition), self.owner.encode(), last=revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            pass
        try:
            entry = await self._kv.get(str(partition))
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value != self.owner.encode() or entry.revision is None:
            return None
        return await self.renew(partition, entry.revision)

    async def give_back(self, partition: int, revision: int) -> None:
        try:
            await self._kv.delete(str(partition), last=revision)
        except (nats.js.errors.KeyWrongLastSequenceError, *LINK_TROUBLE) as error:
            log.info("lease_not_given_back", partition=partition, error=repr(error))

    async def announce(self, info: MemberInfo) -> None:
        """Put (or renew) our member key. Raises on a transport problem."""
        await self._kv.put(self.member_key, msgspec.json.encode(info))

    async def withdraw(self) -> None:
        """Delete our member key: the others stop counting us at once (best effort)."""
        try:
            await self._kv.delete(self.member_key)
        except LINK_TROUBLE as error:
            log.info("member_not_withdrawn", owner=self.owner, error=repr(error))

    async def view(self, timeout: float) -> LeaseView:
        """Members and holders as the bucket has them now, read within `timeout` (else
        `TimeoutError`, so that partitions left free are not kept waiting behind a bucket that
        elects a leader). Raises on a transport problem (`LINK_TROUBLE`, as itself).

        The keys come from the stream's subjects and each value from a get: both are answered
        by the bucket's leader alone, whereas a watch creates a consumer, which waits for the
        JetStream meta leader (seconds of election after the node leading it died)."""
        values: dict[str, bytes] = {}
        with anyio.fail_after(timeout):
            info = await self._js.stream_info(self._stream, subjects_filter=f"{self._prefix}>")
            subjects = info.state.subjects
            if subjects is None and info.state.messages:  # a server without subjects_filter
                values = await self._watched_values(timeout)
            else:
                limiter = anyio.CapacityLimiter(VIEW_READS)
                # Reads failing together (the bucket electing a leader) fail the view once.
                with ungrouped(*LINK_TROUBLE):
                    async with anyio.create_task_group() as reads:
                        for subject in subjects or ():
                            key = subject.removeprefix(self._prefix)
                            reads.start_soon(self._read, key, values, limiter)
        members: dict[str, MemberInfo] = {}
        holders: dict[int, str] = {}
        for key, value in values.items():
            if key.startswith(MEMBER_PREFIX):
                try:
                    members[key.removeprefix(MEMBER_PREFIX)] = msgspec.json.decode(
                        value, type=MemberInfo
                    )
                except msgspec.DecodeError:
                    log.warning("member_unreadable", key=key)
            elif key.isdigit():
                holders[int(key)] = value.decode(errors="replace")
        return LeaseView(members=members, holders=holders)

    async def _read(
        self, key: str, values: dict[str, bytes], limiter: anyio.CapacityLimiter
    ) -> None:
        async with limiter:
            try:
                entry = await self._kv.get(key, validate_keys=False)
            except nats.js.errors.KeyNotFoundError:  # deleted, or gone since listed
                return
        if entry.value:
            values[key] = entry.value

    async def _watched_values(self, timeout: float) -> dict[str, bytes]:
        """Every key's value, read through a watch (needs the meta leader; for old servers)."""
        values: dict[str, bytes] = {}
        watcher = await self._kv.watchall()
        try:
            while (entry := await watcher.updates(timeout)) is not None:  # type: ignore[no-untyped-call]
                if entry.operation in _GONE or not entry.value:
                    values.pop(entry.key, None)
                else:
                    values[entry.key] = entry.value
        finally:
            await _stop(watcher)
        return values

    async def watch_holders(self, changed: Callable[[], None]) -> None:
        """Call `changed` whenever a key's holder changes (a lease taken or given back, a member
        come or gone); renewals are not changes. Runs until cancelled; raises on a transport
        problem (the caller watches again)."""
        watcher = await self._kv.watchall()
        last: dict[str, bytes | None] = {}
        try:
            async for entry in watcher:
                if entry is None:
                    continue
                holder = None if entry.operation in _GONE else entry.value
                if entry.key not in last or last[entry.key] != holder:
                    last[entry.key] = holder
                    changed()
        finally:
            await _stop(watcher)

    async def holder(self, partition: int) -> str | None:
        try:
            entry = await self._kv.get(str(partition))
        except nats.js.errors.KeyNotFoundError:
            return None
        return entry.value.decode() if entry.value else None


async def _stop(watcher: KeyValue.KeyWatcher) -> None:
    """Unsubscribe even when cancelled (an ordered consumer left behind lives for minutes)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(1.0), suppress(*LINK_TROUBLE):
        await watcher.stop()  # type: ignore[no-untyped-call]
