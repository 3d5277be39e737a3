"""Instructions per transaction, per role: the repeatable measure of what a transaction costs.

CPU seconds on this machine move with the other jobs on it (and `perf stat` counters are not
available), so this benchmark counts instructions instead (`bench.callgrind`): every role runs
in its own process under valgrind's callgrind, counting switched on only around the measured
work, after a warm-up.

- txactors: nats-server (fsync `always`), one coordinator process started by the CLI serving
  two partitions, a producer process (`send_in_transaction`, the default acked end) and a
  consumer process (`Consumer`, 64 handlers, on `TolerantClient` as deployed),
  `bench.cpu_roles`;
- raw JetStream: the same server, a producer process of acked single publishes of the same
  128-byte body and a consumer process of nats-py's own pull consumer (fetch 64, ack each).

Each at concurrency 1 and 64 (`COUNT` messages after `WARMUP`), `RUNS` rounds interleaved so
the spread between rounds shows how repeatable the counts are. The table gives instructions
per transaction (per message for raw) of each role and the ratio txactors / raw.

Set `TXBENCH_CALLGRIND_DIR` to a directory to keep the callgrind files there (one per role and
run; `callgrind_annotate FILE` shows where the instructions go).

Everything runs ~50x slower under callgrind, so every timeout of the roles is long
(`cpu_roles.SLOW`, `COORDINATOR_SETTINGS`); work driven by the clock rather than by the
transactions (the coordinator's look at TXN_HALF's end for late halves every 10 ticks, idle
pulls) is counted for the stretched time, so it weighs more here than in a normal run.
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
from txactors.embedded.server import EmbeddedNatsServer
from txactors.embedded.setup import find_nats_server_binary
from txactors.observe.logs import configure_logging

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
IDLE = 5.0
"""Seconds each run counts its roles idle (after the warm-up, before the work): what the
clock alone makes them do (timers, ticks, idle pulls), to tell apart from the work."""
COORDINATOR_SETTINGS = (
    *("--partitions", str(cpu_roles.PARTITIONS)),
    *("--transaction-timeout", str(cpu_roles.SLOW)),
    *("--lease-ttl", str(cpu_roles.SLOW)),
    *("--checkpoint-interval", str(cpu_roles.SLOW)),
    *("--tick-interval", str(0.1 * cpu_roles.SLOWDOWN)),  # the default, stretched
)
"""No check-back, lease renewal or checkpoint in the measured window: those are periodic
upkeep, not per-transaction work, and would be counted for a window 50x longer than usual."""
KEEP_ENV = "TXBENCH_CALLGRIND_DIR"
GO_ENV = "GODEBUG=asyncpreemptoff=1 GOMAXPROCS=1"
"""nats-server's Go runtime under callgrind: without its preemption signals (SIGURG), on which
callgrind 3.19 aborts (`vgCallgrind_post_signal` assertion), and on one processor, so that idle
threads spinning for work to steal (counted, and as many as the timing makes them) do not
blur the count: valgrind runs one thread at a time anyway."""


@dataclass(frozen=True)
class Measured:
    """Instructions per message of each role in one run, and the run's wall seconds."""

    per_message: dict[str, float]
    idle_per_message: dict[str, float]
    """What each role counts while idle (per second, before the work) over as long as the
    measured work took, per message: the share of `per_message` the clock alone explains."""
    window: float
    """Seconds the measured work took (under callgrind)."""
    seconds: float
    """Seconds the whole run took, start-up and warm-up included."""


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
    script.write_text(f'#!/bin/sh\n{GO_ENV} exec {shlex.join(program)} "$@"\n')
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
        pids, idle, window = await counted(kind, concurrency, count, server, directory)
        watcher.cancel()
    seconds = time.monotonic() - began
    idle_per_second = per_message(directory, pids, idle, suffix=".1")
    return Measured(
        per_message(directory, pids, count),
        {role: n * window / count for role, n in idle_per_second.items()},
        window,
        seconds,
    )


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
) -> tuple[dict[str, int], float, float]:
    """Start the roles of `kind`, warm them up, count them idle for `IDLE` seconds (dumped to
    `<role>.out.1`), then the measured work (`<role>.out`, written as each exits). Returns
    the role -> pid of every process counted, the idle and the measured seconds."""
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
        idle_from = time.monotonic()
        await asyncio.sleep(IDLE)
        await callgrind.dump(pids.values())
        work_from = time.monotonic()
        producer.say("go")
        await producer.expect("done")
        await consumer.expect("done")
        await asyncio.sleep(SETTLE)
        await callgrind.toggle(pids.values(), False)
        work_to = time.monotonic()
    return pids, work_from - idle_from, work_to - work_from


def per_message(
    directory: Path, roles: Iterable[str], count: float, *, suffix: str = ""
) -> dict[str, float]:
    """Each role's instructions (its callgrind file `<role>.out<suffix>` in `directory`) /
    `count`."""
    return {
        role: callgrind.instructions((directory / f"{role}.out{suffix}").read_text()) / count
        for role in roles
    }


def spread(values: list[float]) -> float:
    """(max - min) / mean of the runs' values: 0 for one run."""
    mean = statistics.fmean(values)
    return (max(values) - min(values)) / mean if mean else 0.0


def role_values(runs: list[Measured], role: str, *, less_idle: bool = False) -> list[float]:
    """Per run, `role`'s instructions per message (`all`: every role's together), less its
    idle share if `less_idle`; none if the role has no process in these runs."""
    counts = [
        {
            r: n - (m.idle_per_message[r] if less_idle else 0.0)
            for r, n in m.per_message.items()
            if role in ("all", r)
        }
        for m in runs
    ]
    return [sum(c.values()) for c in counts if c]


def mean_and_spread(runs: list[Measured], role: str, *, less_idle: bool) -> tuple[float, str]:
    """The mean of `role_values` and their spread as text; (0, "-") if the role has none."""
    values = role_values(runs, role, less_idle=less_idle)
    return (statistics.fmean(values), f"{spread(values):.1%}") if values else (0.0, "-")


def report(results: Mapping[tuple[str, int], list[Measured]], count: int, runs: int) -> Table:
    """Per concurrency and role: mean instructions per message of each kind and their ratio,
    the clock's share, the spread between runs; and the same less the clock's share (what
    repeats best when the machine's load, and so the runs' length, differ)."""
    table = Table(
        title=f"instructions per transaction (raw: per message), {count} after {WARMUP} "
        f"warm-up, mean of {runs} run(s); idle = what the roles count idle over as long as the "
        "work took; spread = (max - min) / mean of the runs"
    )
    columns = (
        "concurrency, role",
        "txactors",
        "raw",
        "txactors / raw",
        "idle",
        "spread",
        "less idle: txactors; raw",
        "ratio",
        "spread ",
    )
    for column in columns:
        table.add_column(column, justify="left" if column.startswith("conc") else "right")

    def number(value: float) -> str:
        return f"{value:,.0f}" if value else "-"

    def ratio(tx: float, raw: float) -> str:
        return f"{tx / raw:.1f}x" if tx and raw else "-"

    for concurrency in CONCURRENCY:
        for role in (*ROLES, "all"):
            counted = [
                mean_and_spread(results[kind, concurrency], role, less_idle=False) for kind in KINDS
            ]
            less = [
                mean_and_spread(results[kind, concurrency], role, less_idle=True) for kind in KINDS
            ]
            (tx, tx_spread), (raw, raw_spread) = counted
            (tx_less, tx_less_spread), (raw_less, raw_less_spread) = less
            idle = "; ".join(
                f"{1 - work / total:.0%}" if total else "-"
                for (total, _), (work, _) in zip(counted, less, strict=True)
            )
            table.add_row(
                f"{concurrency}, {role}",
                number(tx),
                number(raw),
                ratio(tx, raw),
                idle,
                f"{tx_spread}; {raw_spread}",
                f"{number(tx_less)}; {number(raw_less)}",
                ratio(tx_less, raw_less),
                f"{tx_less_spread}; {raw_less_spread}",
            )
    return table


async def main(*, quick: bool = False) -> list[Table]:
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
                    counts = ", ".join(
                        f"{r} {n:,.0f} (idle {measured.idle_per_message[r]:,.0f})"
                        for r, n in measured.per_message.items()
                    )
                    print(
                        f"run {run + 1}, {kind}, concurrency {concurrency}: {counts} "
                        f"instructions per message (work {measured.window:.0f} s, "
                        f"run {measured.seconds:.0f} s)",
                        flush=True,
                    )
    except BaseException:
        print(f"the roles' logs and callgrind files are kept in {root}", file=sys.stderr)
        raise
    if not kept:
        shutil.rmtree(root, ignore_errors=True)
    table = report(results, count, runs)
    Console(width=150).print(table)
    return [table]
