"""Instructions per transaction, per role: the repeatable measure of what a transaction costs.

CPU seconds on this machine move with the other jobs on it (and `perf stat` counters are not
available), so this benchmark counts instructions instead (`bench.callgrind`): every role runs
in its own process under valgrind's callgrind, counting switched on only around the measured
work, after a warm-up.

- txactors: nats-server (fsync `always`), one coordinator process started by the CLI serving
  two partitions, a producer process (`send_in_transaction`, the default acked end) and a
  consumer process (`Consumer`, 64 handlers), `bench.cpu_roles`;
- raw JetStream: the same server, a producer process of acked single publishes of the same
  128-byte body and a consumer process of nats-py's own pull consumer (fetch 64, ack each).

Each at concurrency 1 and 64 (`COUNT` messages after `WARMUP`), `RUNS` rounds interleaved so
the spread between rounds shows how repeatable the counts are. The table gives instructions
per transaction (per message for raw) of each role and the ratio txactors / raw.

Set `TXBENCH_CALLGRIND_DIR` to a directory to keep the callgrind files there (one per role and
run; `callgrind_annotate FILE` shows where the instructions go).

Everything runs ~50x slower under callgrind, so every timeout of the roles is long
(`cpu_roles.SLOW`, `COORDINATOR_SETTINGS`); work driven by the clock rather than by the
transactions (the coordinator's 0.1 s tick, idle pulls) is counted for the stretched time,
so it weighs more here than in a normal run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import callgrind, cpu_roles
from bench.deployed import ROOT, wait_balanced
from bench.transactions import CONCURRENCY
from txactors.logs import configure_logging
from txactors.server import EmbeddedNatsServer
from txactors.server_setup import find_nats_server_binary

COUNT = 320
"""Measured transactions (messages) per run: a multiple of every concurrency."""
QUICK_COUNT = 64
WARMUP = 64
RUNS = 2
KINDS = ("txactors", "raw")
ROLES = ("producer", "coordinator", "consumer", "nats-server")
START_TIMEOUT = 600.0
"""Seconds for a role to start, warm up, finish its work or stop, under callgrind."""
SETTLE = 1.0
"""Seconds after the last message is consumed before counting stops: its ack reaches the
server."""
COORDINATOR_SETTINGS = (
    *("--partitions", str(cpu_roles.PARTITIONS)),
    *("--transaction-timeout", str(cpu_roles.SLOW)),
    *("--lease-ttl", str(cpu_roles.SLOW)),
    *("--checkpoint-interval", str(cpu_roles.SLOW)),
)
"""No check-back, lease renewal or checkpoint in the measured window: those are periodic
upkeep, not per-transaction work, and would be counted for a window 50x longer than usual."""
KEEP_ENV = "TXBENCH_CALLGRIND_DIR"
GODEBUG = "asyncpreemptoff=1"
"""nats-server's Go runtime without its preemption signals (SIGURG): callgrind 3.19 aborts on
them (`vgCallgrind_post_signal` assertion). Goroutines then yield only at function calls; the
work done, and so its count, is the same."""


@dataclass(frozen=True)
class Measured:
    """Instructions per message of each role in one run, and the run's wall seconds."""

    per_message: dict[str, float]
    seconds: float


class Process:
    """A role's process: the lines it says, and how it is stopped."""

    def __init__(self, name: str, process: asyncio.subprocess.Process) -> None:
        self.name, self.process = name, process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def expect(self, word: str) -> None:
        assert self.process.stdout is not None
        async with asyncio.timeout(START_TIMEOUT):
            line = await self.process.stdout.readline()
        if line.strip() != word.encode():
            raise RuntimeError(f"{self.name} said {line!r}, expected {word!r}")

    def say(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n".encode())

    async def stop(self) -> None:
        """Close its stdin (a role leaves then) or terminate it (the coordinator); wait until
        it has exited, so callgrind has written its count."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        else:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
        try:
            async with asyncio.timeout(START_TIMEOUT):
                await self.process.wait()
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise RuntimeError(f"{self.name} did not stop") from None


@contextlib.asynccontextmanager
async def started(
    name: str,
    program: list[str],
    out: Path,
    logs: Path,
    *,
    talks: bool = True,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Process]:
    """`program` under callgrind (counting off), its stderr in `logs`, with `env` on top of
    ours (no TXACTORS_ or NATS_ settings of our own); stopped on exit."""
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TXACTORS_", "NATS_"))},
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    with (logs / f"{out.stem}.log").open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            *callgrind.command(program, out),
            env=environment,
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE if talks else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE if talks else log,
            stderr=log,
        )
    role = Process(name, process)
    try:
        yield role
    finally:
        await role.stop()


def server_binary(directory: Path) -> Path:
    """A script that runs nats-server under callgrind, for `EmbeddedNatsServer(binary=...)`,
    in `directory` (made here: the run's own)."""
    directory.mkdir(parents=True)
    script = directory / "nats-server-callgrind"
    program = callgrind.command([str(find_nats_server_binary())], directory / "nats-server.out")
    script.write_text(f'#!/bin/sh\nGODEBUG={GODEBUG} exec {shlex.join(program)} "$@"\n')
    script.chmod(0o755)
    return script


def coordinator_program() -> list[str]:
    """The coordinator as an operator runs it, through the CLI."""
    return [sys.executable, "-m", "txactors.cli", "coordinator", *COORDINATOR_SETTINGS]


def role_program(role: str, url: str, topic: str, count: int, concurrency: int) -> list[str]:
    return [
        sys.executable,
        *("-m", "bench.cpu_roles", role, url, topic),
        *(str(WARMUP), str(count), str(concurrency)),
    ]


async def measure(kind: str, concurrency: int, count: int, directory: Path) -> Measured:
    """One run of `count` messages of `kind` at `concurrency` on a fresh server; its callgrind
    files and logs in `directory`."""
    began = time.monotonic()
    async with (
        EmbeddedNatsServer(
            fsync="always",
            binary=server_binary(directory),
            ready_timeout=START_TIMEOUT,
            stop_timeout=START_TIMEOUT,
        ) as server,
        asyncio.TaskGroup() as tasks,
    ):
        watcher = tasks.create_task(watch(server))
        pids = await counted(kind, concurrency, count, server, directory)
        watcher.cancel()
    seconds = time.monotonic() - began
    return Measured(per_message(directory, pids, count), seconds)


async def watch(server: EmbeddedNatsServer) -> None:
    """Fails the run as soon as nats-server is gone, rather than when the roles time out."""
    assert server.pid is not None
    exited = asyncio.Event()
    loop = asyncio.get_running_loop()
    pidfd = os.pidfd_open(server.pid)  # readable once the process has exited
    loop.add_reader(pidfd, exited.set)
    try:
        await exited.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    raise RuntimeError(f"nats-server exited during the run:\n{server.log_tail()}")


async def counted(
    kind: str, concurrency: int, count: int, server: EmbeddedNatsServer, directory: Path
) -> dict[str, int]:
    """Start the roles of `kind`, warm them up, count the measured work; returns the role ->
    pid of every process counted (each has written its file when this returns)."""
    assert server.pid is not None
    pids = {"nats-server": server.pid}
    topic = f"cpu{kind}{concurrency}"
    async with contextlib.AsyncExitStack() as stack:
        if kind == "txactors":
            coordinator = await stack.enter_async_context(
                started(
                    "coordinator",
                    coordinator_program(),
                    directory / "coordinator.out",
                    directory,
                    talks=False,
                    env={"NATS_URL": server.url},
                )
            )
            processes = [coordinator.process]
            partitions = cpu_roles.PARTITIONS
            await wait_balanced(server.url, processes, partitions, START_TIMEOUT, directory)
            pids["coordinator"] = coordinator.pid
        prefix = "tx" if kind == "txactors" else "raw"
        consumer = await stack.enter_async_context(
            started(
                "consumer",
                role_program(f"{prefix}consumer", server.url, topic, count, concurrency),
                directory / "consumer.out",
                directory,
            )
        )
        await consumer.expect("ready")
        producer = await stack.enter_async_context(
            started(
                "producer",
                role_program(f"{prefix}producer", server.url, topic, count, concurrency),
                directory / "producer.out",
                directory,
            )
        )
        await producer.expect("ready")
        await consumer.expect("warm")
        pids |= {"consumer": consumer.pid, "producer": producer.pid}
        await callgrind.toggle(pids.values(), True)
        producer.say("go")
        await producer.expect("done")
        await consumer.expect("done")
        await asyncio.sleep(SETTLE)
        await callgrind.toggle(pids.values(), False)
    return pids


def per_message(directory: Path, roles: Iterable[str], count: int) -> dict[str, float]:
    """Each role's instructions (its callgrind file `<role>.out` in `directory`) / `count`."""
    return {
        role: callgrind.instructions((directory / f"{role}.out").read_text()) / count
        for role in roles
    }


def spread(values: list[float]) -> float:
    """(max - min) / mean of the runs' values: 0 for one run."""
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def report(results: Mapping[tuple[str, int], list[Measured]], count: int, runs: int) -> Table:
    """Per concurrency and role: mean instructions per message of each kind, the ratio, and
    the spread between runs."""
    table = Table(
        title=f"instructions per transaction (raw: per message), {count} after {WARMUP} "
        f"warm-up, mean of {runs} run(s); spread = (max - min) / mean"
    )
    for column in ("concurrency, role", "txactors", "raw", "txactors / raw", "spread tx; raw"):
        table.add_column(column, justify="left" if column.startswith("conc") else "right")
    for concurrency in CONCURRENCY:
        for role in (*ROLES, "all"):
            cells = []
            spreads = []
            for kind in KINDS:
                values = [
                    sum(m.per_message.values()) if role == "all" else m.per_message[role]
                    for m in results[kind, concurrency]
                    if role == "all" or role in m.per_message
                ]
                cells.append(statistics.fmean(values) if values else None)
                spreads.append(f"{spread(values):.1%}" if values else "-")
            tx, raw = cells
            table.add_row(
                f"{concurrency}, {role}",
                f"{tx:,.0f}" if tx is not None else "-",
                f"{raw:,.0f}" if raw is not None else "-",
                f"{tx / raw:.1f}x" if tx is not None and raw else "-",
                "; ".join(spreads),
            )
    return table


async def main(*, quick: bool = False) -> None:
    configure_logging("ERROR")
    runs, count = (1, QUICK_COUNT) if quick else (RUNS, COUNT)
    kept = os.environ.get(KEEP_ENV)
    root = Path(kept) if kept else Path(tempfile.mkdtemp(prefix="txbench-cpu-"))
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    results: dict[tuple[str, int], list[Measured]] = {}
    try:
        for run in range(runs):
            for concurrency in CONCURRENCY:
                for kind in KINDS:
                    directory = root / f"{stamp}-run{run + 1}-{kind}-c{concurrency}"
                    measured = await measure(kind, concurrency, count, directory)
                    results.setdefault((kind, concurrency), []).append(measured)
                    counts = ", ".join(f"{r} {n:,.0f}" for r, n in measured.per_message.items())
                    print(
                        f"run {run + 1}, {kind}, concurrency {concurrency}: {counts} "
                        f"instructions per message ({measured.seconds:.0f} s)",
                        flush=True,
                    )
    except BaseException:
        print(f"the roles' logs and callgrind files are kept in {root}", file=sys.stderr)
        raise
    if not kept:
        shutil.rmtree(root, ignore_errors=True)
    Console(width=150).print(report(results, count, runs))
