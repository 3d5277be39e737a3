"""Clients leave a node that cannot serve them (`nats/watchdog.py`): one cut off from the other
two, its clients still connected to it, or one paused. A producer and a consumer on that node
move to another node, and commits go on and are delivered, while the node is still away.

The node faulted is never the JetStream meta leader: a cut-off meta leader answers the watch's
probe until it steps down (10-20 s), which docs/operations.md states and the bench measures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest
from nats.aio.client import Client

from tests.integration.test_coordinator_recovery import capture_logs
from tests.support.cluster import longest_election
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.errors import PrepareFailed
from txactors.nats.client import TolerantClient, connect
from txactors.nats.watchdog import DEFAULT_WATCH, WatchPolicy
from txactors.producer import Decision, TransactionProducer, TxMessage

pytestmark = pytest.mark.timeout(240)

LEASE_TTL = 2.0
LOAD_MARGIN = 6.0
"""Seconds a loaded machine adds to a wait (a starved loop, a slow reconnect)."""


def leaving_bound() -> float:
    """Seconds from the fault until a client has left the node: its first sign (a prepare
    answered "no responders", a pull lost, a PING unanswered: within a ping period and a
    pull's expiry), then probes failing for the grace, each waiting out its timeout."""
    watch = DEFAULT_WATCH
    first_sign = watch.ping_every + watch.probe_timeout + 2.0
    return first_sign + watch.grace + 2 * (watch.probe_every + watch.probe_timeout) + LOAD_MARGIN


def on(nc: Client) -> str:
    url = nc.connected_url
    return "" if url is None else f"nats://{url.hostname}:{url.port}"


class Deployment:
    """A coordinator on node `home`, and a producer and a consumer connected to node
    `victim` first (the others listed after it, so they have somewhere to go)."""

    def __init__(self, cluster: EmbeddedNatsCluster, victim: int, home: int) -> None:
        self.cluster = cluster
        self.victim_url = cluster.nodes[victim].url
        self.home_url = cluster.nodes[home].url
        self.received: set[str] = set()
        self.producer_nc: TolerantClient | None = None
        self.consumer_nc: TolerantClient | None = None
        self.producer: TransactionProducer | None = None

    async def _client(self, first: str) -> TolerantClient:
        others = [u for u in self.cluster.url_list if u != first]
        return await connect(
            [first, *others],
            dont_randomize=True,
            reconnect_time_wait=0.2,
            max_reconnect_attempts=-1,
        )

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Deployment]:
        async def handle(message: ConsumedMessage) -> None:
            self.received.add(message.msg_id)

        async with AsyncExitStack() as stack:
            coordinator_nc = await connect(self.home_url, server_watch=None)
            stack.push_async_callback(coordinator_nc.close)
            self.producer_nc = await self._client(self.victim_url)
            stack.push_async_callback(self.producer_nc.close)
            self.consumer_nc = await self._client(self.victim_url)
            stack.push_async_callback(self.consumer_nc.close)
            options = CoordinatorOptions(replicas=3, lease_ttl=LEASE_TTL)
            await stack.enter_async_context(run_coordinator(coordinator_nc, options=options))
            await stack.enter_async_context(
                Consumer(self.consumer_nc, "orders", "audit", handle, replicas=3)
            )
            self.producer = await stack.enter_async_context(
                TransactionProducer(self.producer_nc, "shop", lambda view: Decision.COMMIT)
            )
            assert on(self.producer_nc) == on(self.consumer_nc) == self.victim_url
            yield self

    async def commit(self, timeout: float) -> str:
        """One transaction committed (a PrepareFailed retried, as an application would) and
        delivered; its message id."""
        assert self.producer is not None
        with anyio.fail_after(timeout):
            while True:
                try:
                    result = await self.producer.send_in_transaction(
                        TxMessage("orders", b"after the fault"), lambda m, a: Decision.COMMIT
                    )
                    break
                except PrepareFailed:
                    await anyio.sleep(0.2)
        msg_id = f"{result.txid}:0"
        await eventually(lambda: msg_id in self.received, timeout=timeout, what="delivered")
        return msg_id

    def moved(self) -> Callable[[], bool]:
        def away() -> bool:
            assert self.producer_nc is not None and self.consumer_nc is not None
            return all(
                nc.is_connected and on(nc) != self.victim_url
                for nc in (self.producer_nc, self.consumer_nc)
            )

        return away


async def committing_while_leaving(deployment: Deployment, resume_bound: float) -> None:
    """The producer commits (its failed prepares are its signs of trouble; an idle producer
    has no reason to move) and the consumer pulls: both leave the node within
    `leaving_bound`, and the commit is delivered once the cluster elected without it."""
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(
            deployment.commit, leaving_bound() + resume_bound + 4 * LEASE_TTL + LOAD_MARGIN
        )
        await eventually(
            deployment.moved(), timeout=leaving_bound(), what="producer and consumer left"
        )


async def faulted_node(cluster: EmbeddedNatsCluster) -> tuple[int, int]:
    """(a node that does not lead the meta group, another node for the coordinator)."""
    leader = await eventually(cluster.meta_leader, until=lambda i: i is not None)
    victim = (leader + 1) % cluster.size
    return victim, (victim + 1) % cluster.size


async def test_clients_leave_a_node_cut_off_and_commits_go_on(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    victim, home = await faulted_node(nats_cluster)
    async with Deployment(nats_cluster, victim, home).running() as deployment:
        assert deployment.producer_nc is not None
        resume_bound = longest_election(deployment.producer_nc.connected_server_version)
        await deployment.commit(timeout=30)
        await nats_cluster.cut(victim)
        try:
            await committing_while_leaving(deployment, resume_bound)
            assert nats_cluster.is_cut(victim)  # all of it happened during the cut
        finally:
            await nats_cluster.heal(victim)


async def test_clients_leave_a_paused_node_and_commits_go_on(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    victim, home = await faulted_node(nats_cluster)
    async with Deployment(nats_cluster, victim, home).running() as deployment:
        assert deployment.producer_nc is not None
        resume_bound = longest_election(deployment.producer_nc.connected_server_version)
        await deployment.commit(timeout=30)
        nats_cluster.pause(victim)
        try:
            await committing_while_leaving(deployment, resume_bound)
            assert nats_cluster.nodes[victim].paused
        finally:
            nats_cluster.resume(victim)


async def test_clients_stay_where_they_are_while_the_rest_of_the_cluster_elects(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    """The meta leader killed: no server answers JetStream until the other two elect, so a
    client on one of them, though its server fails the watch, finds no better one and stays
    (a short grace makes it look while the election runs: at least 4 s)."""
    leader = await eventually(nats_cluster.meta_leader, until=lambda i: i is not None)
    home = (leader + 1) % nats_cluster.size
    quick = WatchPolicy(grace=0.5, probe_every=0.25, probe_timeout=0.5, max_grace=0.5)
    nc = await connect([nats_cluster.nodes[home].url], reconnect_time_wait=0.2, server_watch=quick)
    try:
        assert on(nc) == nats_cluster.nodes[home].url
        with capture_logs() as logs:
            await nats_cluster.kill(leader)
            await eventually(
                nats_cluster.meta_leader,
                until=lambda i: i not in (None, leader),
                timeout=longest_election(nc.connected_server_version),
                what="a new meta leader",
            )
        events = [e["event"] for e in logs if e["event"].startswith("nats_server_")]
        assert "nats_server_kept" in events, events
        assert "nats_server_left" not in events, events
        assert on(nc) == nats_cluster.nodes[home].url and nc.stats["reconnects"] == 0
    finally:
        await nc.close()
