"""One writer per stream per coordinator process: partitions share writes, not faults.

Against a real nats-server. The halves' writes are watched (and held, to let appends queue
behind one) where the writer issues them.
"""

from __future__ import annotations

import anyio
import pytest
from nats.aio.client import Client
from nats.js.api import PubAck

from tests.support.txn import CoordinatorClient, message
from tests.support.wait import eventually
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.partition.packs import read_raw_halves
from txactors.coordinator.service import run_coordinator
from txactors.nats.topics import ensure_topic_stream
from txactors.nats.writer import (
    ATOMIC_MIN_MESSAGES,
    Append,
    PartitionWriter,
    PipelinedWriter,
    _Batch,
)
from txactors.wire import layout
from txactors.wire.protocol import Decision, Prepared

TWO = CoordinatorOptions(partitions=2)


def txid(partition: int, name: str) -> str:
    """A transaction id named `name` that belongs to `partition` (of two)."""
    return next(
        t
        for t in (f"{name}-{n}" for n in range(100))
        if layout.partition_of(t, TWO.partitions) == partition
    )


class HalfWrites:
    """The subjects of every TXN_HALF write issued; a write waits at `gate` while it is shut."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes: list[list[str]] = []
        self.gate = anyio.Event()
        self.gate.set()
        self.writer: PipelinedWriter | None = None
        issue = PipelinedWriter._issue

        async def watched(writer: PipelinedWriter, batch: _Batch) -> bool:
            if batch.slots[0].append.stream == layout.half_stream(0):
                self.writer = writer
                self.writes.append([slot.append.subject for slot in batch.slots])
                await self.gate.wait()
            return await issue(writer, batch)

        monkeypatch.setattr(PipelinedWriter, "_issue", watched)

    def shut(self) -> None:
        self.gate = anyio.Event()

    async def queued(self, appends: int) -> None:
        """Until `appends` halves wait behind the held write."""
        await eventually(
            lambda: self.writer is not None and len(self.writer._queued) == appends,
            what=f"{appends} halves queued",
        )


async def test_two_partitions_halves_go_out_in_one_write(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    halves = HalfWrites(monkeypatch)
    async with run_coordinator(private_nc, options=TWO):
        clients = [CoordinatorClient(private_nc, partition=p) for p in (0, 1)]
        for p, client in enumerate(clients):
            await client.prepare(txid(p, "warm-up"), message())  # the topic stream exists
        halves.writes.clear()
        halves.shut()
        prepared: dict[str, Prepared] = {}

        async def prepare(client: CoordinatorClient, name: str) -> None:
            prepared[name] = await client.prepare(txid(client.partition, name), message())

        names = [f"p{p}-{i}" for p in (0, 1) for i in range(ATOMIC_MIN_MESSAGES // 2)]
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(prepare, clients[0], "held")
            await eventually(lambda: len(halves.writes) == 1, what="the first write held")
            for name in names:
                tasks.start_soon(prepare, clients[int(name[1])], name)
            await halves.queued(len(names))
            halves.gate.set()
        for name in names:
            receipt = prepared[name]
            ended = await clients[int(name[1])].end(receipt.txid, receipt.token, Decision.COMMIT)
            assert ended.state == "committed"
    assert len(halves.writes) == 2, "the two partitions' halves shared the second write"
    assert sorted(set(halves.writes[1])) == [layout.half_subject(0), layout.half_subject(1)]
    seqs = sorted(prepared[name].seqs[0] for name in names)
    assert seqs == list(range(seqs[0], seqs[0] + len(names))), "one atomic batch"


async def test_stopping_one_partition_leaves_the_others_pending_writes_alone(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    halves = HalfWrites(monkeypatch)
    async with run_coordinator(private_nc, options=TWO) as coordinator:
        clients = [CoordinatorClient(private_nc, partition=p) for p in (0, 1)]
        for p, client in enumerate(clients):
            await client.prepare(txid(p, "warm-up"), message())
        halves.writes.clear()
        halves.shut()
        prepared: dict[str, Prepared] = {}

        async def prepare(client: CoordinatorClient, name: str) -> None:
            prepared[name] = await client.prepare(txid(client.partition, name), message())

        async with anyio.create_task_group() as abandoned:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(prepare, clients[0], "p0")
                await eventually(lambda: len(halves.writes) == 1, what="p0's write held")
                tasks.start_soon(prepare, clients[0], "p0-queued")
                # never answered: its partition stops while the half is queued
                abandoned.start_soon(prepare, clients[1], "p1-queued")
                await halves.queued(2)
                ref = coordinator.owned[1].ref
                assert ref is not None
                await ref.stop()
                halves.gate.set()
            abandoned.cancel_scope.cancel()
        for name in ("p0", "p0-queued"):
            receipt = prepared[name]
            ended = await clients[0].end(receipt.txid, receipt.token, Decision.COMMIT)
            assert ended.state == "committed"
        js = private_nc.jetstream()
        last = await js.get_last_msg(layout.half_stream(0), layout.half_subject(1))
        stopped = txid(1, "p1-queued")
        [half] = read_raw_halves(last)
        assert half.txid == stopped, "the stopped one's half went too"
    assert "p1-queued" not in prepared
    assert [len(write) for write in halves.writes] == [1, 1, 1], "few: each alone"


async def test_a_report_that_raises_fails_its_own_partition_and_the_writer_goes_on(
    private_nc: Client,
) -> None:
    await ensure_topic_stream(private_nc.jetstream(), "shared")
    writer = PipelinedWriter(private_nc, private_nc.jetstream())
    failures: list[Exception] = []
    reported: list[list[PubAck | None]] = []

    async def quarantine(append: Append, reason: str) -> None:
        raise AssertionError(f"nothing is refused here: {reason}")

    async def broken(acks: list[PubAck | None]) -> None:
        raise RuntimeError("a bug in one partition's completion")

    async def report(acks: list[PubAck | None]) -> None:
        reported.append(acks)

    partitions = [PartitionWriter(writer, quarantine, failures.append) for _ in range(2)]
    appends = [Append("topic.shared._", b"b", {}, layout.topic_stream("shared"))]
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(writer.run)
        partitions[0].submit(appends, broken)
        partitions[1].submit(appends, report)
        await eventually(lambda: len(reported) == 1, what="the other partition's report")
        partitions[0].submit(appends, report)
        await eventually(lambda: len(reported) == 2, what="the failed partition's next report")
        tasks.cancel_scope.cancel()
    assert [str(f) for f in failures] == ["a bug in one partition's completion"]
    assert all(acks[0] is not None for acks in reported)
