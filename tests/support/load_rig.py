"""A deployment under load on the 3-node cluster, for fault tests: what ran, what was promised,
what arrived.

`LoadRig` runs everything in its own process, as operators deploy it: two coordinators
(`--replicas 3`, a short lease TTL, several partitions, NATS_URL naming every node), one
consumer journaling each delivery (tests/peers/journal_consumer.py) and one load producer
(tests/peers/load_producer.py: workers sending a mix of commit, rollback and
UNKNOWN-then-check transactions, each journaled with what every call returned). A test kills
nodes and coordinators in between (or all of them at once: `power_cut`, then `power_back`);
`settle` then waits (conditions under deadlines) until nothing is open, and `verdict`
compares the topic streams and the consumer's deliveries with what the producer was promised:

- every transaction whose local outcome was commit and whose halves were confirmed (a commit
  confirmed or not, an UNKNOWN the check-back settled as commit) is on its topics exactly once
  and was delivered;
- nothing else is on a topic or was delivered (no rolled-back or phantom message);
- every producer call succeeded or failed with an error documented as retriable
  (docs/protocol.md "What to retry");
- the longest gap between consecutive confirmed commits, measured.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import nats.errors
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from tests.peers.journal_consumer import READY_LINE as CONSUMER_READY
from tests.peers.load_producer import READY_LINE as PRODUCER_READY
from tests.support.coordinator_process import ROOT, CoordinatorProcess, _exited, _spawn
from tests.support.wait import eventually
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.nats.client import connect
from txactors.ops.leases import list_leases
from txactors.ops.txn import CoordinatorUnavailable, list_transactions
from txactors.wire import layout
from txactors.wire.protocol import ErrorCode

PARTITIONS = 4
TOPICS = ("orders", "audit", "mail")
WORKERS = 8
LEASE_TTL = 2.0
GROUP = "shop"
CONSUMER_GROUP = "ledger"

COORDINATOR_ARGS = (
    *("--replicas", "3"),
    *("--lease-ttl", str(LEASE_TTL)),
    # A check-back after 2 s (an UNKNOWN is settled within a few), and never given up on: a
    # transaction discarded because its producer could not be reached would be a loss here.
    *("--transaction-timeout", "2"),
    *("--check-interval", "0.5"),
    *("--check-max", "1000"),
    *("--check-answer-timeout", "2"),
)

RETRIABLE_CODES = frozenset({ErrorCode.TIMEOUT, ErrorCode.INTERNAL})
"""Codes docs/protocol.md "What to retry" calls retriable (besides no answer at all)."""


class PeerProcess:
    """A tests.peers module in its own process; output to a log file, ready on a line."""

    def __init__(self, name: str, log_dir: Path, module: str, args: list[str]) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        self.cmd = [sys.executable, "-m", module, *args]
        self._proc: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    async def start(self, ready_line: str, timeout: float = 30.0) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "_TYPER_STANDARD_TRACEBACK": "1"}
        self._proc = _spawn(self.cmd, env, self.log)

        def ready() -> bool:
            assert self.alive(), f"{self.name} exited at start:\n{self.log_tail()}"
            return ready_line in self.log.read_text(errors="replace")

        await eventually(
            ready, timeout=timeout, interval=0.05, what=f"{self.name} ready", explain=self.log_tail
        )

    def signal(self, signum: int) -> None:
        assert self._proc is not None
        self._proc.send_signal(signum)

    async def kill(self) -> None:
        """SIGKILL, as a crash: no cleanup."""
        if self.alive():
            assert self._proc is not None
            self._proc.kill()
            await anyio.to_thread.run_sync(self._proc.wait)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit within 10 s."""
        if not self.alive():
            return
        assert self._proc is not None
        self._proc.send_signal(signal.SIGTERM)
        if not await _exited(self._proc, 10):
            self._proc.kill()
            await anyio.to_thread.run_sync(self._proc.wait)


@dataclass
class Verdict:
    """What `verdict` found; `problems` is empty when every promise held."""

    transactions: int
    committed: int
    confirmed_commits: int
    errors: Counter[str]
    longest_gap: float
    gap_started: float
    """Wall-clock time at which the longest gap began."""
    redeliveries: int
    problems: list[str] = field(default_factory=list)

    def summary(self, since: float) -> str:
        errors = ", ".join(f"{k} x{n}" for k, n in sorted(self.errors.items())) or "none"
        return (
            f"{self.transactions} transactions ({self.committed} committed, "
            f"{self.confirmed_commits} confirmed at their end); longest gap between confirmed "
            f"commits {self.longest_gap:.2f}s, starting {self.gap_started - since:+.2f}s after "
            f"the fault; retriable errors: {errors}; redeliveries: {self.redeliveries}"
        )


class LoadRig:
    """The processes of one deployment on `cluster`; `start`, fault it, `settle`, `verdict`."""

    def __init__(self, cluster: EmbeddedNatsCluster, work: Path) -> None:
        self.cluster = cluster
        self.work = work
        work.mkdir(parents=True, exist_ok=True)
        self.producer_journal = work / "producer.jsonl"
        self.consumer_journal = work / "consumer.txt"
        self.coordinators = [
            CoordinatorProcess(
                cluster.urls,
                self._dir(f"coordinator{i}"),
                partitions=PARTITIONS,
                extra_args=COORDINATOR_ARGS,
            )
            for i in range(2)
        ]
        topics = ",".join(TOPICS)
        self.consumer = PeerProcess(
            "consumer",
            work,
            "tests.peers.journal_consumer",
            [
                cluster.urls,
                str(self.consumer_journal),
                "--topics",
                topics,
                "--group",
                CONSUMER_GROUP,
                "--replicas",
                "3",
            ],
        )
        self.producer = PeerProcess(
            "producer",
            work,
            "tests.peers.load_producer",
            [
                cluster.urls,
                str(self.producer_journal),
                "--workers",
                str(WORKERS),
                "--partitions",
                str(PARTITIONS),
                "--topics",
                topics,
                "--group",
                GROUP,
            ],
        )
        self.nc: Client | None = None

    def _dir(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(exist_ok=True)
        return path

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Coordinators (both up, every partition leased), the consumer, then the load."""
        self.nc = await connect(
            self.cluster.url_list, max_reconnect_attempts=-1, reconnect_time_wait=0.2
        )
        async with anyio.create_task_group() as tasks:
            for coordinator in self.coordinators:
                tasks.start_soon(coordinator.start, 60.0)
        await self.wait_for(self._all_partitions_served, 60, "every partition served")
        await self.consumer.start(CONSUMER_READY)
        await self.producer.start(PRODUCER_READY)

    async def power_cut(self) -> None:
        """Every node and every coordinator SIGKILLed at once, as when their power goes (the
        producer and the consumer, elsewhere, stay up and reconnect)."""
        async with anyio.create_task_group() as dying:
            for index in range(self.cluster.size):
                dying.start_soon(self.cluster.kill, index)
            for coordinator in self.coordinators:
                dying.start_soon(coordinator.kill)

    async def power_back(self) -> None:
        """Every node and every coordinator started at once, as when the power comes back:
        the coordinators do not wait for the cluster to be ready."""
        async with anyio.create_task_group() as booting:
            booting.start_soon(functools.partial(self.cluster.start, wait=False))
            for coordinator in self.coordinators:
                booting.start_soon(coordinator.start, 90.0)

    async def close(self) -> None:
        for peer in (self.producer, self.consumer):
            await peer.stop()
        for coordinator in self.coordinators:
            await coordinator.kill()
        if self.nc is not None:
            await self.nc.close()

    def logs(self) -> str:
        """The tails of every process's log, for a failing test."""
        parts = [f"--- {p.name} ---\n{p.log_tail()}" for p in (self.producer, self.consumer)]
        parts += [
            f"--- coordinator {i} ---\n{c.log_tail()}" for i, c in enumerate(self.coordinators)
        ]
        return "\n".join(parts)

    # -- conditions ----------------------------------------------------------------------------

    async def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        await wait_for(condition, timeout, what, self.logs)

    async def _all_partitions_served(self) -> bool:
        assert self.nc is not None
        return await all_partitions_served(self.nc, PARTITIONS)

    async def commits_after(self, since: float, count: int, timeout: float = 60) -> None:
        """Wait until `count` commits were confirmed after wall-clock `since`: the load goes on."""

        async def enough() -> bool:
            confirmed = [t for t in self._confirmed_commit_times() if t > since]
            return len(confirmed) >= count

        await self.wait_for(enough, timeout, f"{count} commits confirmed after the fault")

    async def lease_owners(self) -> set[str | None]:
        assert self.nc is not None
        table = await list_leases(self.nc, partitions=PARTITIONS)
        return {lease.owner for lease in table.leases}

    async def settle(self, timeout: float = 90) -> None:
        """Stop the load; wait until the workers stopped, no transaction is open on any
        partition (every UNKNOWN and unconfirmed end checked back), and the consumer has
        every committed message."""
        self.producer.signal(signal.SIGUSR1)

        async def producer_done() -> bool:
            return any("done" in line for line in self._journal())

        await self.wait_for(producer_done, timeout, "the producer's workers stopped")

        async def nothing_open() -> bool:
            assert self.nc is not None
            return await no_transaction_open(self.nc, PARTITIONS)

        await self.wait_for(nothing_open, timeout, "no open transaction on any partition")
        expected = self._expected()

        async def all_delivered() -> bool:
            return expected.keys() <= self._delivered().keys()

        await self.wait_for(all_delivered, timeout, "every committed message delivered")

    # -- the verdict --------------------------------------------------------------------------

    def _journal(self) -> list[dict[str, Any]]:
        if not self.producer_journal.exists():
            return []
        return [json.loads(line) for line in self.producer_journal.read_text().splitlines()]

    def _transactions(self) -> list[dict[str, Any]]:
        return [line for line in self._journal() if "txid" in line]

    def _confirmed_commit_times(self) -> list[float]:
        return sorted(
            line["t1"]
            for line in self._transactions()
            if line["calls"] and line["calls"][-1].get("state") == "committed"
        )

    def _expected(self) -> dict[str, str]:
        """msg_id -> topic of every message that must be delivered."""
        return {
            f"{line['txid']}:{i}": topic
            for line in self._transactions()
            if line["prepared"] and line["truth"] == "commit"
            for i, topic in enumerate(line["messages"])
        }

    def _delivered(self) -> Counter[str]:
        if not self.consumer_journal.exists():
            return Counter()
        return Counter(
            line.split(" ", 1)[1] for line in self.consumer_journal.read_text().splitlines()
        )

    async def _on_topics(self) -> dict[str, Counter[str]]:
        """Nats-Msg-Id -> how often, per topic, read from each topic stream to its end."""
        assert self.nc is not None
        return {topic: await read_msg_ids(self.nc, topic) for topic in TOPICS}

    async def verdict(self) -> Verdict:
        transactions = self._transactions()
        expected = self._expected()
        delivered = self._delivered()
        problems: list[str] = []
        errors: Counter[str] = Counter()
        for line in transactions:
            for call in line["calls"]:
                if "error" not in call:
                    continue
                what = f"{call['call']}: {call['error']}({call['code']})"
                if retriable(call):
                    errors[what] += 1
                else:
                    problems.append(f"{line['txid']}: not a retriable error: {call}")
        on_topics = await self._on_topics()
        for topic, ids in on_topics.items():
            for msg_id, times in ids.items():
                if expected.get(msg_id) != topic:
                    problems.append(f"phantom on {topic}: {msg_id} (x{times})")
                elif times != 1:
                    problems.append(f"{msg_id} is on {topic} {times} times")
        for msg_id, topic in expected.items():
            if msg_id not in on_topics[topic]:
                problems.append(f"lost: {msg_id} is not on {topic}")
        problems += [f"delivered but not committed: {m}" for m in delivered if m not in expected]
        problems += [f"committed, never delivered: {m}" for m in expected if m not in delivered]
        times = self._confirmed_commit_times()
        gaps = [(b - a, a) for a, b in itertools.pairwise(times)] or [(0.0, 0.0)]
        longest, started = max(gaps)
        return Verdict(
            transactions=len(transactions),
            committed=sum(1 for t in transactions if t["prepared"] and t["truth"] == "commit"),
            confirmed_commits=len(times),
            errors=errors,
            longest_gap=longest,
            gap_started=started,
            redeliveries=sum(delivered.values()) - len(delivered),
            problems=problems,
        )


def retriable(call: dict[str, Any]) -> bool:
    """A failed call docs/protocol.md "What to retry" allows: a prepare refused with a
    retry_after hint, or with `timeout`/`internal`, or not answered at all (no code)."""
    if call["call"] != "prepare" or call["error"] != "PrepareFailed":
        return False  # an end never raises for a retriable failure: it is unconfirmed
    return call["retry_after"] is not None or call["code"] in (None, *RETRIABLE_CODES)


async def read_msg_ids(nc: Client, topic: str) -> Counter[str]:
    """Nats-Msg-Id -> how often, on `topic`'s stream, read to its end by an ephemeral
    consumer, from scratch again when a fetch fails (its interest may not have reached every
    node yet), until it has counted every message."""
    js = nc.jetstream(timeout=10)
    stream = layout.topic_stream(topic)
    total = (await js.stream_info(stream)).state.messages
    with anyio.fail_after(60):
        while True:
            sub = await js.pull_subscribe(
                layout.topic_filter(topic),
                stream=stream,
                config=ConsumerConfig(
                    ack_policy=AckPolicy.NONE,
                    deliver_policy=DeliverPolicy.ALL,
                    num_replicas=1,
                    mem_storage=True,
                ),
            )
            ids: Counter[str] = Counter()
            try:
                while ids.total() < total:
                    for msg in await sub.fetch(500, timeout=5):
                        ids[(msg.headers or {}).get(layout.MSG_ID_HEADER, "?")] += 1
                return ids
            except (nats.errors.Error, TimeoutError):
                await anyio.sleep(0.2)  # a pause before reading from scratch again
            finally:
                await sub.unsubscribe()


async def wait_for(condition: Any, timeout: float, what: str, explain: Callable[[], str]) -> None:
    """Poll `condition` (async, truthy when met) until it holds or `timeout` passes. A
    poll NATS does not answer (the bucket it reads is electing a leader) is not met yet."""
    await eventually(
        condition,
        timeout=timeout,
        interval=0.2,
        what=what,
        explain=explain,
        ignoring=(nats.errors.Error, TimeoutError),
    )


async def all_partitions_served(nc: Client, partitions: int) -> bool:
    """Every partition answers an operator's list: each has a coordinator serving it."""
    try:
        await list_transactions(nc, partitions=partitions, timeout=2)
    except CoordinatorUnavailable:
        return False
    return True


async def no_transaction_open(nc: Client, partitions: int) -> bool:
    """Every partition is served and none holds an open transaction."""
    try:
        return not await list_transactions(nc, partitions=partitions, timeout=2)
    except CoordinatorUnavailable:
        return False
