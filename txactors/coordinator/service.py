"""Running a coordinator: streams, one partition actor each, served on their subjects.

`Coordinator` is what an application (or `txactors coordinator`) starts: it makes sure the
JetStream layout exists, spawns a `PartitionCoordinator` per partition (each recovers its
state before it serves), and serves `txn.coord.<p>.prepare`, `.end` and `.admin`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from nats.aio.client import Client
from nats.aio.subscription import Subscription

from txactors import layout
from txactors.actors import ActorSystem, LocalActorRef, Supervisor, serve
from txactors.coordinator.config import CoordinatorConfig
from txactors.coordinator.partition import (
    Clock,
    CoordinatorOptions,
    OnDiscard,
    PartitionCoordinator,
)
from txactors.coordinator.streams import ensure_streams
from txactors.metrics import CoordinatorMetrics
from txactors.protocol import AdminCommand, EndTransaction, Prepare

MAILBOX_SIZE = 8192


@dataclass(frozen=True, slots=True)
class RunningCoordinator:
    partitions: dict[int, LocalActorRef]
    subscriptions: list[Subscription]


@asynccontextmanager
async def run_coordinator(
    nc: Client,
    *,
    config: CoordinatorConfig | None = None,
    options: CoordinatorOptions | None = None,
    clock: Clock = time.time,
    on_discard: OnDiscard | None = None,
    metrics: CoordinatorMetrics | None = None,
) -> AsyncIterator[RunningCoordinator]:
    """Run a coordinator for every partition until the block exits."""
    config = config or CoordinatorConfig()
    options = options or CoordinatorOptions()
    js = nc.jetstream()
    checkpoints = await ensure_streams(
        js, half_retention=config.half_retention, replicas=options.replicas
    )
    async with ActorSystem("coordinator") as system:
        refs: dict[int, LocalActorRef] = {}
        subscriptions: list[Subscription] = []
        for partition in range(options.partitions):

            def make(partition: int = partition) -> PartitionCoordinator:
                return PartitionCoordinator(
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

            ref = await system.spawn(
                make,
                name=f"coordinator-{partition}",
                mailbox_size=MAILBOX_SIZE,
                supervisor=Supervisor(max_restarts=5, within=60.0, backoff_initial=0.5),
            )
            refs[partition] = ref
            for subject, accepts in (
                (layout.prepare_subject(partition), Prepare),
                (layout.end_subject(partition), EndTransaction),
                (layout.admin_subject(partition), AdminCommand),
            ):
                subscriptions.append(await serve(nc, ref, subject, accepts, reply_later=True))
        await nc.flush()
        try:
            yield RunningCoordinator(refs, subscriptions)
        finally:
            for subscription in subscriptions:
                await subscription.unsubscribe()
