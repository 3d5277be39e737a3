"""`bench cluster` runs end to end for a few seconds: a 3-node cluster in namespaces of its own
with the delay between the hosts, raw JetStream and txactors committing, and nothing of it
left behind, not even what an earlier run left."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import cluster, netns
from bench.results import table_data

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,  # fixed namespace names, and timing on a shared machine
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not hasattr(os, "geteuid")
        or os.geteuid() != 0
        or shutil.which("ip") is None
        or not Path("/dev/net/tun").exists(),
        reason="needs root, the `ip` command and /dev/net/tun (network namespaces)",
    ),
]


def ours() -> tuple[list[str], list[str]]:
    """The benchmark's namespaces and root-namespace devices that exist now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return (
        [n for n in netns.listed_namespaces(listed) if n.startswith(netns.PREFIX)],
        [d for d in netns.listed_links(links) if d.startswith(netns.DEVICE_PREFIX)],
    )


@pytest.fixture
def leftover() -> None:
    """A namespace of the benchmark's, as a run killed before its teardown leaves one."""
    subprocess.run(["ip", "netns", "add", "txbench-n1"], capture_output=True)  # or there already
    assert "txbench-n1" in ours()[0]


@pytest.mark.usefixtures("leftover")
async def test_a_short_run_commits_through_the_delay_and_cleans_up() -> None:
    options = cluster.Options(
        rtt_ms=1.0, seconds=2.0, warmup=0.5, in_flight=8, partitions=(1,), coordinators=(1,)
    )
    results = await cluster.measure(options)
    assert ours() == ([], [])
    [run] = results.runs
    [lone] = results.lone
    assert run.raw.count > 0 and run.tx.count > 0
    assert lone.tx.count > 0 and lone.raw.count > 0
    assert run.tx.cpu["coordinator"] > 0 and run.tx.cpu["producer"] > 0
    assert all(seconds > 0 for seconds in run.tx.nodes.values()) and len(run.tx.nodes) == 3
    # the delay is on the wire: a round trip takes at least what was asked, and so does
    # every acked publish (a client to the stream leader, the leader to a follower)
    assert results.rtt >= 0.001
    assert min(lone.raw.latencies) >= 0.002
    assert results.wire["packets"] > 0 and results.wire["dropped"] == 0
    rates, one_at_a_time, cpu, model = map(table_data, cluster.tables(results))
    assert (
        rates["rows"][0][0] == one_at_a_time["rows"][0][0] == "1 partition, 1 coordinator process"
    )
    assert float(cpu["rows"][0][cpu["columns"].index("coordinators")]) > 0
    all_nodes, each = cpu["rows"][0][
        cpu["columns"].index("nats-servers: all (n1 / n2 / n3)")
    ].split(" ", 1)
    assert sum(map(float, each.strip("()").split(" / "))) == pytest.approx(
        float(all_nodes), abs=0.003
    )
    assert [row[0] for row in model["rows"]] == ["3", "5", "9"]
