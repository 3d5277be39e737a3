"""Lease keeping rides out an election of the lease bucket on a real 3-node cluster.

The node that leads `KV_TXN_LEASE` is killed while a coordinator holds its partitions and
commits go on: renewals fail until the bucket elects a new leader, and the owner must keep
serving through it (a failed renewal is retried soon, and it stops only at the self-fence
point, most of a TTL away), without ever releasing a partition.
"""

from __future__ import annotations

from contextlib import suppress

import anyio
import nats.errors
import pytest
from structlog.testing import capture_logs

from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.cluster.balance import MemberInfo
from txactors.coordinator.cluster.leases import Leases, lease_bucket
from txactors.coordinator.service import RENEW_FRACTION, run_coordinator
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.errors import PrepareFailed
from txactors.nats.client import connect
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout

pytestmark = pytest.mark.slow

LEASE_TTL = 10.0
PARTITIONS = 2
RELEASED = {"partition_released", "lease_lost", "lease_expiring_stop_serving"}


async def commit_checker(view: CheckView) -> Decision:
    return Decision.COMMIT


async def test_the_owner_keeps_serving_through_an_election_of_the_lease_bucket(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    options = CoordinatorOptions(replicas=3, lease_ttl=LEASE_TTL, partitions=PARTITIONS)
    admin = await connect(nats_cluster.url_list)
    js = admin.jetstream()
    await lease_bucket(js, ttl=LEASE_TTL, replicas=3)
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
                await nats_cluster.kill(leader)
                lease_js = nc.jetstream()
                new_leader = await nats_cluster.stream_leader(
                    lease_js, "KV_" + layout.LEASE_BUCKET, timeout=30
                )
                assert new_leader != leader
                # Keep committing for more than a whole TTL after the kill: any owner that
                # gave up during the election would have stopped serving by then.
                with anyio.move_on_after(LEASE_TTL * 1.2):
                    while True:
                        await commit_one()
                assert coordinator.partitions == list(range(PARTITIONS))
                await nats_cluster.restart(leader)
                await commit_one()
        events = [e["event"] for e in logs]
        assert not RELEASED & set(events), [e for e in logs if e["event"] in RELEASED]
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
    with anyio.fail_after(30):  # the bucket led elsewhere: only the meta group elects
        while (leader := await nats_cluster.stream_leader(js, stream)) == meta:
            with suppress(nats.errors.Error):
                await admin.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=2)
            await anyio.sleep(0.5)
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
