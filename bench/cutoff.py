"""What a node cut off from its cluster, or paused, costs: the longest gap in confirmed
commits, for the deployment and for a producer whose connection is on that node.

`python -m bench.cutoff [--fault cut|pause] [--victim follower|leader] [--cut SECONDS]
[--watch on|off]`

A 3-node cluster (R3, fsync always) whose routes go through relays; two coordinators, each on
a node that stays up; two load producers (tests/peers/load_producer.py, 4 workers each), one
connected to the victim node first, one to another node. Once both commit, the victim is cut
off from the other two for `--cut` seconds (its clients stay connected to it), then healed
(`--fault pause`: SIGSTOPped for as long, then continued);
the run ends once both producers have committed again. A coordinator that exits is
restarted at once, as a supervisor would, and counted. `--victim leader` cuts the JetStream
meta leader, `follower` another node. `--watch off` runs the clients without their server
watch (TXACTORS_LEAVE_SERVER_AFTER=0): nats-py keeps a client on its server as long as the
connection holds, as before the watch.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import anyio
from nats.aio.client import Client

from tests.peers.load_producer import READY_LINE as PRODUCER_READY
from tests.support.coordinator_process import CoordinatorProcess
from tests.support.load_rig import COORDINATOR_ARGS, GROUP, PARTITIONS, PeerProcess
from tests.support.wait import eventually
from txactors.actors.loop import run
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.nats.client import connect
from txactors.nats.config import LEAVE_SERVER_AFTER_ENV
from txactors.ops.txn import CoordinatorUnavailable, list_transactions

WORKERS = 4
WARM_UP = 40
"""Commits each producer confirms before the cut, and again after the heal."""
TOPIC = "orders"


@dataclass
class Gaps:
    deployment: float
    on_victim: float
    elsewhere: float
    left_after: float | None
    """Seconds from the cut until the victim's producer logged that it left the node."""
    coordinator_restarts: int
    """Coordinators that exited (on a transient fault, issue 31 item 1) and were restarted."""

    def line(self, args: argparse.Namespace) -> str:
        left = "never" if self.left_after is None else f"{self.left_after:.1f} s after the cut"
        return (
            f"{args.fault} {args.victim} for {args.cut:g}s, watch {args.watch}: longest gap in "
            f"commits: deployment {self.deployment:.1f} s, producer on the victim "
            f"{self.on_victim:.1f} s (it left: {left}), producer elsewhere "
            f"{self.elsewhere:.1f} s; coordinators restarted: {self.coordinator_restarts}"
        )


def confirmed(journal: Path) -> list[float]:
    """When each commit whose end was confirmed finished (wall clock), in order."""
    times = []
    for text in journal.read_text().splitlines():
        line = json.loads(text)
        if line.get("calls") and line["calls"][-1].get("state") == "committed":
            times.append(line["t1"])
    return sorted(times)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest gap between consecutive times that overlaps [start, end]."""
    return max(
        (b - a for a, b in itertools.pairwise(times) if b >= start and a <= end), default=0.0
    )


def left_at(log: Path) -> float | None:
    """The wall-clock time the producer logged `nats_server_left`, if it did."""
    for text in log.read_text(errors="replace").splitlines():
        if '"nats_server_left"' in text:
            stamp = re.search(r'"timestamp": "([^"]+)"', text)
            if stamp:
                return datetime.fromisoformat(stamp.group(1).replace("Z", "+00:00")).timestamp()
    return None


async def measure(args: argparse.Namespace, work: Path) -> Gaps:
    if args.watch == "off":
        os.environ[LEAVE_SERVER_AFTER_ENV] = "0"  # inherited by every process started below
    async with EmbeddedNatsCluster(work / "cluster", size=3, route_relays=True) as cluster:
        leader = await eventually(cluster.meta_leader, until=lambda i: i is not None)
        victim = leader if args.victim == "leader" else (leader + 1) % 3
        others = [i for i in range(3) if i != victim]
        urls = cluster.url_list
        coordinators = [
            CoordinatorProcess(
                urls[node],
                _dir(work, f"c{node}"),
                partitions=PARTITIONS,
                extra_args=COORDINATOR_ARGS,
            )
            for node in others
        ]
        producers = {
            name: PeerProcess(
                name,
                work,
                "tests.peers.load_producer",
                [
                    ",".join([urls[first], *(u for u in urls if u != urls[first])]),
                    str(work / f"{name}.jsonl"),
                    *("--workers", str(WORKERS), "--partitions", str(PARTITIONS)),
                    *("--topics", TOPIC, "--group", GROUP, "--in-order"),
                ],
            )
            for name, first in (("on_victim", victim), ("elsewhere", others[0]))
        }
        nc = await connect(urls, server_watch=None)
        restarts = 0

        async def supervise() -> None:
            """Restart a coordinator that exited, as systemd or Kubernetes would."""
            nonlocal restarts
            while True:
                await anyio.sleep(0.2)
                for coordinator in coordinators:
                    if not coordinator.alive():
                        restarts += 1
                        with contextlib.suppress(AssertionError):  # it exited again: retried
                            await coordinator.start(60)

        try:
            async with anyio.create_task_group() as tasks:
                for coordinator in coordinators:
                    await coordinator.start(60)
                tasks.start_soon(supervise)
                await eventually(
                    lambda: served(nc), timeout=60, interval=0.2, what="every partition served"
                )
                for producer in producers.values():
                    await producer.start(PRODUCER_READY)
                await committed_after(producers, work, 0.0)
                cut = time.time()
                await cluster.cut(victim)
                await anyio.sleep(args.cut)
                await cluster.heal(victim)
                healed = time.time()
                await committed_after(producers, work, healed)
                tasks.cancel_scope.cancel()
        finally:
            for producer in producers.values():
                await producer.stop()
            for coordinator in coordinators:
                await coordinator.kill()
            await nc.close()
        times = {name: confirmed(work / f"{name}.jsonl") for name in producers}
        end = healed + 30
        left = left_at(producers["on_victim"].log)
        return Gaps(
            deployment=longest_gap(sorted(itertools.chain(*times.values())), cut, end),
            on_victim=longest_gap(times["on_victim"], cut, end),
            elsewhere=longest_gap(times["elsewhere"], cut, end),
            left_after=None if left is None else left - cut,
            coordinator_restarts=restarts,
        )


async def served(nc: Client) -> bool:
    try:
        await list_transactions(nc, partitions=PARTITIONS, timeout=2)
    except CoordinatorUnavailable:
        return False
    return True


async def committed_after(producers: dict[str, PeerProcess], work: Path, since: float) -> None:
    """Wait until every producer confirmed `WARM_UP` commits after wall-clock `since`."""

    def enough() -> bool:
        return all(
            sum(t > since for t in confirmed(work / f"{name}.jsonl")) >= WARM_UP
            for name in producers
        )

    await eventually(enough, timeout=120, interval=0.2, what=f"{WARM_UP} commits from each")


def _dir(work: Path, name: str) -> Path:
    path = work / name
    path.mkdir(parents=True, exist_ok=True)
    return path


async def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="txactors-cutoff-"))
    gaps = await measure(args, work)  # a failed run keeps its logs in `work`
    shutil.rmtree(work, ignore_errors=True)
    print(gaps.line(args), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.cutoff", description=__doc__)
    parser.add_argument("--fault", choices=("cut", "pause"), default="cut")
    parser.add_argument("--victim", choices=("follower", "leader"), default="follower")
    parser.add_argument("--cut", type=float, default=20.0, help="seconds the fault lasts")
    parser.add_argument("--watch", choices=("on", "off"), default="on")
    run(main(parser.parse_args()))
