"""The processes of a deployment, started and measured from outside for the benchmark.

- `Deployment`: an embedded nats-server with its HTTP monitoring port, coordinators started
  through the CLI (`python -m txactors.cli coordinator`, as an operator would), and a consumer
  process per run (`bench.e2e_consumer`).
- `Meter`: CPU seconds of each process (`/proc/<pid>/stat` utime + stime) and the server's
  own message counts (`/varz` in_msgs / out_msgs) between two snapshots, and the same counts
  per role (`/connz`, each role's connections known by their name, `ROLE_OF_CONNECTION`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import nats
import nats.errors
from nats.aio.client import Client

from txactors.embedded.server import EmbeddedNatsServer, Fsync
from txactors.ops.leases import list_leases
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, ListTransactions, encode

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
PARTITIONS = 2
"""Partitions of the coordinator runs of `bench.transactions`: one process serves both, or two
processes one each (`bench.scale` runs more)."""
START_TIMEOUT = 30.0
PRODUCER_CONNECTION = "bench-producer"
CONSUMER_CONNECTION = "bench-consumer"
ROLE_OF_CONNECTION = {
    "txactors": "coordinator",  # the CLI's connection name (`NatsConfig.name`)
    PRODUCER_CONNECTION: "producer",
    CONSUMER_CONNECTION: "consumer",
}
"""Role of a client connection by its name, for the per-role message counts; the rest are
"other" (the raw runs, the bench's own lease reads)."""
PROFILE_ENV = "TXBENCH_PROFILE"
"""A directory: run the coordinators and consumers under cProfile, one file per process
there, and profile the producer's runs too (`bench.transactions`). Slows every process down."""


def python(name: str) -> list[str]:
    """The command line running module `name`, under cProfile if `PROFILE_ENV` is set."""
    directory = os.environ.get(PROFILE_ENV)
    if not directory:
        return [sys.executable, "-m", name]
    out = Path(directory) / f"{name.rsplit('.', 1)[-1]}-{time.monotonic_ns()}.prof"
    return [sys.executable, "-m", "cProfile", "-o", str(out), "-m", name]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS  # utime, stime: fields 14, 15


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@dataclass(frozen=True)
class Snapshot:
    at: float
    cpu: dict[str, float]
    sys: dict[str, float]
    in_msgs: int
    out_msgs: int
    in_bytes: int
    out_bytes: int
    connections: dict[int, tuple[str, int, int]]
    """Per client connection id, open or closed: (role, messages in, messages out)."""


@dataclass(frozen=True)
class Usage:
    """What happened between two snapshots: seconds, CPU seconds per role, server messages."""

    seconds: float
    cpu: dict[str, float]
    """User + system CPU seconds per role."""
    sys: dict[str, float]
    """System CPU seconds per role (the kernel: socket writes, fsync)."""
    in_msgs: int
    out_msgs: int
    in_bytes: int
    out_bytes: int
    """Bytes the server received and sent (payloads and headers, as `/varz` counts them)."""
    msgs_by_role: dict[str, tuple[int, int]]
    """Messages the server received from and sent to each role's connections (`/connz`):
    where `in_msgs` and `out_msgs` come from."""


@dataclass
class Deployment:
    """A server and the processes around it; `roles` maps a role name to its pids."""

    server: EmbeddedNatsServer
    monitor_port: int
    logs: Path
    roles: dict[str, list[int]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/varz") as answer:
            data: dict[str, Any] = json.load(answer)
        return data

    def connz(self) -> dict[int, tuple[str, int, int]]:
        """Every client connection, closed ones too (a consumer process closes its own before
        the run's last snapshot): id -> (role, messages in, messages out)."""
        url = f"http://127.0.0.1:{self.monitor_port}/connz?state=all&limit=100000"
        with urllib.request.urlopen(url) as answer:
            data: dict[str, Any] = json.load(answer)
        return {
            c["cid"]: (
                ROLE_OF_CONNECTION.get(c.get("name", ""), "other"),
                c["in_msgs"],
                c["out_msgs"],
            )
            for c in data["connections"] or ()
        }

    def snapshot(self) -> Snapshot:
        connections = self.connz()
        varz = self.varz()
        roles = {"producer": [os.getpid()], "nats-server": [self.server.pid or 0], **self.roles}
        times = {role: [cpu_seconds(pid) for pid in pids] for role, pids in roles.items()}
        cpu = {role: sum(u + s for u, s in pairs) for role, pairs in times.items()}
        sys = {role: sum(s for _, s in pairs) for role, pairs in times.items()}
        return Snapshot(
            time.monotonic(),
            cpu,
            sys,
            varz["in_msgs"],
            varz["out_msgs"],
            varz["in_bytes"],
            varz["out_bytes"],
            connections,
        )

    @staticmethod
    def usage(before: Snapshot, after: Snapshot) -> Usage:
        by_role: dict[str, tuple[int, int]] = {}
        for cid, (role, in_msgs, out_msgs) in after.connections.items():
            _, in_before, out_before = before.connections.get(cid, (role, 0, 0))
            was_in, was_out = by_role.get(role, (0, 0))
            by_role[role] = (was_in + in_msgs - in_before, was_out + out_msgs - out_before)
        return Usage(
            after.at - before.at,
            {role: after.cpu[role] - before.cpu.get(role, 0.0) for role in after.cpu},
            {role: after.sys[role] - before.sys.get(role, 0.0) for role in after.sys},
            after.in_msgs - before.in_msgs,
            after.out_msgs - before.out_msgs,
            after.in_bytes - before.in_bytes,
            after.out_bytes - before.out_bytes,
            by_role,
        )

    def _log(self, name: str) -> IO[bytes]:
        return (self.logs / f"{name}.log").open("ab")

    @contextlib.asynccontextmanager
    async def coordinators(self, count: int, partitions: int = PARTITIONS) -> AsyncIterator[None]:
        """`count` coordinator processes sharing `partitions`, as the CLI runs them with their
        default settings (they split the partitions between them by themselves, balance.py);
        ready once the split is even. One role per process: `coordinator`, or `coordinator 1`
        .. `coordinator <count>`."""
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("TXACTORS_", "NATS_"))},
            "PYTHONPATH": str(ROOT),
            "NATS_URL": self.url,
        }
        processes = []
        try:
            for i in range(count):
                log = self._log(f"coordinator-{count}-{i}")
                processes.append(
                    await asyncio.create_subprocess_exec(
                        *python("txactors.cli"),
                        "coordinator",
                        *("--partitions", str(partitions)),
                        env=env,
                        cwd=ROOT,
                        stdout=log,
                        stderr=log,
                    )
                )
                log.close()
            await wait_balanced(self.url, processes, partitions, START_TIMEOUT, self.logs)
            pids = [p.pid for p in processes]
            roles = (
                ["coordinator"] if count == 1 else [f"coordinator {i + 1}" for i in range(count)]
            )
            self.roles.update({role: [pid] for role, pid in zip(roles, pids, strict=True)})
            yield
        finally:
            for role in [r for r in self.roles if r.startswith("coordinator")]:
                del self.roles[role]
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
            for process in processes:
                await process.wait()

    @contextlib.asynccontextmanager
    async def consumer(
        self, topic: str, count: int, *, raw: bool = False
    ) -> AsyncIterator[Consumed]:
        """A consumer process on `topic` expecting `count` messages (`raw`: a plain nats-py
        pull consumer, not txactors'); ready when entered."""
        log = self._log(f"consumer-{topic}")
        process = await asyncio.create_subprocess_exec(
            *python("bench.e2e_consumer"),
            *(self.url, topic, str(count), *(["raw"] if raw else [])),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            limit=1 << 26,
        )
        log.close()
        assert process.stdout is not None and process.stdin is not None
        try:
            async with asyncio.timeout(START_TIMEOUT):
                line = await process.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"consumer did not start: {line!r} (see {self.logs})")
            self.roles["consumer"] = [process.pid]
            yield Consumed(process)
        finally:
            self.roles.pop("consumer", None)
            process.stdin.close()  # it leaves by itself (writing its profile, if any)
            try:
                async with asyncio.timeout(10):
                    await process.wait()
            except TimeoutError:
                process.terminate()
                await process.wait()


@dataclass
class Consumed:
    """The consumer process's report: its latencies and the time of the last message."""

    process: asyncio.subprocess.Process

    async def result(self, timeout: float) -> tuple[list[float], float]:
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            line = await self.process.stdout.readline()
        report: Mapping[str, Any] = json.loads(line)
        return report["latencies"], report["last"]


async def wait_balanced(
    url: str,
    processes: list[asyncio.subprocess.Process],
    partitions: int,
    timeout: float,
    logs: Path,
) -> None:
    """Until each coordinator process holds its even share of the leases (`partitions //
    count`, or one more) and every partition answers (its owner has recovered it: a lease
    is taken before); fails if one exits or this takes `timeout` seconds (their logs are in
    `logs`)."""
    owners = len(processes)
    share = partitions // owners
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                table = await list_leases(nc, partitions=partitions)
                held = Counter(lease.owner for lease in table.leases if lease.owner)
                if (
                    all(lease.owner for lease in table.leases)
                    and len(held) == owners
                    and all(share <= n <= share + 1 for n in held.values())
                    and await serving(nc, partitions)
                ):
                    return
            if any(p.returncode is not None for p in processes):
                raise RuntimeError(f"a coordinator exited at start (see {logs})")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{owners} coordinator(s) did not split {partitions} partitions evenly"
                )
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def serving(nc: Client, partitions: int) -> bool:
    """Whether every partition answers a request (a list of at most one transaction): its
    owner subscribes only once it has recovered the partition."""
    request = encode(ListTransactions(version=PROTOCOL_VERSION, limit=1))
    for partition in range(partitions):
        try:
            await nc.request(layout.admin_subject(partition), request, timeout=1.0)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return False
    return True


@contextlib.asynccontextmanager
async def deployment(fsync: Fsync) -> AsyncIterator[Deployment]:
    """A fresh embedded server of `fsync`, monitored over HTTP. The processes' logs go to a
    temporary directory, removed after a good run and kept (and named) after a failed one."""
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="txbench-"))
    try:
        async with EmbeddedNatsServer(fsync=fsync, extra_args=("-m", str(port))) as server:
            yield Deployment(server, port, logs)
    except BaseException:
        print(f"the processes' logs are kept in {logs}", file=sys.stderr)
        raise
    shutil.rmtree(logs, ignore_errors=True)
