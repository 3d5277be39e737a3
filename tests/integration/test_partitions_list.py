"""`txactors partitions list` and `balance` on one server, as an operator runs them: each
partition's owner, its log's leader, replicas current and open transactions, from a real
coordinator. (On the 3-node cluster: tests/integration/test_cluster_spread.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import msgspec
from nats.aio.client import Client

from tests.support.txn import CoordinatorClient, message
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.ops.placement import PartitionTable, list_partitions
from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]
PENDING = 600.0


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


def _url(nc: Client) -> str:
    assert nc.connected_url is not None
    return nc.connected_url.geturl()


def _txid_in(partition: int, partitions: int, name: str) -> str:
    return next(
        txid
        for i in range(10_000)
        if layout.partition_of(txid := f"{name}-{i}", partitions) == partition
    )


async def test_partitions_list_shows_owner_leader_and_open_transactions(
    private_nc: Client,
) -> None:
    options = CoordinatorOptions(partitions=3, max_partitions=2)
    url = _url(private_nc)
    async with run_coordinator(private_nc, options=options, owner="coord-a") as running:
        served = running.partitions
        assert len(served) == 2
        busy = served[0]
        client = CoordinatorClient(private_nc, partition=busy)
        for name in ("one", "two"):
            await client.prepare(_txid_in(busy, 3, name), message(check_immunity=PENDING))

        (code, out, err), (shown, text, _), (wrong, _, refused) = await asyncio.gather(
            _cli("partitions", "list", "--url", url, "--json"),
            _cli("partitions", "list", "--url", url),
            _cli("partitions", "list", "--url", url, "--partitions", "2"),
        )
        direct = await list_partitions(private_nc)
    assert code == 0, err
    table = msgspec.json.decode(out, type=PartitionTable)
    assert table == direct
    assert table.partitions == 3 and [row.partition for row in table.rows] == [0, 1, 2]
    server = private_nc._server_info["server_name"]
    for row in table.rows:
        if row.partition in served:
            assert (row.owner, row.owner_server, row.leader) == ("coord-a", server, server)
            assert row.current and row.replicas == [] and not row.apart
            assert (row.open, row.discarded) == ((2, 0) if row.partition == busy else (0, 0))
        else:  # nobody took it: no owner, no log yet, no count
            assert (row.owner, row.leader, row.open) == (None, None, None)
            assert row.error == "no owner"
    assert table.leaders == {server: 2}
    assert shown == 0 and "coord-a" in text and "free" in text, text
    assert wrong == 2 and "set to 2 here, but the coordinators use 3" in refused, refused


async def test_partitions_balance_on_one_server_has_nothing_to_move(private_nc: Client) -> None:
    async with run_coordinator(private_nc, options=CoordinatorOptions(partitions=2)):
        (code, out, err), (dry, text, _) = await asyncio.gather(
            _cli("partitions", "balance", "--url", _url(private_nc), "--json"),
            _cli("partitions", "balance", "--url", _url(private_nc), "--dry-run"),
        )
    assert code == 0, err
    report = json.loads(out)
    assert report["planned"] == [] and report["moved"] == [] and report["waiting"] is None
    assert dry == 0 and text.startswith("balanced"), text


async def test_partitions_list_without_a_coordinator_is_refused(private_nc: Client) -> None:
    code, out, _ = await _cli("partitions", "list", "--url", _url(private_nc), "--json")
    assert code == 2 and json.loads(out)["error"], out
