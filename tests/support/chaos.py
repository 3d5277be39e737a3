"""A seeded chaos run against a whole deployment on the 3-node cluster.

`ChaosRig` runs, each in its own process as operators deploy them: three coordinators
(`--replicas 3`, a short lease TTL, four partitions), two producer groups of two instances each
(tests/peers/chaos_producer.py: `TxLog.send_in_transaction` on a SQLite database the group's
instances share) and two consumer processes of one group. `run_faults` then injects one fault
at a time, drawn from a seeded generator: a node killed and restarted, paused (SIGSTOP) or cut
off from the other nodes with its clients still on it; a coordinator killed, or paused past
its lease TTL (a zombie that must be fenced); a producer or consumer instance killed. A process
that exits when nobody killed it is a failure (a coordinator must outlive every fault here); it
is restarted so the run goes on, and named in the verdict.

`verdict` then compares what each group's database committed (its `ledger`) with the topic
streams and the consumers' journals: every committed txid on its topic exactly once and
delivered, nothing else on a topic or delivered.
"""

from __future__ import annotations

import functools
import random
import signal
import sqlite3
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from tests.peers.chaos_producer import READY_LINE as PRODUCER_READY
from tests.peers.chaos_producer import STOPPED_LINE
from tests.peers.journal_consumer import READY_LINE as CONSUMER_READY
from tests.support.coordinator_process import CoordinatorProcess
from tests.support.load_rig import (
    COORDINATOR_ARGS,
    LEASE_TTL,
    PeerProcess,
    all_partitions_served,
    no_transaction_open,
    read_msg_ids,
    wait_for,
)
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.nats.client import connect

PARTITIONS = 4
GROUPS = {"shop": "paid", "depot": "shipped"}
"""Producer group -> the topic its transactions send to."""
INSTANCES = 2
CONSUMERS = 2
CONSUMER_GROUP = "books"
COORDINATORS = 3

NODE_PAUSE = (5.0, 12.0)
NODE_CUT = (8.0, 15.0)
NODE_DOWN = (2.0, 8.0)
PROCESS_DOWN = (0.5, 3.0)
ZOMBIE_PAUSE = (LEASE_TTL * 1.5, LEASE_TTL * 3)
"""A coordinator paused past its lease: on waking it must find itself fenced."""
BETWEEN_FAULTS = (2.0, 6.0)
READY_AFTER_NODE = 60.0
"""Seconds a node fault's aftermath may take to heal (streams caught up) before the next."""
WATCH_INTERVAL = 0.5


@dataclass
class ChaosVerdict:
    faults: list[str]
    committed: int
    problems: list[str] = field(default_factory=list)


class ChaosRig:
    """A deployment on `cluster` whose processes and nodes `run_faults` attacks."""

    def __init__(self, cluster: EmbeddedNatsCluster, work: Path, seed: int) -> None:
        self.cluster = cluster
        self.work = work
        self.rng = random.Random(seed)
        work.mkdir(parents=True, exist_ok=True)
        self.coordinators = [
            CoordinatorProcess(
                cluster.urls,
                self._dir(f"coordinator{i}"),
                partitions=PARTITIONS,
                extra_args=COORDINATOR_ARGS,
            )
            for i in range(COORDINATORS)
        ]
        self.producers = [
            PeerProcess(
                f"{group}-{i}",
                work,
                "tests.peers.chaos_producer",
                [cluster.urls, str(self.database(group)), group, topic, str(seed * 10 + i)],
            )
            for group, topic in GROUPS.items()
            for i in range(INSTANCES)
        ]
        self.consumers = [
            PeerProcess(
                f"consumer-{i}",
                work,
                "tests.peers.journal_consumer",
                [
                    cluster.urls,
                    str(self.journal(i)),
                    *("--topics", ",".join(GROUPS.values())),
                    *("--group", CONSUMER_GROUP),
                    *("--replicas", "3"),
                ],
            )
            for i in range(CONSUMERS)
        ]
        self.faults: list[str] = []
        self.unexpected_exits: list[str] = []
        self._down: set[object] = set()  # stopped on purpose: not an unexpected exit
        self.nc: Any = None

    def _dir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(exist_ok=True)
        return path

    def database(self, group: str) -> Path:
        return self.work / f"{group}.db"

    def journal(self, index: int) -> Path:
        return self.work / f"consumer-{index}.txt"

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.nc = await connect(
            self.cluster.url_list, max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        async with anyio.create_task_group() as tasks:
            for coordinator in self.coordinators:
                tasks.start_soon(coordinator.start, 60.0)
        await self._wait(self._all_partitions_served, 60, "every partition served")
        for consumer in self.consumers:
            await consumer.start(CONSUMER_READY)
        for producer in self.producers:
            await producer.start(PRODUCER_READY)

    async def close(self) -> None:
        for peer in (*self.producers, *self.consumers):
            await peer.stop()
        for coordinator in self.coordinators:
            await coordinator.kill()
        if self.nc is not None:
            await self.nc.close()

    def logs(self) -> str:
        parts = [f"--- {p.name} ---\n{p.log_tail()}" for p in (*self.producers, *self.consumers)]
        parts += [
            f"--- coordinator {i} ---\n{c.log_tail()}" for i, c in enumerate(self.coordinators)
        ]
        return "\n".join(parts)

    # -- faults ------------------------------------------------------------------------------

    async def run_faults(self, seconds: float) -> None:
        """Faults one after another for `seconds`, while every process is watched."""
        kinds: list[Callable[[], Awaitable[str]]] = [
            self._node_kill,
            self._node_pause,
            self._node_cut,
            self._coordinator_kill,
            self._coordinator_zombie,
            self._producer_kill,
            self._consumer_kill,
        ]
        async with anyio.create_task_group() as watching:
            watching.start_soon(self._watch)
            with anyio.move_on_after(seconds):
                for kind in kinds:  # each kind at least once, then at random
                    await self._one(kind)
                while True:
                    await self._one(self.rng.choice(kinds))
            await self.cluster.wait_ready(READY_AFTER_NODE)
            watching.cancel_scope.cancel()

    async def _one(self, fault: Callable[[], Awaitable[str]]) -> None:
        with anyio.CancelScope(shield=True):  # a fault begun is healed, whatever the clock
            self.faults.append(await fault())
            await self.cluster.wait_ready(READY_AFTER_NODE)
        await anyio.sleep(self.rng.uniform(*BETWEEN_FAULTS))

    def _span(self, bounds: tuple[float, float]) -> float:
        return round(self.rng.uniform(*bounds), 1)

    async def _node_kill(self) -> str:
        node, down = self.rng.randrange(self.cluster.size), self._span(NODE_DOWN)
        await self.cluster.kill(node)
        await anyio.sleep(down)
        await self.cluster.restart(node, wait=False)
        return f"node {node} killed for {down}s"

    async def _node_pause(self) -> str:
        node, down = self.rng.randrange(self.cluster.size), self._span(NODE_PAUSE)
        self.cluster.pause(node)
        await anyio.sleep(down)
        self.cluster.resume(node)
        return f"node {node} paused for {down}s"

    async def _node_cut(self) -> str:
        node, down = self.rng.randrange(self.cluster.size), self._span(NODE_CUT)
        await self.cluster.cut(node)
        await anyio.sleep(down)
        await self.cluster.heal(node)
        return f"node {node} cut off for {down}s"

    async def _coordinator_kill(self) -> str:
        index, down = self.rng.randrange(COORDINATORS), self._span(PROCESS_DOWN)
        coordinator = self.coordinators[index]
        self._down.add(coordinator)
        await coordinator.kill()
        await anyio.sleep(down)
        await coordinator.start(60.0)
        self._down.discard(coordinator)
        return f"coordinator {index} killed for {down}s"

    async def _coordinator_zombie(self) -> str:
        index, down = self.rng.randrange(COORDINATORS), self._span(ZOMBIE_PAUSE)
        coordinator = self.coordinators[index]
        coordinator.pause()
        await anyio.sleep(down)
        coordinator.resume()
        return f"coordinator {index} paused for {down}s"

    async def _producer_kill(self) -> str:
        return await self._peer_kill(self.producers, PRODUCER_READY)

    async def _consumer_kill(self) -> str:
        return await self._peer_kill(self.consumers, CONSUMER_READY)

    async def _peer_kill(self, peers: list[PeerProcess], ready: str) -> str:
        peer, down = self.rng.choice(peers), self._span(PROCESS_DOWN)
        self._down.add(peer)
        await peer.kill()
        await anyio.sleep(down)
        await peer.start(ready, timeout=60)
        self._down.discard(peer)
        return f"{peer.name} killed for {down}s"

    async def _watch(self) -> None:
        """Restart (and remember) any process that exited when nobody stopped it."""
        while True:
            await anyio.sleep(WATCH_INTERVAL)
            for index, coordinator in enumerate(self.coordinators):
                if coordinator not in self._down and not coordinator.alive():
                    self.unexpected_exits.append(
                        f"coordinator {index} exited with {coordinator.returncode()}:\n"
                        f"{coordinator.log_tail()}"
                    )
                    await self._restart(functools.partial(coordinator.start, 60.0))
            for peer, ready in [
                *((p, PRODUCER_READY) for p in self.producers),
                *((c, CONSUMER_READY) for c in self.consumers),
            ]:
                if peer not in self._down and not peer.alive():
                    self.unexpected_exits.append(f"{peer.name} exited:\n{peer.log_tail()}")
                    await self._restart(functools.partial(peer.start, ready, timeout=60))

    async def _restart(self, start: Callable[[], Awaitable[None]]) -> None:
        """A restart that fails (the process exits again at once) is tried at the next look."""
        try:
            await start()
        except AssertionError as error:
            self.unexpected_exits.append(f"restart failed: {error}")

    # -- settling and the verdict ------------------------------------------------------------

    async def settle(self, timeout: float = 120) -> None:
        """Stop the load; wait until every producer is idle, nothing is open on any
        partition (every transaction in flight settled by a check-back) and every committed
        message was delivered."""
        for producer in self.producers:
            producer.signal(signal.SIGUSR1)
        for producer in self.producers:
            await self._wait(
                lambda p=producer: STOPPED_LINE in p.log.read_text(errors="replace"),
                timeout,
                f"{producer.name} stopped its load",
            )

        async def nothing_open() -> bool:
            return await no_transaction_open(self.nc, PARTITIONS)

        await self._wait(nothing_open, timeout, "no open transaction on any partition")
        expected = await self._committed()

        async def all_delivered() -> bool:
            return expected <= self._delivered().keys()

        await self._wait(all_delivered, timeout, "every committed message delivered")

    async def verdict(self) -> ChaosVerdict:
        expected = await self._committed()
        delivered = self._delivered()
        problems = list(self.unexpected_exits)
        for topic in GROUPS.values():
            for msg_id, times in (await read_msg_ids(self.nc, topic)).items():
                if (topic, msg_id) not in expected:
                    problems.append(f"phantom on {topic}: {msg_id} (x{times})")
                elif times != 1:
                    problems.append(f"{msg_id} is on {topic} {times} times")
                expected.discard((topic, msg_id))
        problems += [f"lost: {msg_id} is not on {topic}" for topic, msg_id in expected]
        committed = await self._committed()
        problems += [f"committed, never delivered: {m}" for m in committed - delivered.keys()]
        problems += [f"delivered, not committed: {m}" for m in delivered.keys() - committed]
        return ChaosVerdict(faults=self.faults, committed=len(committed), problems=problems)

    async def _committed(self) -> set[tuple[str, str]]:
        """(topic, msg id) of every message whose local transaction committed."""

        def read(group: str) -> list[str]:
            with sqlite3.connect(self.database(group)) as db:
                return [txid for (txid,) in db.execute("SELECT txid FROM ledger")]

        return {
            (topic, f"{txid}:0")
            for group, topic in GROUPS.items()
            for txid in await anyio.to_thread.run_sync(read, group)
        }

    def _delivered(self) -> Counter[tuple[str, str]]:
        delivered: Counter[tuple[str, str]] = Counter()
        for index in range(CONSUMERS):
            if self.journal(index).exists():
                for line in self.journal(index).read_text().splitlines():
                    topic, msg_id = line.split(" ", 1)
                    delivered[(topic, msg_id)] += 1
        return delivered

    async def _wait(self, condition: Any, timeout: float, what: str) -> None:
        await wait_for(condition, timeout, what, self.logs)

    async def _all_partitions_served(self) -> bool:
        return await all_partitions_served(self.nc, PARTITIONS)
