"""`bench cluster`'s pure parts: the hosts and the `ip` commands that wire them, the delay
line's queue, the even split of partitions, the paper model's arithmetic, its command line."""

from __future__ import annotations

import ipaddress

import pytest

from bench import cluster, cluster_model, netns
from bench.netdelay import DelayLine, address_bytes


def ipv4(src: str, dst: str, payload: bytes = b"") -> bytes:
    """An IPv4 header (enough of one for the delay line: version, addresses) and payload."""
    return bytes([0x45]) + bytes(11) + address_bytes(src) + address_bytes(dst) + payload


def test_every_host_has_its_own_namespace_device_and_benchmark_address() -> None:
    plan = netns.plan()
    assert [h.name for h in plan.hosts] == ["ctl", "n1", "n2", "n3", "app"]
    assert [h.name for h in plan.nodes] == ["n1", "n2", "n3"]
    subnet = ipaddress.ip_network("198.18.0.0/24")  # RFC 2544: for benchmarks, routed nowhere
    addresses = [ipaddress.ip_address(h.address) for h in plan.hosts]
    assert all(a in subnet for a in addresses) and len(set(addresses)) == len(addresses)
    assert plan.host("ctl").namespace is None  # the bench process's own
    assert [h.namespace for h in plan.hosts[1:]] == [
        "txbench-n1",
        "txbench-n2",
        "txbench-n3",
        "txbench-app",
    ]
    assert plan.host("n2").run(["nats-server", "-c", "x"]) == [
        *("ip", "netns", "exec", "txbench-n2", "nats-server", "-c", "x")
    ]
    assert plan.host("ctl").run(["true"]) == ["true"]


def test_the_commands_make_attach_and_remove_every_host() -> None:
    plan = netns.plan()
    made = plan.namespaces()
    assert ["ip", "netns", "add", "txbench-app"] in made
    assert ["ip", "-n", "txbench-n1", "link", "set", "lo", "up"] in made
    assert not any("ctl" in " ".join(c) for c in made)  # the root namespace exists already
    attach = plan.attach()
    for host in plan.hosts:
        joined = [" ".join(c) for c in attach]
        if host.namespace is not None:
            assert f"ip link set {host.device} netns {host.namespace}" in joined
        assert any(f"addr add {host.address}/24 dev {host.device}" in c for c in joined)
        assert any(f"link set {host.device} mtu 9000 up" in c for c in joined)
    moved = [i for i, c in enumerate(attach) if "netns" in c and c[:3] == ["ip", "link", "set"]]
    addressed = [i for i, c in enumerate(attach) if "addr" in c]
    assert max(moved) < max(addressed) and moved[0] < addressed[1]  # moved, then addressed
    assert plan.teardown() == [
        ["ip", "netns", "del", "txbench-n1"],
        ["ip", "netns", "del", "txbench-n2"],
        ["ip", "netns", "del", "txbench-n3"],
        ["ip", "netns", "del", "txbench-app"],
        ["ip", "link", "del", "txb-ctl"],
    ]
    assert plan.delay_line_args()[:2] == ["txb-ctl=198.18.0.1", "txb-n1=198.18.0.11"]


def test_leftovers_are_only_the_benchmarks_own() -> None:
    namespaces = netns.listed_namespaces("txbench-n1 (id: 3)\nother\ntxbench-app\n\n")
    assert namespaces == ["txbench-n1", "other", "txbench-app"]
    links = netns.listed_links(
        "1: lo: <LOOPBACK,UP> mtu 65536\n"
        "4: eth0: <BROADCAST> mtu 1400\n"
        "9: txb-ctl: <POINTOPOINT> mtu 9000\n"
        "12: veth0@if11: <BROADCAST> mtu 1500\n"
    )
    assert links == ["lo", "eth0", "txb-ctl", "veth0"]
    assert netns.leftovers(namespaces, links) == [
        ["ip", "netns", "del", "txbench-n1"],
        ["ip", "netns", "del", "txbench-app"],
        ["ip", "link", "del", "txb-ctl"],
    ]


def test_a_packet_leaves_for_its_destination_after_the_delay_in_order() -> None:
    line = DelayLine(0.001, {address_bytes("198.18.0.11"): 5, address_bytes("198.18.0.12"): 6})
    first, second = ipv4("198.18.0.1", "198.18.0.11", b"a"), ipv4("198.18.0.1", "198.18.0.12")
    line.came(10.0, first)
    line.came(10.0004, second)
    assert line.wait(10.0004) == pytest.approx(0.0006)
    assert list(line.due(10.0009)) == []  # not before its time
    assert list(line.due(10.0012)) == [(5, first)]
    assert list(line.due(10.0020)) == [(6, second)]
    assert line.wait(10.0020) is None and line.carried == 2


def test_what_no_host_can_take_is_dropped() -> None:
    line = DelayLine(0.001, {address_bytes("198.18.0.11"): 5})
    line.came(0.0, ipv4("198.18.0.11", "198.18.0.99"))  # nobody's address
    line.came(0.0, bytes([0x60]) + bytes(39))  # IPv6
    line.came(0.0, b"")
    assert line.dropped == 3 and line.wait(0.0) is None
    assert line.report()["packets"] == 0


@pytest.mark.parametrize(
    ("owners", "processes", "split"),
    [
        (["a"], 1, True),
        (["a"], 2, True),  # one partition: the second process stands by
        (["a", None], 1, False),  # a partition nobody owns yet
        (["a"] * 4 + ["b"] * 4, 2, True),
        (["a"] * 5 + ["b"] * 3, 2, False),
        (["a"] * 8, 2, False),
        (["a", "b", "c"], 2, False),  # a third owner: a stale lease
        ([], 1, False),
    ],
)
def test_partitions_are_split_evenly(owners: list[str | None], processes: int, split: bool) -> None:
    assert cluster.evenly_split(owners, processes) is split


PER = cluster_model.PerTransaction(
    coordinator=0.0002,
    producer=0.0001,
    servers=0.0003,
    busiest_server=0.0002,
    raw_servers=0.0001,
    commit_p50=0.010,
)


def test_the_model_shares_the_nodes_cores_out_by_cpu_per_transaction() -> None:
    three = cluster_model.estimate(PER, 3)
    budget = 3 * 8 * 0.7  # 16.8 cores' seconds per second
    assert three.commits == pytest.approx(budget / 0.0005)  # 33,600
    assert three.raw == pytest.approx(budget / 0.0001)
    assert three.ratio == pytest.approx(0.2)
    assert three.coordinator_processes == 10  # 6.72 cores of coordinators at 70% each
    assert three.producer_cores == pytest.approx(33600 * 0.0001 / 0.7)
    assert three.in_flight == 336  # Little: 33,600/s x 10 ms
    nine = cluster_model.estimate(PER, 9)
    assert nine.commits == pytest.approx(3 * three.commits)  # spread: grows with the nodes
    # one log for every partition: its leader's node bounds it, whatever the cluster's size
    assert nine.one_log_leader == pytest.approx(8 * 0.7 / 0.0002) == three.one_log_leader
    assert three.one_log_leader == pytest.approx(28_000)  # already the bound at 3 nodes


def test_the_model_refuses_a_cost_it_cannot_divide_by() -> None:
    with pytest.raises(ValueError, match="positive"):
        cluster_model.estimate(
            cluster_model.PerTransaction(0.0, 0.0, 0.0, 0.0, 0.0, 0.0), cluster_model.NODES[0]
        )


def test_the_command_line_gives_the_options_and_the_command_reproduces_them() -> None:
    assert cluster.parse([]) == (cluster.Options(), False, None)
    options, quick, directory = cluster.parse(["--quick", "--rtt-ms", "1", "--partitions", "4"])
    assert options == cluster.Options(
        rtt_ms=1.0, seconds=3.0, warmup=1.0, partitions=(4,), rounds=1
    )
    assert quick and directory is None
    assert cluster.command(cluster.Options(), quick=False) == "python3 dev.py bench cluster"
    assert cluster.command(cluster.QUICK, quick=True) == "python3 dev.py bench cluster --quick"
    assert cluster.command(options, quick=True) == (
        "PYTHONPATH=. .venv/bin/python -m bench.cluster --quick --rtt-ms 1.0 --partitions 4"
    )
    assert cluster.command(cluster.Options(rounds=5), quick=False).endswith("cluster --rounds 5")
    with pytest.raises(SystemExit):
        cluster.parse(["--in-flight", "1", "--producers", "2"])
    with pytest.raises(SystemExit):
        cluster.parse(["--rounds", "0"])


def measured(count: int, seconds: float, coordinator: float = 0.0) -> cluster.Measured:
    return cluster.Measured(
        count, seconds, [0.001] * count, {"coordinator": coordinator}, {"n1": 0.1, "n2": 0.2}
    )


def test_rounds_give_median_rates_and_pooled_costs() -> None:
    run = cluster.Run(8, 2)
    run.rounds += [
        (measured(300, 1.0), measured(100, 1.0, 0.02)),  # 33%
        (measured(200, 1.0), measured(100, 1.0, 0.02)),  # 50%
        (measured(400, 2.0), measured(500, 2.0, 0.10)),  # 125%: a round the load spared
    ]
    assert run.rate(0) == 200 and run.rate(1) == 100
    assert run.ratios() == pytest.approx([1 / 3, 1 / 2, 5 / 4])
    tx = run.tx
    assert tx.count == 700 and tx.seconds == 4.0 and len(tx.latencies) == 700
    assert tx.per_op("coordinator") == pytest.approx(0.14 / 700)
    assert tx.nodes == pytest.approx({"n1": 0.3, "n2": 0.6})
    assert run.label == "8 partitions, 2 coordinator processes"
