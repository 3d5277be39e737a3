"""Transactional messages as deployed, next to the fastest raw JetStream publishing, one run.

Per fsync setting of nats-server (`always`, the durable default, then `interval`), on a fresh
embedded server each (`bench.deployed`):

- raw JetStream (`bench.raw`): one acked publish at a time (the latency of one write);
  acked single publishes with `RAW_IN_FLIGHT` (64) awaiting their acks, **the baseline of
  every ratio** (what a user's own durable publishes at the same concurrency do); and atomic
  batch publish (`RAW_BATCH` messages, all or nothing, one ack), shown as the limit of this
  machine, not as the baseline; and the baseline's publishes again, each read by a plain
  nats-py pull consumer in its own process (`bench.e2e_consumer raw`): a raw message's whole
  life, **the baseline of bytes, NATS messages and CPU per transaction**, which count the
  consumer on both sides.
- txactors end to end: producers in this process (prepare, a trivial local transaction,
  commit), the coordinator in its own process started by the CLI (one process serving both
  partitions, then two serving one each), a consumer in its own process
  (`bench.e2e_consumer`); concurrency 1 and 64, once per way to end (`END_VARIANTS`: acked
  and one-way); with one coordinator, 64 producers paced at half that maximum too (the
  consumer keeps up: consumed p99 <= 100 ms).
- per run: commit and consumed latency, NATS messages and bytes in and out per transaction
  as the server counts them, and CPU per transaction of each process.

The targets: at 64 in flight, committed transactions >= 100% of the baseline
with `sync_interval: always` (stretch 200%) and >= 33% on a lazy server; at concurrency 1,
commit p50 <= 4x one acked publish; CPU per transaction <= 3x a raw message's, NATS messages
<= 3 in and 3 out, bytes <= 2x.

The checker rows (check cycle, check storm, recovery) are `bench.checker`.
"""

from __future__ import annotations

import contextlib
import cProfile
import itertools
import os
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import nats
from nats.aio.client import Client
from rich.console import Console
from rich.table import Table

from bench import checker, raw
from bench.deployed import (
    PARTITIONS,
    PRODUCER_CONNECTION,
    PROFILE_ENV,
    Deployment,
    Usage,
    deployment,
)
from txactors.embedded.server import Fsync
from txactors.observe.logs import configure_logging
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.wire import layout

SETTINGS: tuple[Fsync, ...] = ("always", "interval")
"""The embedded server's fsync settings: `always` (the durable default) is the one that counts."""
BODY_SIZE = 128
STAMP = struct.Struct("<d")
"""Each body starts with its send time on the monotonic clock (`bench.e2e_consumer` reads it)."""
RAW_IN_FLIGHT = 64
"""Acked single publishes awaiting their acks in the baseline: the transactions' concurrency."""
RAW_BATCH = 1000
"""Messages per atomic batch (JetStream's most), two batches in flight."""
CONCURRENCY = (1, 64)
CONSUMED_TIMEOUT = 300.0

END_VARIANTS: dict[str, dict[str, Any]] = {
    "acked end": {"end_mode": "ack"},
    "one-way end": {"end_mode": "oneway"},
}
"""Ways to end a transaction, each run in turn: label → keyword arguments of
`TransactionProducer`. With a one-way end, the commit latency is until the end is published
(unconfirmed); the consumed latency is the one that counts."""

ACKED_ONLY_ENV = "TXBENCH_ACKED_ONLY"
"""Set (to anything): only fsync `always`, one coordinator process, the acked end, unpaced, no
checker rows: the quick loop for working on the commit path's latency and CPU."""

TARGET_RATE: dict[Fsync, float] = {"always": 1.0, "interval": 1 / 3}
"""Committed tx/s at 64 in flight against the baseline, per fsync setting."""
TARGET_C1_LATENCY = 4.0
TARGET_CPU = 3.0
TARGET_MSGS = 3.0
TARGET_BYTES = 2.0
TARGET_CONSUMED_P99 = 0.100
PACE_ENV = "TXBENCH_PACE"
"""tx/s: run only the paced rows (fsync `always`, one coordinator) at this rate, to measure
or profile them alone; the maximum is not measured then."""


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def p50_p99(seconds: list[float]) -> str:
    return f"{percentile(seconds, 0.5) * 1e3:.1f} / {percentile(seconds, 0.99) * 1e3:.1f}"


def stamped() -> bytes:
    return STAMP.pack(time.monotonic()) + b"x" * (BODY_SIZE - STAMP.size)


def mark(ok: bool, target: str) -> str:
    return f"{'✓' if ok else '✗'} {target}"


@dataclass(frozen=True)
class Run:
    """One measured run: `count` operations, their rate and latencies, and what they cost."""

    count: int
    rate: float
    latencies: list[float]
    usage: Usage
    consumed: list[float] | None = None
    confirmed: bool = True
    """Every end was confirmed (an acked end): the commit latency is the durable commit's."""

    def cpu_ms(self, role: str | None = None) -> float:
        cpu = self.usage.cpu
        return (cpu.get(role, 0.0) if role else sum(cpu.values())) / self.count * 1e3

    def msgs(self) -> str:
        return f"{self.usage.in_msgs / self.count:.2f} / {self.usage.out_msgs / self.count:.2f}"

    def msgs_split(self, way: int = 0) -> str:
        """Messages per operation by role, most first: `way` 0 the server received from the
        role, 1 it sent to the role (a coordinator's: its requests and one ack per write)."""
        by_role = self.usage.msgs_by_role
        roles = sorted(by_role, key=lambda r: -by_role[r][way])
        return ", ".join(
            f"{r} {by_role[r][way] / self.count:.3f}" for r in roles if by_role[r][way] > 0
        )

    def bytes(self) -> float:
        """Bytes on the wire per operation, in and out of the server together."""
        return (self.usage.in_bytes + self.usage.out_bytes) / self.count

    def cpu_split(self) -> str:
        roles = sorted(self.usage.cpu, key=lambda r: -self.usage.cpu[r])
        return ", ".join(
            f"{r} {self.cpu_ms(r):.3f} ({self.usage.sys[r] / self.usage.cpu[r]:.0%} sys)"
            for r in roles
            if self.usage.cpu[r] > 0
        )


RawRuns = tuple[Run, Run, Run, Run]
"""One at a time, the baseline (64 in flight), atomic batches, and the baseline's publishes
read by a raw consumer (a message's whole life: what a transaction's costs compare with)."""


async def raw_consumed(dep: Deployment, nc: Client, count: int) -> Run:
    """`count` acked single publishes, `RAW_IN_FLIGHT` in flight, until a raw pull consumer
    in its own process had them all: what a message costs from publish to consumer ack."""
    topic = "rawlife"
    async with dep.consumer(topic, count, raw=True) as consumer:  # ready: the stream exists
        before = dep.snapshot()
        started = time.monotonic()
        latencies = await raw.publish_acked(
            nc, layout.topic_subject(topic), stamped(), range(count), RAW_IN_FLIGHT
        )
        consumed, last = await consumer.result(CONSUMED_TIMEOUT)
        usage = dep.usage(before, dep.snapshot())
    await nc.jetstream().purge_stream(layout.topic_stream(topic))
    return Run(count, count / (last - started), latencies, usage, consumed)


async def raw_runs(
    dep: Deployment, nc: Client, scale: float, *, life: bool = True
) -> dict[str, Run]:
    """The raw methods in turn, each with what it cost (`Usage`); `life`: the last of
    `RawRuns` too."""
    body = stamped()
    methods: list[tuple[str, int, Callable[[int], Awaitable[tuple[float, list[float]]]]]] = [
        ("one at a time", 1000, lambda n: raw.pipelined(nc, body, n, 1)),
        (
            f"single publishes, {RAW_IN_FLIGHT} in flight (the baseline)",
            20000,
            lambda n: raw.pipelined(nc, body, n, RAW_IN_FLIGHT),
        ),
        (
            f"atomic batches of {RAW_BATCH}, 2 in flight",
            50000,
            lambda n: raw.atomic_batches(nc, body, n, RAW_BATCH, 2),
        ),
    ]
    runs: dict[str, Run] = {}
    for name, full, work in methods:
        count = int(full * scale)
        before = dep.snapshot()
        rate, latencies = await work(count)
        runs[name] = Run(count, rate, latencies, dep.usage(before, dep.snapshot()))
    if life:
        name = f"single publishes, {RAW_IN_FLIGHT} in flight, read by a pull consumer process"
        runs[name] = await raw_consumed(dep, nc, int(20000 * scale))
    return runs


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """cProfile this process meanwhile if `PROFILE_ENV` names a directory (else nothing)."""
    directory = os.environ.get(PROFILE_ENV)
    if not directory:
        yield
        return
    profile = cProfile.Profile()
    with profile:
        yield
    Path(directory).mkdir(parents=True, exist_ok=True)
    profile.dump_stats(Path(directory) / f"{name}.prof")


async def e2e(
    dep: Deployment,
    producer: TransactionProducer,
    count: int,
    workers: int,
    topic: str,
    *,
    pace: float | None = None,
) -> Run:
    """`count` transactions over `workers` tasks (at most `pace` started per second), until the
    consumer process had them all."""
    commit_latencies: list[float] = []
    unconfirmed = 0
    tickets = itertools.count()

    async def worker() -> None:
        nonlocal unconfirmed
        for i in tickets:
            if i >= count:
                return
            if pace is not None:
                await anyio.sleep(max(0.0, started + i / pace - time.monotonic()))
            body = stamped()
            result = await producer.send_in_transaction(
                TxMessage(topic, body), lambda m, a: Decision.COMMIT
            )
            if result.state not in ("committed", None):  # None: a one-way end (unconfirmed)
                raise RuntimeError(f"transaction not committed: {result}")
            unconfirmed += result.state is None
            commit_latencies.append(time.monotonic() - STAMP.unpack_from(body)[0])

    async with dep.consumer(topic, count) as consumer:
        before = dep.snapshot()
        started = time.monotonic()
        with profiled(f"producer-{topic}"):
            async with anyio.create_task_group() as tg:
                for _ in range(workers):
                    tg.start_soon(worker)
        consumed, last = await consumer.result(CONSUMED_TIMEOUT)
        usage = dep.usage(before, dep.snapshot())
    rate = count / (last - started)
    return Run(count, rate, commit_latencies, usage, consumed, confirmed=not unconfirmed)


class Report:
    """The table: one block of rows per fsync setting, ratios against that run's baseline."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        """Fraction of the full run's counts (`--quick`: 0.1)."""
        self.table = Table(title="transactional messages as deployed vs raw JetStream (same run)")
        for column in ("measure", "txactors", "raw baseline", "ratio", "target"):
            self.table.add_column(column, justify="left" if column == "measure" else "right")

    def row(self, *cells: str) -> None:
        self.table.add_row(*cells, *("-",) * (5 - len(cells)))

    def raw(self, setting: Fsync, runs: dict[str, Run]) -> RawRuns:
        """Rows of the raw runs (`RawRuns`)."""
        for name, run in runs.items():
            until = " until consumed" if run.consumed is not None else ""
            self.row(f"{setting}: raw {name}: acked msg/s{until}", "-", f"{run.rate:,.0f}")
            self.row(
                "  ack latency p50 / p99 ms; NATS msgs in / out, bytes per msg",
                "-",
                f"{p50_p99(run.latencies)}; {run.msgs()}, {run.bytes():,.0f}",
            )
            self.row(f"  CPU ms per msg ({run.cpu_split()})", "-", f"{run.cpu_ms():.3f}")
        single, base, batched, life = runs.values()
        return single, base, batched, life

    def e2e(self, setting: Fsync, label: str, run: Run, raws: RawRuns, workers: int) -> None:
        """Rows of one end-to-end run, against the baseline (and atomic batches, the limit);
        its costs against a raw message's whole life, consumer included as in the run."""
        single, base, batched, life = raws
        assert run.consumed is not None
        ratio = run.rate / base.rate
        target = TARGET_RATE[setting]
        self.row(
            f"{label}: committed tx/s until consumed",
            f"{run.rate:,.0f}",
            f"{base.rate:,.0f}",
            f"{ratio:.0%} (atomic batches {run.rate / batched.rate:.0%})",
            mark(ratio >= target, f">= {target:.0%}") if workers > 1 else "-",
        )
        # an unconfirmed (one-way) end returns before the commit: the consumed latency counts
        commit_p50 = percentile(run.latencies if run.confirmed else run.consumed, 0.5)
        raw_p50 = percentile(single.latencies, 0.5)
        self.row(
            "  latency p50 / p99 ms: commit; consumed (raw: one acked publish)"
            + ("" if run.confirmed else "; target on consumed"),
            f"{p50_p99(run.latencies)}; {p50_p99(run.consumed)}",
            p50_p99(single.latencies),
            f"{commit_p50 / raw_p50:.1f}x" if workers == 1 else "-",
            mark(commit_p50 <= TARGET_C1_LATENCY * raw_p50, f"<= {TARGET_C1_LATENCY:.0f}x")
            if workers == 1
            else "-",
        )
        in_msgs, out_msgs = (n / run.count for n in (run.usage.in_msgs, run.usage.out_msgs))
        self.row(
            f"  NATS msgs in / out per txn (server's count; in by role: {run.msgs_split()}; "
            f"out by role: {run.msgs_split(1)})",
            run.msgs(),
            life.msgs(),
            "-",
            mark(
                max(in_msgs, out_msgs) <= TARGET_MSGS,
                f"<= {TARGET_MSGS:.0f} / {TARGET_MSGS:.0f}",
            ),
        )
        bytes_ratio = run.bytes() / life.bytes()
        self.row(
            "  bytes on the wire per txn, in + out (server's count)",
            f"{run.bytes():,.0f}",
            f"{life.bytes():,.0f}",
            f"{bytes_ratio:.1f}x",
            mark(bytes_ratio <= TARGET_BYTES, f"<= {TARGET_BYTES:.0f}x"),
        )
        cpu_ratio = run.cpu_ms() / life.cpu_ms()
        self.row(
            f"  CPU ms per txn ({run.cpu_split()})",
            f"{run.cpu_ms():.3f}",
            f"{life.cpu_ms():.3f}",
            f"{cpu_ratio:.1f}x",
            mark(cpu_ratio <= TARGET_CPU, f"<= {TARGET_CPU:.0f}x"),
        )

    def paced(self, label: str, run: Run, pace: float) -> None:
        assert run.consumed is not None
        p99 = percentile(run.consumed, 0.99)
        self.row(
            f"{label}: paced at {pace:,.0f} tx/s (half the max; {run.rate:,.0f} until consumed): "
            "latency p50 / p99 ms: "
            f"commit; consumed; NATS msgs in / out per txn; CPU ms per txn ({run.cpu_split()})",
            f"{p50_p99(run.latencies)}; {p50_p99(run.consumed)}; {run.msgs()}; {run.cpu_ms():.3f}",
            "-",
            "-",
            mark(p99 <= TARGET_CONSUMED_P99, f"p99 <= {TARGET_CONSUMED_P99 * 1e3:.0f} ms"),
        )


async def coordinated(
    report: Report, dep: Deployment, nc: Client, raws: RawRuns, processes: int
) -> None:
    """Every end-to-end run with `processes` coordinator processes, per way to end; with one
    process, a run paced at half the maximum rate too."""
    setting, scale = dep.server.fsync, report.scale
    where = f"{setting}: {processes} coordinator process{'es' if processes > 1 else ''}"
    async with dep.coordinators(processes):
        for end, options in END_VARIANTS.items():
            if os.environ.get(ACKED_ONLY_ENV) and options.get("end_mode") != "ack":
                continue
            async with TransactionProducer(
                nc, "bench", lambda v: Decision.COMMIT, partitions=PARTITIONS, **options
            ) as producer:
                max_rate = 0.0
                for workers in CONCURRENCY:
                    count = max(int((1000 if workers == 1 else 10000) * scale), workers)
                    topic = f"e2e{processes}c{workers}-{end.replace(' ', '')}"
                    run = await e2e(dep, producer, count, workers, topic)
                    label = f"{where}, concurrency {workers}, {end}"
                    report.e2e(setting, label, run, raws, workers)
                    max_rate = max(max_rate, run.rate)
                if processes == 1 and not os.environ.get(ACKED_ONLY_ENV):
                    pace = max_rate / 2
                    count = max(int(pace * 8 * scale), 64)
                    topic = f"e2epaced-{end.replace(' ', '')}"
                    run = await e2e(dep, producer, count, 64, topic, pace=pace)
                    report.paced(f"{where}, {end}", run, pace)


async def rates(report: Report, setting: Fsync) -> None:
    async with deployment(setting) as dep:
        nc = await nats.connect(dep.url, name=PRODUCER_CONNECTION)
        try:
            raws = report.raw(setting, await raw_runs(dep, nc, report.scale))
            for processes in (1,) if os.environ.get(ACKED_ONLY_ENV) else (1, 2):
                await coordinated(report, dep, nc, raws, processes)
        finally:
            await nc.close()


async def paced_only(report: Report, pace: float) -> None:
    """The paced rows alone at `pace` tx/s (`PACE_ENV`), fsync `always`, one coordinator."""
    async with deployment("always") as dep, dep.coordinators(1):
        nc = await nats.connect(dep.url, name=PRODUCER_CONNECTION)
        try:
            for end, options in END_VARIANTS.items():
                async with TransactionProducer(
                    nc, "bench", lambda v: Decision.COMMIT, partitions=PARTITIONS, **options
                ) as producer:
                    count = max(int(pace * 8 * report.scale), 64)
                    run = await e2e(
                        dep, producer, count, 64, f"paced-{end.replace(' ', '')}", pace=pace
                    )
                    report.paced(f"always: 1 coordinator process, {end}", run, pace)
        finally:
            await nc.close()


async def main(*, quick: bool = False) -> list[Table]:
    configure_logging("ERROR")
    report = Report(scale=0.1 if quick else 1.0)
    if os.environ.get(PACE_ENV):
        await paced_only(report, float(os.environ[PACE_ENV]))
        Console(width=200).print(report.table)
        return [report.table]
    acked_only = bool(os.environ.get(ACKED_ONLY_ENV))
    for setting in SETTINGS[:1] if acked_only else SETTINGS:
        await rates(report, setting)
    if not acked_only:
        await checker.checks(report.table, report.scale)
    Console(width=200).print(report.table)
    return [report.table]
