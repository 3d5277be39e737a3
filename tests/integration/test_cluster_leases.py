"""Lease keeping rides out an election of the lease bucket on a real 3-node cluster.

The node that leads `KV_TXN_LEASE` is killed while a coordinator holds its partitions and
commits go on: renewals fail until the bucket elects a new leader, and the owner must keep
serving through it (a failed renewal is retried soon, and it stops only at the self-fence
point, most of a TTL away), without ever releasing a partition.

That holds for an election that ends within the fence's budget, so the riding-out test takes a
TTL that gives the longest election a loaded machine sees (`longest_election`, from the
server's raft timeout) that budget (`ride_out_ttl`): an owner
that fences itself during a slow election with a TTL too short for it is right to.
"""

from __future__ import annotations

import time
from contextlib import suppress

import anyio
import nats.errors
import pytest
from structlog.testing import capture_logs

from tests.support.cluster import longest_election
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.cluster.balance import MemberInfo
from txactors.coordinator.cluster.leases import Leases, lease_bucket
from txactors.coordinator.service import (
    RENEW_FRACTION,
    RETRY_FRACTION,
    SELF_FENCE_FRACTION,
    run_coordinator,
)
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.errors import PrepareFailed
from txactors.nats.client import connect
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout

pytestmark = pytest.mark.slow

LEASE_TTL = 10.0
PARTITIONS = 2
KILL_LEAD = 0.5
"""Seconds before a round of renewals is due that the lease bucket's leader is killed: less than
the shortest election, so the round falls within it."""


def ride_out_ttl(election: float) -> float:
    """The shortest lease TTL whose owner keeps its leases through an election of `election`
    seconds, wherever in the renewal cycle the leader dies: the last renewal may be a whole
    renewal period old, and after the election the next attempt may wait out one failed
    attempt and one retry delay, all before the self-fence point (an attempt's floor of
    `ATTEMPT_FLOOR` is far below a tenth of such a TTL)."""
    return election / (SELF_FENCE_FRACTION - RENEW_FRACTION - 2 * RETRY_FRACTION)


RELEASED = {"partition_released", "lease_lost", "lease_expiring_stop_serving"}


async def commit_checker(view: CheckView) -> Decision:
    return Decision.COMMIT


async def test_the_owner_keeps_serving_through_an_election_of_the_lease_bucket(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    admin = await connect(nats_cluster.url_list)
    election = longest_election(admin.connected_server_version)
    ttl = ride_out_ttl(election)
    options = CoordinatorOptions(replicas=3, lease_ttl=ttl, partitions=PARTITIONS)
    js = admin.jetstream()
    await lease_bucket(js, ttl=ttl, replicas=3)
    leader = await nats_cluster.stream_leader(js, "KV_" + layout.LEASE_BUCKET)
    await admin.close()
    # The coordinator and producer talk to the two other nodes only: the election, not a
    # dropped connection, is what they must ride out.
    others = [url for i, url in enumerate(nats_cluster.url_list) if i != leader]
    nc = await connect(others)
    committed = 0
    try:
        with capture_logs() as logs:
            async with (
                run_coordinator(nc, options=options) as coordinator,
                TransactionProducer(nc, "shop", commit_checker, partitions=PARTITIONS) as producer,
            ):
                assert coordinator.partitions == list(range(PARTITIONS))

                async def commit_one() -> None:
                    nonlocal committed
                    with anyio.fail_after(30):
                        while True:
                            try:
                                await producer.send_in_transaction(
                                    TxMessage("orders", b"x"), lambda m, a: Decision.COMMIT
                                )
                                committed += 1
                                return
                            except PrepareFailed:  # the documented retriable error
                                await anyio.sleep(0.1)

                await commit_one()
                # The worst moment for the owner (the one `ttl` is derived for): just before a
                # round of renewals is due, its last renewal a whole period old. This sleep is
                # the scenario, not a wait for something to happen.
                last = max(o.renewed_at for o in coordinator.owned.values())
                due = last + ttl * RENEW_FRACTION
                await anyio.sleep(max(0.0, due - KILL_LEAD - time.monotonic()))
                await nats_cluster.kill(leader)
                lease_js = nc.jetstream()
                new_leader = await nats_cluster.stream_leader(
                    lease_js, "KV_" + layout.LEASE_BUCKET, timeout=max(30, election)
                )
                elected = time.monotonic()
                assert new_leader != leader

                def renewed_since_the_election() -> bool:
                    owned = coordinator.owned.values()
                    return bool(owned) and all(o.renewed_at >= elected for o in owned)

                # Keep committing until every lease was renewed after the election (the
                # keeper's clock is time.monotonic): an owner that gave up during it would
                # have stopped serving before; one renewed since is clear of its fence point.
                with anyio.fail_after(ttl):
                    await commit_one()
                    while not renewed_since_the_election():
                        await commit_one()
                assert coordinator.partitions == list(range(PARTITIONS))
                await nats_cluster.restart(leader)
                await commit_one()
        events = [e["event"] for e in logs]
        assert not RELEASED & set(events), [e for e in logs if e["event"] in RELEASED]
        assert "lease_renew_failed" in events, "no renewal fell within the election"
        assert committed >= 3
    finally:
        await nc.close()


async def test_a_view_needs_no_meta_leader(nats_cluster: EmbeddedNatsCluster) -> None:
    """While the cluster elects a JetStream meta leader (seconds after the node leading it
    died), the lease bucket's leader still answers a view: the partitions a dead coordinator
    left free are taken without waiting for the election."""
    admin = await connect(nats_cluster.url_list)
    js = admin.jetstream()
    stream = "KV_" + layout.LEASE_BUCKET
    kv = await lease_bucket(js, ttl=LEASE_TTL, replicas=3)
    await nats_cluster.stream_leader(js, stream)  # a new bucket elects its leader first
    writer = Leases(js, kv, "other")
    await writer.announce(MemberInfo(partitions=PARTITIONS, max_partitions=PARTITIONS))
    assert await writer.take(0) is not None
    meta = await nats_cluster.meta_leader()
    assert meta is not None

    async def led_elsewhere() -> int | None:
        """The bucket's leader once it is not the meta leader; until then, asks it to step
        down (so that, the meta leader killed, only the meta group elects)."""
        leader = await nats_cluster.stream_leader(js, stream)
        if leader != meta:
            return leader
        with suppress(nats.errors.Error):
            await admin.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=2)
        return None

    leader = await eventually(
        led_elsewhere, until=lambda led: led is not None, timeout=30, interval=0.5
    )
    await admin.close()
    nc = await connect([url for i, url in enumerate(nats_cluster.url_list) if i != meta])
    try:
        lease_js = nc.jetstream()
        leases = Leases(lease_js, await lease_js.key_value(layout.LEASE_BUCKET), "me")
        await nats_cluster.kill(meta)
        view = await leases.view(timeout=LEASE_TTL * RENEW_FRACTION)
        assert await nats_cluster.meta_leader() is None, "read after the meta election"
        assert view.holders == {0: "other"}
        assert set(view.members) == {"other"}
        assert await nats_cluster.stream_leader(lease_js, stream) == leader
    finally:
        await nc.close()
