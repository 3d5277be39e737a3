"""The partitions' logs on the 3-node cluster: `txactors partitions list` shows where each is
led, and leaders piled up on one node are spread back, by `txactors partitions balance` and by
the coordinator on its own (the owner of partition 0, every `leader_balance_interval`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from nats.aio.client import Client

from tests.support.wait import eventually
from txactors.coordinator.cluster.placement import read_placement, step_down
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.nats.client import connect
from txactors.ops.placement import list_partitions
from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]
NODES = {"n1", "n2", "n3"}
PARTITIONS = 6


@asynccontextmanager
async def coordinating(
    cluster: EmbeddedNatsCluster, *, interval: float = 0.0
) -> AsyncIterator[Client]:
    """A coordinator of all six partitions with R3 logs, connected to node n1 only."""
    nc = await connect(cluster.nodes[0].url)
    options = CoordinatorOptions(
        partitions=PARTITIONS, replicas=3, leader_balance_interval=interval
    )
    try:
        async with run_coordinator(nc, options=options) as running:
            await eventually(lambda: len(running.partitions) == PARTITIONS, timeout=60)
            yield nc
    finally:
        await nc.close()


async def leaders(nc: Client) -> dict[str, str | None]:
    placements = await read_placement(nc.jetstream(), range(PARTITIONS))
    return {p.stream: p.leader for p in placements}


async def spread_evenly(nc: Client) -> bool:
    found = await leaders(nc)
    return None not in found.values() and set(Counter(found.values()).values()) == {2}


async def pile_on(nc: Client, node: str) -> None:
    """Every log led by `node` (as after the other two restarted)."""
    for stream, leader in (await leaders(nc)).items():
        if leader != node:
            await step_down(nc, stream, node)
    assert set((await leaders(nc)).values()) == {node}


async def _cli(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TXACTORS_", "NATS_"))}
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "txactors.cli", *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_partitions_list_shows_each_log_leader_and_its_replicas_current(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    async with coordinating(nats_cluster) as nc:
        await eventually(
            lambda: list_partitions(nc),
            until=lambda table: all(row.current for row in table.rows),
            timeout=30,
        )
        code, out, err = await _cli("partitions", "list", "--url", nats_cluster.urls, "--json")
    assert code == 0, err
    table = json.loads(out)
    rows = table["rows"]
    assert [row["partition"] for row in rows] == list(range(PARTITIONS))
    for row in rows:
        assert row["stream"] == layout.log_stream(row["partition"])
        assert row["leader"] in NODES and row["owner_server"] == "n1"
        assert len(row["replicas"]) == 2 and all(r["current"] for r in row["replicas"])
        assert {r["name"] for r in row["replicas"]} | {row["leader"]} == NODES
        assert row["apart"] == (row["leader"] != "n1")
        assert (row["open"], row["discarded"]) == (0, 0)
    assert sum(table["leaders"].values()) == PARTITIONS and set(table["leaders"]) == NODES


async def test_partitions_balance_spreads_leaders_piled_on_one_node(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    async with coordinating(nats_cluster) as nc:
        await pile_on(nc, "n2")
        code, out, err = await _cli(
            "partitions", "balance", "--url", nats_cluster.urls, "--dry-run", "--json"
        )
        assert code == 0, err
        assert len(json.loads(out)["planned"]) == 4
        assert set((await leaders(nc)).values()) == {"n2"}, "a dry run moves nothing"
        code, out, err = await _cli("partitions", "balance", "--url", nats_cluster.urls)
        assert code == 0, out + err
        assert out.count("moved TXN_LOG_") == 4, out
        assert await spread_evenly(nc)
        code, out, _ = await _cli("partitions", "balance", "--url", nats_cluster.urls)
        assert code == 0 and out.startswith("balanced"), out


async def test_the_coordinator_spreads_piled_leaders_on_its_own(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    async with coordinating(nats_cluster, interval=0.5) as nc:
        await eventually(lambda: spread_evenly(nc), timeout=30, what="spread from the start")
    admin = await connect(nats_cluster.url_list)
    try:
        await pile_on(admin, "n3")  # while no coordinator runs, which would spread them
        async with coordinating(nats_cluster, interval=0.5):
            await eventually(lambda: spread_evenly(admin), timeout=30, what="spread again")
    finally:
        await admin.close()


@pytest.mark.slow
async def test_after_a_node_returns_the_coordinator_hands_it_back_its_share(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    async with coordinating(nats_cluster, interval=0.5) as nc:
        await eventually(lambda: spread_evenly(nc), timeout=30, what="spread from the start")
        await nats_cluster.kill(2)  # n3: its logs elect leaders among n1 and n2
        found = await eventually(
            lambda: leaders(nc),
            until=lambda found: set(found.values()) <= {"n1", "n2"},
            timeout=60,
            what="every log led by a survivor",
        )
        assert Counter(found.values())["n3"] == 0
        await nats_cluster.restart(2)  # returns once every stream caught up
        await eventually(lambda: spread_evenly(nc), timeout=60, what="n3 leads its share again")


async def test_a_coordinator_keeps_the_partitions_whose_log_its_server_leads(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    """Two coordinators, on n1 and on n2, split six partitions whose logs n2 leads (0-2) and
    n1 leads (3-5): each ends up owning those its own server leads."""
    async with coordinating(nats_cluster):  # creates the six logs, then leaves
        pass
    admin = await connect(nats_cluster.url_list)
    first = await connect(nats_cluster.nodes[0].url)
    second = await connect(nats_cluster.nodes[1].url)
    options = CoordinatorOptions(partitions=PARTITIONS, replicas=3, leader_balance_interval=0)
    try:
        for partition in range(PARTITIONS):
            stream, wanted = layout.log_stream(partition), "n2" if partition < 3 else "n1"
            if (await leaders(admin))[stream] != wanted:
                await step_down(admin, stream, wanted)
        async with run_coordinator(first, options=options, owner="on-n1") as a:
            await eventually(lambda: len(a.partitions) == PARTITIONS, timeout=60)
            async with run_coordinator(second, options=options, owner="on-n2") as b:
                await eventually(
                    lambda: (a.partitions, b.partitions),
                    until=lambda split: len(split[0]) == len(split[1]) == 3,
                    timeout=60,
                    what="three partitions each",
                )
                assert (a.partitions, b.partitions) == ([3, 4, 5], [0, 1, 2])
                table = await eventually(
                    lambda: list_partitions(admin),
                    until=lambda table: all(row.owner_server for row in table.rows),
                )
                assert not any(row.apart for row in table.rows)
    finally:
        for nc in (admin, first, second):
            await nc.close()
