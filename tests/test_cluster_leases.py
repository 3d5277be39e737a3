"""Lease keeping rides out an election of the lease bucket on a real 3-node cluster.

The node that leads `KV_TXN_LEASE` is killed while a coordinator holds its partitions and
commits go on: renewals fail until the bucket elects a new leader, and the owner must keep
serving through it (a failed renewal is retried soon, and it stops only at the self-fence
point, most of a TTL away), without ever releasing a partition.
"""

from __future__ import annotations

import anyio
import pytest
from structlog.testing import capture_logs

from txactors import layout
from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.leases import lease_bucket
from txactors.coordinator.service import run_coordinator
from txactors.errors import PrepareFailed
from txactors.nats_cluster import EmbeddedNatsCluster
from txactors.natsclient import connect
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage

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
