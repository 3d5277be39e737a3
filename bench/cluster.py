"""Transactional messages on a 3-node cluster with a data center's delay between the hosts,
next to raw JetStream on the same cluster in the same run, and what more nodes would commit.

`python -m bench.cluster [--rtt-ms MS] [--seconds S] [--warmup S] [--in-flight N]
[--producers N] [--partitions 1,8] [--coordinators 1,2] [--quick] [--json DIR]`
(also `python3 dev.py bench cluster`, with the defaults). Needs root: it makes network
namespaces.

- Hosts (`bench.netns`): each nats-server node in a network namespace of its own, the
  producers in another, every packet between two hosts delayed by half of `--rtt-ms`
  (`bench.netdelay`). Every namespace and device is removed at the end, on Ctrl-C or a
  failure too, and what a killed run left is removed at the start.
- The cluster: 3 nodes (`EmbeddedNatsServer`, fsync `always`), a fresh one per partition
  count; the topic streams R3.
- Per partition count (1, 8) and number of coordinator processes (1, 2): raw JetStream first
  (`--producers` processes of acked publishes to an R3 stream, `--in-flight` awaiting their
  acks in all), then the same processes as `TransactionProducer`s with as many transactions
  in flight, against coordinators started by the CLI (`txactors coordinator --replicas 3
  --partitions P`), coordinator k on node k's host (connected to its own node), as one per
  host is deployed. Each run loads `--warmup` seconds, then is measured for `--seconds`;
  `--rounds` rounds of every configuration, interleaved, and the rates are their medians.
- Measured: commits (acked publishes) per second, latency, and CPU seconds of every process
  by role over the measured window, per transaction. The wire's own CPU (the delay line) is
  shown apart and charged to no role.
- The paper model (`bench.cluster_model`) from the CPU per transaction of the last
  configuration (most partitions and coordinators): 3, 5 and 9 nodes of 8 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from rich.console import Console
from rich.table import Table

from bench import cluster_model, netns
from bench.deployed import ROOT, cpu_seconds, serving
from bench.results import record, write
from bench.transactions import percentile
from txactors.actors.loop import run as run_on_loop
from txactors.embedded.server import ClusterNode, EmbeddedNatsServer
from txactors.embedded.setup import find_nats_server_binary
from txactors.nats.topics import ensure_topic_stream
from txactors.observe.logs import configure_logging
from txactors.ops.leases import list_leases

ROUTE_PORT = 16222
MONITOR_PORT = 18222
"""Each node has its own address: fixed ports (never 4222) cannot collide."""
RAW_TOPIC = "clusterraw"
TX_TOPIC = "clustertx"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
LONE_SECONDS = 5.0
"""Seconds of the one-at-a-time runs at most (their latency settles fast)."""
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Options:
    rtt_ms: float = 0.5
    """Round trip between any two hosts, half of it each way (a data center: 0.2 to 1 ms)."""
    seconds: float = 10.0
    warmup: float = 2.0
    in_flight: int = 64
    """Transactions (raw: publishes) in flight in all, split over the producer processes."""
    producers: int = 2
    partitions: tuple[int, ...] = (1, 8)
    coordinators: tuple[int, ...] = (1, 2)
    rounds: int = 3
    """Rounds of every configuration, interleaved: the rates are their medians (a shared
    machine's load moves a single run's rate by tens of percent)."""

    def args(self, base: Options | None = None) -> list[str]:
        """The command-line flags that give these options from `base` (default: the
        defaults): only those that differ."""
        default = base or Options()
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != getattr(default, f.name):
                shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
                out += [f"--{f.name.replace('_', '-')}", shown]
        return out


QUICK = Options(seconds=3.0, warmup=1.0, rounds=1)


def die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when this process dies, so a
    killed benchmark leaves no process behind (namespaces are removed by the next run)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


@dataclass
class Network:
    """The hosts, the delay line's process, and what it said it carried once stopped."""

    plan: netns.Plan
    delay_line: asyncio.subprocess.Process
    report: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """One run of the benchmark at a time on a machine (the namespaces have fixed names)."""
    netns.LOCK.parent.mkdir(parents=True, exist_ok=True)
    with netns.LOCK.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise netns.NoNamespaces(
                f"another bench cluster runs on this machine (lock {netns.LOCK})"
            ) from None
        yield


@contextlib.asynccontextmanager
async def network(one_way_ms: float, logs: Path) -> AsyncIterator[Network]:
    """The hosts and the wire between them; everything removed on the way out."""
    netns.check_usable()
    with exclusive():
        netns.remove_leftovers()
        plan = netns.plan()
        line: asyncio.subprocess.Process | None = None
        try:
            netns.run(plan.namespaces())
            with (logs / "netdelay.log").open("ab") as log:
                line = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-m", "bench.netdelay", str(one_way_ms)),
                    *plan.delay_line_args(),
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    preexec_fn=die_with_parent,
                )
            await expect(line, "ready", 10.0, "the delay line")
            netns.run(plan.attach())
            net = Network(plan, line)
            yield net
            net.report = await stop_delay_line(line)
        finally:
            if line is not None and line.returncode is None:
                line.kill()
                await line.wait()
            netns.run(plan.teardown(), check=False)
            netns.remove_leftovers()


async def stop_delay_line(line: asyncio.subprocess.Process) -> dict[str, Any]:
    """Close its stdin: it says what it carried and exits."""
    assert line.stdin is not None and line.stdout is not None
    line.stdin.close()
    async with asyncio.timeout(10):
        text = await line.stdout.readline()
        await line.wait()
    report: dict[str, Any] = json.loads(text) if text.strip() else {}
    return report


async def expect(process: asyncio.subprocess.Process, word: str, timeout: float, who: str) -> None:
    assert process.stdout is not None
    try:
        async with asyncio.timeout(timeout):
            line = await process.stdout.readline()
    except TimeoutError:
        raise RuntimeError(f"{who} did not say {word!r} within {timeout:g} s") from None
    if line.strip() != word.encode():
        raise RuntimeError(f"{who} said {line!r}, expected {word!r}")


def in_namespace(host: netns.Host, binary: Path, directory: Path) -> Path:
    """A script running `binary` in `host`'s namespace, for `EmbeddedNatsServer(binary=)`
    (`ip netns exec` execs it: the server keeps the script's pid)."""
    script = directory / f"nats-server-{host.name}"
    script.write_text(f'#!/bin/sh\nexec {shlex.join(host.run([str(binary)]))} "$@"\n')
    script.chmod(0o755)
    return script


@contextlib.asynccontextmanager
async def nats_cluster(plan: netns.Plan, work: Path) -> AsyncIterator[list[EmbeddedNatsServer]]:
    """A fresh 3-node JetStream cluster, one node per host; ready when the meta leader sees
    every node current."""
    binary = find_nats_server_binary()
    nodes = plan.nodes
    routes = tuple(f"nats-route://{h.address}:{ROUTE_PORT}" for h in nodes)
    servers = [
        EmbeddedNatsServer(
            work / host.name,
            host=host.address,
            binary=in_namespace(host, binary, work),
            ready_timeout=START_TIMEOUT,
            cluster=ClusterNode(
                server_name=host.name,
                cluster_name="txbench",
                listen=f"{host.address}:{ROUTE_PORT}",
                routes=routes,
                monitor=f"{host.address}:{MONITOR_PORT}",
            ),
        )
        for host in nodes
    ]
    try:
        await asyncio.gather(*(server.start() for server in servers))
        await cluster_ready([h.address for h in nodes], START_TIMEOUT)
        yield servers
    finally:
        for server in servers:
            await server.stop()


def monitor(address: str, path: str) -> dict[str, Any]:
    """A node's monitoring endpoint's JSON ({} when it does not answer, or answers an error)."""
    try:
        url = f"http://{address}:{MONITOR_PORT}{path}"
        with urllib.request.urlopen(url, timeout=2) as answer:
            data: dict[str, Any] = json.load(answer)
            return data
    except (OSError, ValueError, urllib.error.URLError):
        return {}


async def cluster_ready(addresses: Sequence[str], timeout: float) -> None:
    """Until every node is healthy and the JetStream meta leader sees every node current."""

    def ready() -> bool:
        if any(monitor(a, "/healthz").get("status") != "ok" for a in addresses):
            return False
        meta = monitor(addresses[0], "/jsz").get("meta_cluster") or {}
        leader = meta.get("leader")
        if not leader:
            return False
        by_name = {f"n{i + 1}": a for i, a in enumerate(addresses)}
        meta = monitor(by_name[leader], "/jsz").get("meta_cluster") or {}
        current = {p["name"] for p in meta.get("replicas") or () if p.get("current")}
        return current | {leader} == set(by_name)

    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(ready):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster was not ready within {timeout:g} s")
        await asyncio.sleep(0.2)


def python(host: netns.Host, module: str, *args: str) -> list[str]:
    return host.run([sys.executable, "-m", module, *args])


def environment(**extra: str) -> dict[str, str]:
    """Ours, less any TXACTORS_ or NATS_ setting, with the worktree importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TXACTORS_", "NATS_"))}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


@contextlib.asynccontextmanager
async def coordinators(site: Site, count: int) -> AsyncIterator[list[int]]:
    """`count` coordinator processes as an operator runs them (the CLI), coordinator k on
    node k's host with NATS_URL its own node; yields their pids once they split the
    partitions evenly and serve each."""
    plan, urls, partitions, logs = site.plan, site.urls, site.partitions, site.logs
    processes = []
    try:
        for k in range(count):
            host = plan.nodes[k % len(plan.nodes)]
            with (logs / f"coordinator-p{partitions}-{count}-{k + 1}.log").open("ab") as log:
                processes.append(
                    await asyncio.create_subprocess_exec(
                        *python(host, "txactors.cli", "coordinator"),
                        *("--replicas", "3", "--partitions", str(partitions)),
                        env=environment(NATS_URL=urls[k % len(urls)]),
                        cwd=ROOT,
                        stdout=log,
                        stderr=log,
                        preexec_fn=die_with_parent,
                    )
                )
        await wait_split(urls[0], processes, partitions, logs)
        yield [p.pid for p in processes]
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        for process in processes:
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    await process.wait()
            except TimeoutError:  # it stops within two seconds when well: a hung one goes
                process.kill()
                await process.wait()


def evenly_split(owners: Sequence[str | None], processes: int) -> bool:
    """Every partition owned, by as many processes as there are partitions to go round, each
    holding its even share (`partitions // processes`, or one more)."""
    if not owners or any(owner is None for owner in owners):
        return False
    held = Counter(owners)
    share = len(owners) // processes
    return len(held) == min(processes, len(owners)) and all(
        share <= n <= share + 1 for n in held.values()
    )


async def wait_split(
    url: str, processes: list[asyncio.subprocess.Process], partitions: int, logs: Path
) -> None:
    """Until the coordinator processes hold the partitions' leases `evenly_split` and every
    partition answers (`bench.deployed.serving`: its owner has recovered it). With fewer
    partitions than processes, the others stand by (bench.deployed.wait_balanced wants each
    process to hold one)."""
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with contextlib.suppress(Exception):  # no lease bucket yet, an election: again
                table = await list_leases(nc, partitions=partitions)
                owners = [lease.owner for lease in table.leases]
                if evenly_split(owners, len(processes)) and await serving(nc, partitions):
                    return
            if any(p.returncode is not None for p in processes):
                raise RuntimeError(f"a coordinator exited at start (see {logs})")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(processes)} coordinator(s) did not split {partitions} partition(s) "
                    f"within {START_TIMEOUT:g} s (see {logs})"
                )
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


@dataclass(frozen=True)
class Measured:
    """One run: operations done, the window's seconds, latencies, CPU seconds by role and
    by node (each node's nats-server)."""

    count: int
    seconds: float
    latencies: list[float]
    cpu: dict[str, float]
    nodes: dict[str, float]

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    def per_op(self, role: str) -> float:
        """CPU seconds per operation of `role` (0 if it has no process here)."""
        return self.cpu.get(role, 0.0) / self.count

    def per_node(self) -> str:
        """Each node's nats-server's CPU ms per operation, in the nodes' order."""
        return " / ".join(f"{seconds / self.count * 1e3:.3f}" for seconds in self.nodes.values())

    def busiest_node(self) -> float:
        return max(self.nodes.values()) / self.count

    def p50_p99(self) -> str:
        return (
            f"{percentile(self.latencies, 0.5) * 1e3:.1f} / "
            f"{percentile(self.latencies, 0.99) * 1e3:.1f}"
        )


def cpu_of(pids: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(sum(cpu_seconds(p)) for p in ps) for role, ps in pids.items()}


@dataclass(frozen=True)
class Site:
    """One cluster of a run: its hosts, its nodes' URLs and nats-server pids (by host), the
    partition count its coordinators run with, and where the processes' logs go."""

    plan: netns.Plan
    urls: list[str]
    nodes: dict[str, int]
    partitions: int
    logs: Path
    wire: int
    """The delay line's pid."""

    @property
    def roles(self) -> dict[str, list[int]]:
        """The processes every run has: the nats-servers and the delay line."""
        return {"nats-server": list(self.nodes.values()), "wire": [self.wire]}

    async def load(self, kind: str, options: Options, coordinators: Sequence[int] = ()) -> Measured:
        """A run of `kind` with `options`, `coordinators` (pids) serving (see `load`)."""
        roles = {**self.roles, **({"coordinator": list(coordinators)} if coordinators else {})}
        return await load(self, kind, options, roles)


async def load(site: Site, kind: str, options: Options, roles: dict[str, list[int]]) -> Measured:
    """One run of `options.producers` load processes of `kind` (`bench.cluster_load`) in the
    producers' host, producer i on node i; CPU of `roles` (and the load processes, role
    `producer`) and of each node over the measured window."""
    plan, urls, partitions, logs, nodes = (
        site.plan, site.urls, site.partitions, site.logs, site.nodes
    )  # fmt: skip
    app = plan.host(netns.APP)
    topic = TX_TOPIC if kind == "tx" else RAW_TOPIC
    shares = [options.in_flight // options.producers] * options.producers
    shares[0] += options.in_flight - sum(shares)
    processes: list[asyncio.subprocess.Process] = []
    try:
        for i, share in enumerate(shares):
            with (logs / f"load-{kind}-p{partitions}-{i + 1}.log").open("ab") as log:
                processes.append(
                    await asyncio.create_subprocess_exec(
                        *python(app, "bench.cluster_load", kind, urls[i % len(urls)], topic),
                        *(str(share), str(partitions), str(options.warmup)),
                        env=environment(),
                        cwd=ROOT,
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=log,
                        limit=1 << 26,
                        preexec_fn=die_with_parent,
                    )
                )
        for i, process in enumerate(processes):
            await expect(process, "ready", options.warmup + START_TIMEOUT, f"load {kind} {i + 1}")
        pids = {**roles, "producer": [p.pid for p in processes]}
        before, node_before = cpu_of(pids), cpu_of({n: [p] for n, p in nodes.items()})
        for process in processes:
            assert process.stdin is not None
            process.stdin.write(f"go {options.seconds}\n".encode())
        results = []
        for i, process in enumerate(processes):
            assert process.stdout is not None
            async with asyncio.timeout(options.seconds + START_TIMEOUT):
                line = await process.stdout.readline()
            if not line.strip():
                raise RuntimeError(f"load {kind} {i + 1} exited (its log is in {logs})")
            results.append(json.loads(line))
        after, node_after = cpu_of(pids), cpu_of({n: [p] for n, p in nodes.items()})
    finally:
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in processes:
            try:
                async with asyncio.timeout(10):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
    if not sum(r["count"] for r in results):
        raise RuntimeError(f"no {kind} operation finished in {options.seconds:g} s")
    return Measured(
        count=sum(r["count"] for r in results),
        seconds=max(r["seconds"] for r in results),
        latencies=[x for r in results for x in r["latencies"]],
        cpu={role: after[role] - before[role] for role in after},
        nodes={n: node_after[n] - node_before[n] for n in node_after},
    )


async def round_trip(nc: Client, times: int = 200) -> float:
    """The median seconds of a PING/PONG between the bench's host and a node."""
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        await nc.flush()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def pooled(runs: Sequence[Measured]) -> Measured:
    """Several runs as one: their operations, seconds, latencies and CPU added up."""
    return Measured(
        count=sum(m.count for m in runs),
        seconds=sum(m.seconds for m in runs),
        latencies=[x for m in runs for x in m.latencies],
        cpu={role: sum(m.cpu.get(role, 0.0) for m in runs) for role in runs[0].cpu},
        nodes={node: sum(m.nodes[node] for m in runs) for node in runs[0].nodes},
    )


@dataclass
class Run:
    """Raw JetStream and txactors with one configuration of the coordinators, round by round
    (raw just before txactors in each)."""

    partitions: int
    coordinators: int
    rounds: list[tuple[Measured, Measured]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return (
            f"{plural(self.partitions, 'partition')}, "
            f"{plural(self.coordinators, 'coordinator process')}"
        )

    @property
    def raw(self) -> Measured:
        """Every round's raw run as one (latencies, CPU)."""
        return pooled([raw for raw, _ in self.rounds])

    @property
    def tx(self) -> Measured:
        """Every round's txactors run as one (latencies, CPU)."""
        return pooled([tx for _, tx in self.rounds])

    def rate(self, which: int) -> float:
        """The median over the rounds of the raw (0) or txactors (1) rate."""
        return statistics.median(pair[which].rate for pair in self.rounds)

    def ratios(self) -> list[float]:
        """Each round's txactors rate over its raw rate."""
        return [tx.rate / raw.rate for raw, tx in self.rounds]


@dataclass
class Results:
    options: Options
    rtt: float = 0.0
    """Seconds, measured (the median over the partition counts' clusters)."""
    runs: list[Run] = field(default_factory=list)
    lone: list[Run] = field(default_factory=list)
    """One transaction (publish) at a time, with the most coordinators of each partition
    count, in the last round: the latency of a commit without queueing, for the model's
    in-flight figure."""
    wire: dict[str, Any] = field(default_factory=dict)


async def prepare(site: Site) -> float:
    """Make the topic streams (R3); returns the round trip to a node, measured."""
    nc = await nats.connect(site.urls[0])
    try:
        rtt = await round_trip(nc)
        js = nc.jetstream()
        for topic in (RAW_TOPIC, TX_TOPIC):
            await ensure_topic_stream(js, topic, replicas=3)
    finally:
        await nc.close()
    return rtt


async def on_cluster(site: Site, options: Options, lone: Options, results: Results) -> None:
    """`options.rounds` rounds, each with every number of coordinator processes in turn, raw
    just before txactors; in the last round, with the most processes, one transaction (one
    publish) at a time too."""
    runs = {count: Run(site.partitions, count) for count in options.coordinators}
    results.runs += runs.values()
    for round_ in range(options.rounds):
        for count in options.coordinators:
            last = round_ == options.rounds - 1 and count == options.coordinators[-1]
            raw = await site.load("raw", options)
            raw1 = await site.load("raw", lone) if last else None
            async with coordinators(site, count) as pids:
                tx = await site.load("tx", options, pids)
                tx1 = await site.load("tx", lone, pids) if last else None
            runs[count].rounds.append((raw, tx))
            if raw1 is not None and tx1 is not None:
                results.lone.append(Run(site.partitions, count, [(raw1, tx1)]))
            print(
                f"round {round_ + 1}, {runs[count].label}: {tx.rate:,.0f} tx/s, "
                f"raw {raw.rate:,.0f} msg/s",
                flush=True,
            )


async def measure(options: Options) -> Results:
    """Every run of `options`, on fresh clusters in fresh namespaces."""
    results = Results(options)
    work = Path(tempfile.mkdtemp(prefix="txbench-cluster-"))
    logs = work / "logs"
    logs.mkdir()
    rtts = []
    lone = replace(options, producers=1, in_flight=1, seconds=min(options.seconds, LONE_SECONDS))
    try:
        async with network(options.rtt_ms / 2, logs) as net:
            for partitions in options.partitions:
                directory = work / f"p{partitions}"
                directory.mkdir()
                async with nats_cluster(net.plan, directory) as servers:
                    nodes = {
                        h.name: s.pid or 0 for h, s in zip(net.plan.nodes, servers, strict=True)
                    }
                    site = Site(
                        net.plan, [s.url for s in servers], nodes, partitions, logs,
                        net.delay_line.pid,
                    )  # fmt: skip
                    rtts.append(await prepare(site))
                    await on_cluster(site, options, lone, results)
    except BaseException:
        print(f"the run's logs and stores are kept in {work}", file=sys.stderr)
        raise
    results.wire = net.report
    results.rtt = statistics.median(rtts)
    shutil.rmtree(work, ignore_errors=True)
    return results


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


def rates_table(results: Results) -> Table:
    o = results.options
    table = Table(
        title=f"3-node cluster (R3, fsync always), {o.rtt_ms:g} ms round trip between hosts "
        f"(measured {results.rtt * 1e3:.2f} ms), {o.in_flight} in flight from "
        f"{plural(o.producers, 'producer process')}; raw JetStream: acked R3 publishes, same "
        f"processes, just before each run; medians of {plural(o.rounds, 'round')} "
        f"of {o.seconds:g} s"
    )
    for column in (
        "partitions, coordinators",
        "txactors tx/s",
        "raw msg/s",
        "ratio (rounds)",
        "commit p50 / p99 ms",
        "raw ack p50 / p99 ms",
    ):
        table.add_column(column, justify="left" if column.startswith("part") else "right")
    for run in results.runs:
        ratios = run.ratios()
        spread = f" ({min(ratios):.0%} to {max(ratios):.0%})" if len(ratios) > 1 else ""
        table.add_row(
            run.label,
            f"{run.rate(1):,.0f}",
            f"{run.rate(0):,.0f}",
            f"{statistics.median(ratios):.0%}{spread}",
            run.tx.p50_p99(),
            run.raw.p50_p99(),
        )
    return table


def lone_table(results: Results) -> Table:
    table = Table(
        title="one at a time: 1 producer process, 1 transaction (raw: 1 publish) in flight"
    )
    for column in (
        "partitions, coordinators",
        "commit p50 / p99 ms",
        "raw ack p50 / p99 ms",
        "p50: txactors / raw",
        "txactors tx/s",
    ):
        table.add_column(column, justify="left" if column.startswith("part") else "right")
    for run in results.lone:
        ratio = percentile(run.tx.latencies, 0.5) / percentile(run.raw.latencies, 0.5)
        table.add_row(
            run.label, run.tx.p50_p99(), run.raw.p50_p99(), f"{ratio:.1f}x", f"{run.tx.rate:,.0f}"
        )
    return table


def cpu_table(results: Results) -> Table:
    table = Table(
        title="CPU ms per transaction (raw: per message) by role, over the measured window; "
        "the delay line is the emulated network's own cost"
    )
    for column in (
        "partitions, coordinators",
        "coordinators",
        "producers",
        "nats-servers: all (n1 / n2 / n3)",
        "raw: producers",
        "raw: nats-servers",
        "delay line (raw)",
    ):
        table.add_column(column, justify="left" if column.startswith("part") else "right")

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f}"

    for run in results.runs:
        raw, tx = run.raw, run.tx
        table.add_row(
            run.label,
            ms(tx.per_op("coordinator")),
            ms(tx.per_op("producer")),
            f"{ms(tx.per_op('nats-server'))} ({tx.per_node()})",
            ms(raw.per_op("producer")),
            ms(raw.per_op("nats-server")),
            f"{ms(tx.per_op('wire'))} ({ms(raw.per_op('wire'))})",
        )
    return table


def per_transaction(results: Results) -> tuple[str, cluster_model.PerTransaction]:
    """The measured costs the model starts from: the last run (most partitions and
    coordinators), and the commit latency of one transaction at a time with it."""
    run = results.runs[-1]
    raw, tx = run.raw, run.tx
    return run.label, cluster_model.PerTransaction(
        coordinator=tx.per_op("coordinator"),
        producer=tx.per_op("producer"),
        servers=tx.per_op("nats-server"),
        busiest_server=tx.busiest_node(),
        raw_servers=raw.per_op("nats-server"),
        commit_p50=percentile(results.lone[-1].tx.latencies, 0.5),
    )


def model_table(results: Results) -> Table:
    source, per = per_transaction(results)
    table = Table(
        title=f"on paper: nodes of {cluster_model.CORES} cores at "
        f"{cluster_model.UTILIZATION:.0%}, from the CPU per transaction measured with "
        f"{source} (the assumptions: below the table)"
    )
    for column in (
        "nodes",
        "txactors tx/s",
        "raw R3 msg/s",
        "ratio",
        "one log leader: tx/s at most",
        "coordinator processes",
        "producer cores (app hosts)",
        "in flight",
    ):
        table.add_column(column, justify="left" if column == "nodes" else "right")
    for nodes in cluster_model.NODES:
        e = cluster_model.estimate(per, nodes)
        table.add_row(
            str(nodes),
            f"{e.commits:,.0f}",
            f"{e.raw:,.0f}",
            f"{e.ratio:.0%}",
            f"{e.one_log_leader:,.0f}",
            str(e.coordinator_processes),
            f"{e.producer_cores:.0f}",
            str(e.in_flight),
        )
    return table


def tables(results: Results) -> list[Table]:
    return [rates_table(results), lone_table(results), cpu_table(results), model_table(results)]


async def run_tables(options: Options) -> list[Table]:
    configure_logging("ERROR")
    results = await measure(options)
    out = tables(results)
    console = Console(width=200)
    for table in out:
        console.print(table)
    wire = results.wire
    if wire:
        console.print(
            f"delay line: {wire.get('packets', 0):,} packets carried, "
            f"{wire.get('dropped', 0):,} dropped, late against their due time "
            f"p50 {wire.get('late_p50_ms', 0):.3f} / p99 {wire.get('late_p99_ms', 0):.3f} ms"
        )
    return out


async def main(*, quick: bool = False) -> list[Table]:
    """`python -m bench cluster`: the default options (`--quick`: shorter runs)."""
    try:
        return await run_tables(QUICK if quick else Options())
    except netns.NoNamespaces as error:
        raise SystemExit(f"bench cluster: {error}") from None


def command(options: Options, quick: bool) -> str:
    """The command that reproduces a run of `options`."""
    base = QUICK if quick else Options()
    if options == base:
        return f"python3 dev.py bench cluster{' --quick' if quick else ''}"
    flags = shlex.join([*(["--quick"] if quick else []), *options.args(base)])
    return f"PYTHONPATH=. .venv/bin/python -m bench.cluster {flags}"


def numbers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse(argv: Sequence[str] | None = None) -> tuple[Options, bool, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__)
    default = Options()
    parser.add_argument("--rtt-ms", type=float, default=None, help=f"default {default.rtt_ms}")
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=None, help="seconds before each run")
    parser.add_argument("--in-flight", type=int, default=None, help="default 64")
    parser.add_argument("--producers", type=int, default=None, help="default 2")
    parser.add_argument("--partitions", type=numbers, default=None, help="default 1,8")
    parser.add_argument("--coordinators", type=numbers, default=None, help="default 1,2")
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    parser.add_argument("--quick", action="store_true", help="one round of 3 s runs")
    parser.add_argument("--json", type=Path, metavar="DIR", help="also write DIR/cluster.json")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else default
    given = {
        f.name: getattr(args, f.name) for f in fields(Options) if getattr(args, f.name) is not None
    }
    options = replace(base, **given)
    if options.rounds < 1:
        parser.error("--rounds must be at least 1")
    if options.producers < 1 or options.in_flight < options.producers:
        parser.error("--in-flight must be at least --producers, which must be at least 1")
    return options, args.quick, args.json


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the namespaces are removed."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def cli(argv: Sequence[str] | None = None, *, out: Callable[[str], Any] = print) -> None:
    options, quick, directory = parse(argv)
    stop_on_sigterm()
    try:
        produced = run_on_loop(run_tables(options))
    except netns.NoNamespaces as error:
        raise SystemExit(f"bench cluster: {error}") from None
    if directory is not None:
        data = record("cluster", produced, quick=quick)
        data["command"] = command(options, quick)
        out(f"wrote {write(directory, data)}")


if __name__ == "__main__":
    cli()
