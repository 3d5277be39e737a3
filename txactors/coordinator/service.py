"""Running a coordinator: streams, leases, one partition actor per owned partition.

`run_coordinator` is what an application (or `txactors coordinator`) starts. It makes sure the
JetStream layout exists, takes the leases of the partitions that are free (up to
`max_partitions`), and for each one spawns a `PartitionCoordinator` (which recovers its state
before it serves, then starts the partition's `Checker`) and serves `txn.coord.<p>.prepare`,
`.end` and `.admin`. A keeper renews the leases, stops serving a partition whose lease is lost
or cannot be renewed in time, and takes over partitions whose owner died. Renewing runs in a
task of its own, from before the first partition is taken: a partition that is still recovering
(however long that takes) keeps its lease. Several coordinator processes thus split the
partitions, or stand by for each other. Only inbox reply subjects are answered
(`options.inbox_prefix`), and a connection closed for good ends the coordinator with
`NatsConnectionLost` rather than leaving it up serving nothing.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import anyio
import nats.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from txactors import layout
from txactors.actors import ActorSystem, LocalActorRef, ReplyGuard, Supervisor, serve
from txactors.coordinator.actor import PartitionCoordinator
from txactors.coordinator.config import CoordinatorConfig
from txactors.coordinator.leases import Leases, lease_bucket
from txactors.coordinator.options import Clock, CoordinatorOptions, OnDiscard
from txactors.coordinator.store import ensure_streams
from txactors.logs import get_logger
from txactors.metrics import CoordinatorMetrics
from txactors.natsclient import raising_connection_lost, watch_connection
from txactors.protocol import AdminCommand, EndTransaction, Prepare

MAILBOX_SIZE = 8192
RENEW_FRACTION = 1 / 3
"""Leases are renewed every third of their TTL: two renewals may fail before it matters."""
SELF_FENCE_FRACTION = 0.8
"""Without a renewal for this fraction of the TTL, an owner stops serving on its own."""

log = get_logger(__name__)


@dataclass(slots=True)
class _Owned:
    revision: int
    renewed_at: float
    ref: LocalActorRef | None = None
    """None while the partition actor starts (recovers); its lease is renewed meanwhile."""
    subscriptions: list[Subscription] = field(default_factory=list)


@dataclass(slots=True)
class RunningCoordinator:
    """A handle on a running coordinator: which partitions it serves right now."""

    owner: str
    owned: dict[int, _Owned]

    @property
    def partitions(self) -> list[int]:
        """The partitions served now (not those whose lease is held while they recover)."""
        return sorted(p for p, owned in self.owned.items() if owned.subscriptions)


def default_owner_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class _PartitionKeeper:
    def __init__(
        self,
        nc: Client,
        system: ActorSystem,
        leases: Leases,
        options: CoordinatorOptions,
        make_partition: Callable[[int], PartitionCoordinator],
        replies: ReplyGuard,
    ) -> None:
        self._nc = nc
        self._replies = replies
        self._system = system
        self._leases = leases
        self._options = options
        self._make_partition = make_partition
        self.owned: dict[int, _Owned] = {}

    async def renew(self) -> None:
        """Keep the leases held, forever (apart from taking, which may wait on recoveries)."""
        while True:
            await anyio.sleep(self._options.lease_ttl * RENEW_FRACTION)
            await self.keep_owned()

    async def take(self) -> None:
        while True:
            await anyio.sleep(self._options.lease_ttl * RENEW_FRACTION)
            await self.take_free()

    async def take_free(self) -> None:
        for partition in range(self._options.partitions):
            if len(self.owned) >= self._options.max_partitions:
                return
            if partition in self.owned:
                continue
            revision = await self._leases.take(partition)
            if revision is not None:
                await self._start(partition, revision)

    async def keep_owned(self) -> None:
        for partition, owned in list(self.owned.items()):
            if owned.ref is not None and not owned.ref.is_alive:
                log.error("partition_actor_died", partition=partition)
                await self._stop(partition, give_back=True)
                continue
            try:
                revision = await self._leases.renew(partition, owned.revision)
            except Exception as error:  # NATS trouble: we may or may not still hold it
                log.warning("lease_renew_failed", partition=partition, error=repr(error))
                silent = time.monotonic() - owned.renewed_at
                if silent > self._options.lease_ttl * SELF_FENCE_FRACTION:
                    log.error("lease_expiring_stop_serving", partition=partition)
                    await self._stop(partition, give_back=False)
                continue
            if revision is None:
                log.error("lease_lost", partition=partition)
                await self._stop(partition, give_back=False)
            else:
                owned.revision, owned.renewed_at = revision, time.monotonic()

    async def _start(self, partition: int, revision: int) -> None:
        log.info("lease_taken", partition=partition, owner=self._leases.owner)
        owned = _Owned(revision, time.monotonic())
        self.owned[partition] = owned  # renewed from now on, while the actor recovers
        ref = await self._system.spawn(
            lambda: self._make_partition(partition),
            name=f"coordinator-{partition}",
            mailbox_size=MAILBOX_SIZE,
            supervisor=Supervisor(max_restarts=5, within=60.0, backoff_initial=0.5),
        )
        owned.ref = ref
        if self.owned.get(partition) is not owned:  # the lease was lost while it recovered
            await ref.stop()
            return
        subscriptions = [
            await serve(self._nc, ref, subject, accepts, replies=self._replies)
            for subject, accepts in (
                (layout.prepare_subject(partition), Prepare),
                (layout.end_subject(partition), EndTransaction),
                (layout.admin_subject(partition), AdminCommand),
            )
        ]
        await self._nc.flush()
        owned.subscriptions = subscriptions  # serving from now on

    async def _stop(self, partition: int, *, give_back: bool) -> None:
        owned = self.owned.pop(partition, None)
        if owned is None:
            return  # stopped meanwhile by the other loop
        for subscription in owned.subscriptions:
            with suppress(nats.errors.Error):  # a closed connection has no subscriptions left
                await subscription.unsubscribe()
        if owned.ref is not None:
            await owned.ref.stop()
        if give_back:
            await self._leases.give_back(partition, owned.revision)
        log.info("partition_released", partition=partition, given_back=give_back)

    async def stop_all(self) -> None:
        for partition in list(self.owned):
            await self._stop(partition, give_back=True)


@asynccontextmanager
async def run_coordinator(
    nc: Client,
    *,
    config: CoordinatorConfig | None = None,
    options: CoordinatorOptions | None = None,
    clock: Clock = time.time,
    on_discard: OnDiscard | None = None,
    metrics: CoordinatorMetrics | None = None,
    owner: str | None = None,
) -> AsyncIterator[RunningCoordinator]:
    """Coordinate every partition this process can lease, until the block exits.

    On entry it takes the partitions that are free; those held by another live coordinator
    are taken over in the background if their owner goes away.
    """
    config = config or CoordinatorConfig()
    options = options or CoordinatorOptions()
    js = nc.jetstream()
    checkpoints = await ensure_streams(
        js, half_retention=config.half_retention, replicas=options.replicas
    )
    leases = Leases(
        await lease_bucket(js, ttl=options.lease_ttl, replicas=options.replicas),
        owner or default_owner_id(),
    )

    replies = ReplyGuard(
        options.inbox_prefix,
        on_refused=metrics.refused_replies.inc if metrics is not None else None,
    )
    with raising_connection_lost():
        async with ActorSystem("coordinator") as system, anyio.create_task_group() as tasks:

            def make_partition(partition: int) -> PartitionCoordinator:
                return PartitionCoordinator(
                    system=system,
                    nc=nc,
                    js=js,
                    checkpoints=checkpoints,
                    partition=partition,
                    config=config,
                    options=options,
                    clock=clock,
                    on_discard=on_discard,
                    metrics=metrics,
                )

            keeper = _PartitionKeeper(nc, system, leases, options, make_partition, replies)
            tasks.start_soon(keeper.renew)
            await keeper.take_free()
            tasks.start_soon(keeper.take)
            tasks.start_soon(watch_connection, nc)
            try:
                yield RunningCoordinator(leases.owner, keeper.owned)
            finally:
                tasks.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await keeper.stop_all()
