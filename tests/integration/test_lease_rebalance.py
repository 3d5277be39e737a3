"""Partitions spread over the live coordinators: one that joins takes its share within two
lease TTLs, one that leaves hands its partitions over at once, one that dies loses them after
the TTL; and no partition is ever served by two of them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import nats
from anyio.abc import TaskStatus
from nats.aio.client import Client

from tests.support.coordinator_process import CoordinatorProcess
from tests.support.servers import MakeNatsServer
from tests.support.wait import eventually
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import RunningCoordinator, run_coordinator
from txactors.ops import leases as lease_admin

PARTITIONS = 8


@asynccontextmanager
async def connected(nc: Client) -> AsyncIterator[Client]:
    """A second connection to the server of `nc` (each coordinator has its own)."""
    url = nc.connected_url.geturl() if nc.connected_url else ""
    other = await nats.connect(url)
    try:
        yield other
    finally:
        await other.close()


async def never_served_twice(*coordinators: RunningCoordinator) -> None:
    """Runs until cancelled: no partition is ever served by two coordinators at once."""
    while True:
        served = [p for c in coordinators for p in c.partitions]
        assert len(served) == len(set(served)), f"served twice: {sorted(served)}"
        await anyio.sleep(0.005)  # the next sample: a watch that runs until cancelled, no wait


async def test_a_coordinator_that_joins_takes_its_share_within_two_ttls(
    private_nc: Client,
) -> None:
    options = CoordinatorOptions(partitions=PARTITIONS, lease_ttl=1.5)
    async with (
        connected(private_nc) as other_nc,
        run_coordinator(private_nc, options=options, owner="first") as first,
    ):
        assert first.partitions == list(range(PARTITIONS)), "alone, it takes them all"
        joined = time.monotonic()
        async with (
            run_coordinator(other_nc, options=options, owner="second") as second,
            anyio.create_task_group() as watching,
        ):
            watching.start_soon(never_served_twice, first, second)
            await eventually(
                lambda: (len(first.partitions), len(second.partitions)),
                until=lambda held: held == (4, 4),
                timeout=2 * options.lease_ttl,
                what="four partitions each",
            )
            took = time.monotonic() - joined
            table = await lease_admin.list_leases(private_nc)
            assert {m.owner: (m.held, m.share) for m in table.members} == {
                "first": (4, 4),
                "second": (4, 4),
            }
            watching.cancel_scope.cancel()
    assert took < 2 * options.lease_ttl


async def test_a_coordinator_that_leaves_hands_its_partitions_over_at_once(
    private_nc: Client,
) -> None:
    """Well before the next poll (a third of the TTL): the others watch the bucket."""
    options = CoordinatorOptions(partitions=PARTITIONS, lease_ttl=6.0)
    leaves = anyio.Event()
    left = 0.0

    async def run_leaving(*, task_status: TaskStatus[RunningCoordinator]) -> None:
        nonlocal left
        async with (
            connected(private_nc) as other_nc,
            run_coordinator(other_nc, options=options, owner="leaving") as leaving,
        ):
            task_status.started(leaving)
            await leaves.wait()
            left = time.monotonic()

    async with (
        run_coordinator(private_nc, options=options, owner="staying") as staying,
        anyio.create_task_group() as tasks,
    ):
        leaving = await tasks.start(run_leaving)
        await eventually(
            lambda: (len(staying.partitions), len(leaving.partitions)),
            until=lambda held: held == (4, 4),
            timeout=2 * options.lease_ttl,
            what="four partitions each",
        )
        tasks.start_soon(never_served_twice, staying, leaving)
        leaves.set()
        await eventually(
            lambda: staying.partitions,
            until=lambda held: held == list(range(PARTITIONS)),
            timeout=options.lease_ttl,
            what="every partition with the one staying",
        )
        took = time.monotonic() - left
        tasks.cancel_scope.cancel()
    assert took < options.lease_ttl / 4, f"took {took:.2f}s"


async def test_a_coordinator_that_dies_loses_its_partitions_after_the_ttl(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    server = await make_nats_server()
    ttl = 2.0
    coordinators = [
        CoordinatorProcess(server.url, _dir(tmp_path, name), partitions=4) for name in ("a", "b")
    ]
    nc = await nats.connect(server.url)
    try:
        for coordinator in coordinators:
            await coordinator.start()
        table = await _until(nc, lambda t: sorted(m.held for m in t.members) == [2, 2], 4 * ttl)
        victim, survivor = coordinators
        victim_id = _owner_of(table, victim)
        await victim.kill()
        killed = time.monotonic()
        table = await _until(
            nc, lambda t: {lease.owner for lease in t.leases} == {_owner_of(t, survivor)}, 3 * ttl
        )
        took = time.monotonic() - killed
        assert all(lease.owner != victim_id for lease in table.leases)
        assert ttl * 0.5 < took < ttl + 1.5, f"took {took:.2f}s: after the TTL, not before"
    finally:
        await nc.close()
        for coordinator in coordinators:
            await coordinator.kill()


def _dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def _owner_of(table: lease_admin.LeaseTable, coordinator: CoordinatorProcess) -> str:
    [owner] = [m.owner for m in table.members if f"-{coordinator.pid}-" in m.owner]
    return owner


async def _until(
    nc: Client, done: Callable[[lease_admin.LeaseTable], bool], timeout: float
) -> lease_admin.LeaseTable:
    """The lease table once `done` holds (the 4 partitions of the process tests)."""
    return await eventually(
        lambda: lease_admin.list_leases(nc, partitions=4),
        until=done,
        timeout=timeout,
        what="the lease table as expected",
    )
