"""Running a coordinator: streams, leases, one partition actor per owned partition.

`run_coordinator` is what an application (or `txactors coordinator`) starts. It makes sure the
JetStream layout exists, agrees on the partition count with the other coordinators
(agreement.py: the first one publishes it, a later one with another count refuses),
announces itself as a member of the lease bucket, takes its share of the free partitions
(balance.py: an even split over the live members, at most `max_partitions`), and for each
one spawns a `PartitionCoordinator` (which recovers its state before it serves, then starts
the partition's `Checker`) and serves `txn.coord.<p>.prepare.*` and `.end.*` (the last
token: the producer group) and `.admin`. A keeper renews the leases (a failed renewal is
retried soon), stops serving a partition whose lease is lost or cannot be renewed in time,
takes over partitions whose owner died or left, and hands over a few at a time when a member
joins (a lease is given back once the partition's op writes in flight settled). Renewing runs
in a task of its own, from before the first partition is taken: a partition that is still
recovering (however long that takes) keeps its lease. Several coordinator processes thus
split the partitions evenly, and take over from each other. Only inbox reply subjects are
answered (`options.inbox_prefix`; with a tenant policy, a group's only in its own inbox,
tenants.py), and a connection closed for good ends the coordinator with `NatsConnectionLost`
rather than leaving it up serving nothing. Nothing that passes ends it: a look at the bucket
that fails is tried at the next step, a partition that cannot start is given back and taken
again; and what does end it leaves `run_coordinator` as itself, not in an exception group.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import anyio
import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from txactors.actors import ActorSystem, Directive, LocalActorRef, ReplyGuard, Supervisor, serve
from txactors.coordinator.cluster.agreement import (
    agree_partition_count,
    keep_partition_count,
    meta_bucket,
)
from txactors.coordinator.cluster.balance import MemberInfo, plan
from txactors.coordinator.cluster.leases import Leases, lease_bucket
from txactors.coordinator.cluster.placement import (
    connected_server,
    log_leaders,
    owner_servers,
    spread_leaders,
)
from txactors.coordinator.options import Clock, CoordinatorOptions, OnDiscard
from txactors.coordinator.partition.actor import PartitionCoordinator
from txactors.coordinator.partition.oplog import READ_BACK_TIMEOUT, FencedOut
from txactors.coordinator.partition.streams import ensure_streams
from txactors.coordinator.partition.tenants import (
    TenantReplies,
    declare_consumer_streams,
    tenant_groups,
)
from txactors.coordinator.partition.upgrade import LegacyLog
from txactors.coordinator.writers import shared_writers
from txactors.errors import ActorError, ungrouped
from txactors.nats.client import raising_connection_lost, watch_connection
from txactors.nats.link import ACK_TIMEOUT
from txactors.nats.retry import LINK_TROUBLE
from txactors.observe.logs import get_logger
from txactors.observe.metrics import CoordinatorMetrics
from txactors.wire import layout
from txactors.wire.inbox import normalize_prefix
from txactors.wire.protocol import (
    AdminCommand,
    EndBatch,
    EndTransaction,
    Prepare,
    PrepareBatch,
)
from txactors.wire.rules import CoordinatorConfig

MAILBOX_SIZE = 8192
RENEW_FRACTION = 1 / 3
"""Leases are renewed every third of their TTL (and the bucket looked at to rebalance)."""
RETRY_FRACTION = 0.1
"""A failed renewal is tried again this fraction of the TTL later, and one attempt may take
that long: the lease bucket electing a leader costs a few attempts, not the lease."""
ATTEMPT_FLOOR = 0.2
"""Seconds a renewal may take at least, however short the TTL (a loaded server's round trip)."""
SELF_FENCE_FRACTION = 0.8
"""Without a renewal for this fraction of the TTL, an owner stops serving on its own."""
HANDOVER_BATCH = 2
"""Partitions a coordinator above its share hands over in one step; the next step waits until
they are taken, so all but a few partitions keep serving while the load moves."""
NEAR_READ_TIMEOUT = 0.25
"""Seconds a step that takes partitions spends at most finding which of them have their log
led by our server (to take those first): a takeover after a failure waits no longer."""
HANDOVER_NEAR_TIMEOUT = 2.0
"""The same for a step that hands partitions over (to give last those whose log our server
leads): nothing waits for a handover, so it may look longer, and not guess on a busy server."""
LEADER_MOVES_PER_ROUND = 2
"""Log leaders moved at most per `leader_balance_interval`: each move pauses one partition's
writes for a leader handover, so a spread after a node's return is done over a few rounds."""
SETTLE_TIMEOUT = ACK_TIMEOUT + READ_BACK_TIMEOUT
"""Seconds a partition given back waits at most for its op writes in flight to settle: their
ack's own timeout, then a read-back of whether they landed."""

log = get_logger(__name__)


@dataclass(slots=True)
class _Owned:
    revision: int
    renewed_at: float
    """When the last renewal that succeeded was sent (the keeper's clock)."""
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


def _stop_when_fenced(error: Exception) -> Directive:
    """A partition actor fenced out of TXN_OP has a successor: never restart it to write again."""
    return Directive.STOP if isinstance(error, FencedOut) else Directive.RESTART


class _PartitionKeeper:
    """Holds this coordinator's leases and its share of the partitions.

    Two loops: `renew` keeps the member key and the leases (never waiting on a recovery),
    `rebalance` takes and hands over partitions (from the bucket's view, on every change of a
    holder and every third of the TTL).
    """

    def __init__(
        self,
        nc: Client,
        system: ActorSystem,
        leases: Leases,
        options: CoordinatorOptions,
        make_partition: Callable[[int], PartitionCoordinator],
        replies: ReplyGuard,
        *,
        settled: Callable[[int], Awaitable[None]],
        clock: Clock = time.monotonic,
    ) -> None:
        """`settled(partition)`: until no op write carrying the partition's records is in
        flight (`OpWriter.idle`)."""
        self._nc = nc
        self._settled = settled
        self._replies = replies
        self._system = system
        self._leases = leases
        self._options = options
        self._make_partition = make_partition
        self._clock = clock
        self._info = MemberInfo(
            partitions=options.partitions, max_partitions=options.max_partitions
        )
        self._changed = anyio.Event()
        self.owned: dict[int, _Owned] = {}

    async def renew(self) -> None:
        """Keep the member key and the leases, forever."""
        while True:
            delay = await self.keep_owned()
            await anyio.sleep(delay)

    async def rebalance(self) -> None:
        """Take or hand over partitions on every change seen in the bucket, and every tick."""
        while True:
            with anyio.move_on_after(self._options.lease_ttl * RENEW_FRACTION):
                await self._changed.wait()
            self._changed = anyio.Event()  # changes seen from now on wake the next step
            await self.balance()

    async def watch(self) -> None:
        """Wake `rebalance` when a lease is given back or a member comes or goes (a poll would
        notice it only a third of the TTL later)."""
        while True:
            try:
                await self._leases.watch_holders(self._wake)
            except LINK_TROUBLE as error:
                log.warning("lease_watch_failed", error=repr(error))
            await anyio.sleep(self._options.lease_ttl * RETRY_FRACTION)

    async def spread(self) -> None:
        """Every `leader_balance_interval`, while this member serves partition 0 (one member
        at a time, bar a handover's moment), move a few log leaders where they pile up."""
        interval = self._options.leader_balance_interval
        if interval <= 0 or self._options.replicas < 2:
            return
        waiting: str | None = None
        while True:
            await anyio.sleep(interval)
            first = self.owned.get(0)
            if first is None or not first.subscriptions:
                continue
            try:
                view = await self._leases.view(self._options.lease_ttl * RENEW_FRACTION)
                report = await spread_leaders(
                    self._nc,
                    range(self._options.partitions),
                    limit=LEADER_MOVES_PER_ROUND,
                    owners=owner_servers(view),
                )
            except (TimeoutError, *LINK_TROUBLE) as error:
                log.warning("log_leaders_not_read", error=repr(error))
                continue
            if report.waiting != waiting:  # said once, not every round
                waiting = report.waiting
                if waiting is not None:
                    log.info("log_leaders_not_spread", reason=waiting)
            if report.moved or report.failed:
                log.info(
                    "log_leaders_spread",
                    leaders=report.leaders,
                    moved=len(report.moved),
                    left=len(report.planned) - len(report.moved),
                )

    async def _near(self, partitions: set[int], timeout: float) -> frozenset[int]:
        """Those of `partitions` whose log is led by the server we are connected to (of
        those that answer within `timeout`)."""
        server = connected_server(self._nc)
        if server is None or self._options.replicas < 2:
            return frozenset()
        leaders = await log_leaders(self._nc.jetstream(), sorted(partitions), timeout)
        return frozenset(p for p, leader in leaders.items() if leader == server)

    def _member_info(self) -> MemberInfo:
        """What the member key says: our caps, and the server we are connected to now."""
        return msgspec.structs.replace(self._info, server=connected_server(self._nc))

    def _wake(self) -> None:
        self._changed.set()  # the event of the step to come (each step has a new one)

    async def join(self) -> None:
        """Announce this member, then take its share of what is free."""
        try:
            await self._leases.announce(self._member_info())
        except LINK_TROUBLE as error:  # announced by the next renewal
            log.warning("member_announce_failed", error=repr(error))
        await self.balance()

    async def balance(self) -> None:
        """One step: hand over a few partitions above our share, or take free ones below it."""
        ttl = self._options.lease_ttl
        try:
            view = await self._leases.view(timeout=ttl * RENEW_FRACTION)
        except LINK_TROUBLE as error:
            log.warning("lease_view_failed", error=repr(error))
            return
        step = plan(
            me=self._leases.owner,
            partitions=self._options.partitions,
            members={**view.members, self._leases.owner: self._info},
            holders=view.holders,
            owned=frozenset(self.owned),
            batch=HANDOVER_BATCH,
        )
        if step.give or (step.take and len(self.owned) < step.share):
            near = await (
                self._near(set(self.owned), HANDOVER_NEAR_TIMEOUT)
                if step.give
                else self._near(set(step.take), NEAR_READ_TIMEOUT)
            )
            if near:  # the same shares; which partitions go or come
                step = plan(
                    me=self._leases.owner,
                    partitions=self._options.partitions,
                    members={**view.members, self._leases.owner: self._info},
                    holders=view.holders,
                    owned=frozenset(self.owned),
                    batch=HANDOVER_BATCH,
                    near=near,
                )
        for partition in step.give:
            log.info("partition_handed_over", partition=partition, share=step.share)
            await self._stop(partition, give_back=True)
        taken: list[int] = []
        for partition in step.take:
            if len(self.owned) >= step.share:
                break
            sent = self._clock()
            revision = await self._leases.take(partition)
            if revision is not None:
                log.info("lease_taken", partition=partition, owner=self._leases.owner)
                self.owned[partition] = _Owned(revision, sent)  # renewed from now on
                taken.append(partition)
        with ungrouped():  # recover them side by side
            async with anyio.create_task_group() as starting:
                for partition in taken:
                    starting.start_soon(self._start, partition, self.owned[partition])

    async def keep_owned(self) -> float:
        """One round of renewals (all at once); returns the delay until the next round."""
        ttl = self._options.lease_ttl
        fence = ttl * SELF_FENCE_FRACTION
        started = self._clock()
        dead: list[int] = []
        for partition, owned in list(self.owned.items()):
            if owned.ref is not None and not owned.ref.is_alive:
                log.error("partition_actor_died", partition=partition)
                dead.append(partition)
            elif started - owned.renewed_at >= fence:  # e.g. woken from a long stall
                log.error("lease_expiring_stop_serving", partition=partition)
                await self._stop(partition, give_back=False)
        live = {p: owned for p, owned in self.owned.items() if p not in dead}
        renewing = {p: owned.revision for p, owned in live.items()}
        deadline = min((o.renewed_at + fence for o in live.values()), default=started + ttl)
        timeout = max(0.0, min(max(ttl * RETRY_FRACTION, ATTEMPT_FLOOR), deadline - started))
        results: dict[int, int | Exception | None] = {}
        announced: list[Exception] = []

        async def renew_one(partition: int, revision: int) -> None:
            try:
                with anyio.fail_after(timeout):
                    results[partition] = await self._leases.renew(partition, revision)
            except Exception as error:  # NATS trouble: we may or may not still hold it
                results[partition] = error

        async def announce() -> None:
            try:
                with anyio.fail_after(timeout):
                    await self._leases.announce(self._member_info())
            except Exception as error:
                announced.append(error)

        with ungrouped():
            async with anyio.create_task_group() as renewals:
                for partition in dead:  # its writes settle beside the renewals, not before
                    renewals.start_soon(
                        functools.partial(self._stop, partition, give_back=True, settle=timeout)
                    )
                renewals.start_soon(announce)
                for partition, revision in renewing.items():
                    renewals.start_soon(renew_one, partition, revision)
        failed = bool(announced)
        for partition, result in results.items():
            held = self.owned.get(partition)
            if held is None or held.revision != renewing[partition]:
                continue  # stopped (or taken again) meanwhile
            if isinstance(result, Exception):
                failed = True
                log.warning("lease_renew_failed", partition=partition, error=repr(result))
                if self._clock() - held.renewed_at >= fence:
                    log.error("lease_expiring_stop_serving", partition=partition)
                    await self._stop(partition, give_back=False)
            elif result is None:
                log.error("lease_lost", partition=partition)
                await self._stop(partition, give_back=False)
            else:
                held.revision, held.renewed_at = result, started
        if announced:
            log.warning("member_renew_failed", error=repr(announced[0]))
        now = self._clock()
        delay = ttl * (RETRY_FRACTION if failed else RENEW_FRACTION)
        fences = [o.renewed_at + fence - now for o in self.owned.values()]
        return max(0.0, min([delay, *fences]))

    async def _start(self, partition: int, owned: _Owned) -> None:
        """Recover `partition`, then serve it. One that cannot start now (its recovery
        failed for good, or NATS went away meanwhile) is given back: the next step, here or
        at another member, takes it again. Never raises that: it would end the coordinator."""
        subscriptions: list[Subscription] = []
        try:
            ref = await self._system.spawn(
                lambda: self._make_partition(partition),
                name=f"coordinator-{partition}",
                mailbox_size=MAILBOX_SIZE,
                supervisor=Supervisor(
                    decide=_stop_when_fenced, max_restarts=5, within=60.0, backoff_initial=0.5
                ),
            )
            owned.ref = ref
            if self.owned.get(partition) is not owned:  # the lease was lost while it recovered
                await ref.stop()
                return
            for subject, accepts in (
                (layout.prepare_filter(partition), Prepare | PrepareBatch),
                (layout.end_filter(partition), EndTransaction | EndBatch),
                (layout.admin_subject(partition), AdminCommand),
            ):
                subscriptions.append(
                    await serve(self._nc, ref, subject, accepts, replies=self._replies)
                )
            await self._nc.flush()
        except (ActorError, *LINK_TROUBLE) as error:
            log.error("partition_start_failed", partition=partition, error=repr(error))
            owned.subscriptions = subscriptions  # the stop takes them down with the actor
            if self.owned.get(partition) is owned:
                await self._stop(partition, give_back=True)
            else:  # stopped meanwhile, before these were known
                await _unsubscribe(subscriptions)
                if owned.ref is not None:
                    await owned.ref.stop()
            return
        owned.subscriptions = subscriptions  # serving from now on

    async def _stop(
        self, partition: int, *, give_back: bool, settle: float = SETTLE_TIMEOUT
    ) -> None:
        """Stop serving `partition`; with `give_back`, free its lease for the others at once.

        The lease is given back only once the partition's op writes already sent to the
        server have settled (acked, refused, or given up), for at most `settle` seconds and
        not past the lease's self-fence point: a record landing after a successor took its
        fence would fence the successor out (its instance stops, the lease goes round again:
        seconds with nobody serving). What the actor had only queued was dropped when it
        stopped, and the completions of its topic and half writes are dropped from then on
        (no `done` follows a publish): its successor's recovery redoes that work (a decided
        commit without `done` is published again, deduplicated by its Nats-Msg-Id).
        """
        owned = self.owned.pop(partition, None)
        if owned is None:
            return  # stopped meanwhile by the other loop
        await _unsubscribe(owned.subscriptions)
        if owned.ref is not None:
            await owned.ref.stop()
        if give_back:
            fence = owned.renewed_at + self._options.lease_ttl * SELF_FENCE_FRACTION
            with anyio.move_on_after(max(0.0, min(settle, fence - self._clock()))) as waiting:
                await self._settled(partition)
            if waiting.cancelled_caught:
                log.warning("partition_given_back_unsettled", partition=partition)
            await self._leases.give_back(partition, owned.revision)
        log.info("partition_released", partition=partition, given_back=give_back)

    async def leave(self) -> None:
        """Withdraw, then give every lease back: the others take them over at once."""
        await self._leases.withdraw()
        with ungrouped():
            async with anyio.create_task_group() as stopping:
                for partition in list(self.owned):
                    stopping.start_soon(functools.partial(self._stop, partition, give_back=True))


async def _unsubscribe(subscriptions: list[Subscription]) -> None:
    for subscription in subscriptions:
        with suppress(nats.errors.Error):  # a closed connection has no subscriptions left
            await subscription.unsubscribe()


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

    On entry it publishes its partition count, or checks it against the one published
    (PartitionCountMismatch), then takes the partitions that are free; those held by another
    live coordinator are taken over in the background if their owner goes away. While it
    runs, any other value written to the count's key is put back (agreement.py).
    """
    config = config or CoordinatorConfig()
    options = options or CoordinatorOptions()
    js = nc.jetstream()
    checkpoints = await ensure_streams(js, replicas=options.replicas)
    legacy = await LegacyLog.find(js, checkpoints, config)
    meta = await meta_bucket(js, replicas=options.replicas)
    await agree_partition_count(meta, options.partitions)
    leases = Leases(
        js,
        await lease_bucket(js, ttl=options.lease_ttl, replicas=options.replicas),
        owner or default_owner_id(),
    )

    await declare_consumer_streams(js, options)
    replies = ReplyGuard(
        options.inbox_prefix,
        rule=(
            TenantReplies(normalize_prefix(options.inbox_prefix), tenant_groups(options))
            if options.group_topics
            else None
        ),
        on_refused=metrics.refused_replies.inc if metrics is not None else None,
    )
    with raising_connection_lost(), ungrouped():  # what stopped it, as itself
        async with (
            shared_writers(nc, js, options) as writers,  # outlive the partitions that use them
            ActorSystem("coordinator") as system,
            anyio.create_task_group() as tasks,
        ):

            def make_partition(partition: int) -> PartitionCoordinator:
                return PartitionCoordinator(
                    system=system,
                    nc=nc,
                    js=js,
                    checkpoints=checkpoints,
                    partition=partition,
                    config=config,
                    options=options,
                    writers=writers,
                    legacy=legacy,
                    clock=clock,
                    on_discard=on_discard,
                    metrics=metrics,
                )

            keeper = _PartitionKeeper(
                nc, system, leases, options, make_partition, replies, settled=writers.ops_idle
            )
            tasks.start_soon(keeper.renew)
            tasks.start_soon(keeper.watch)
            await keeper.join()
            tasks.start_soon(keeper.rebalance)
            tasks.start_soon(keeper.spread)
            tasks.start_soon(watch_connection, nc)
            tasks.start_soon(
                functools.partial(
                    keep_partition_count,
                    meta,
                    options.partitions,
                    restored=(
                        metrics.partition_count_restored.inc
                        if metrics is not None
                        else lambda: None
                    ),
                    retry=options.lease_ttl * RETRY_FRACTION,
                )
            )
            try:
                yield RunningCoordinator(leases.owner, keeper.owned)
            finally:
                tasks.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await keeper.leave()
