"""Writers of a coordinator process: each partition's log has its own, topics are shared;
partitions share writes where they share a stream, never faults.

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
from txactors.errors import CommandError
from txactors.nats.topics import ensure_topic_stream
from txactors.nats.writer import (
    Append,
    PartitionWriter,
    PipelinedWriter,
    _Batch,
)
from txactors.wire import layout
from txactors.wire.protocol import Decision, ErrorCode, Prepared

TWO = CoordinatorOptions(partitions=2)


def txid(partition: int, name: str) -> str:
    """A transaction id named `name` that belongs to `partition` (of two)."""
    return next(
        t
        for t in (f"{name}-{n}" for n in range(100))
        if layout.partition_of(t, TWO.partitions) == partition
    )


class HalfWrites:
    """The subjects of every write issued to one partition's half stream; a write waits at
    `gate` while it is shut."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, partition: int) -> None:
        self.writes: list[list[str]] = []
        self.gate = anyio.Event()
        self.gate.set()
        self.writer: PipelinedWriter | None = None
        issue = PipelinedWriter._issue
        stream = layout.half_stream(partition)

        async def watched(writer: PipelinedWriter, batch: _Batch) -> bool:
            if batch.slots[0].append.stream == stream:
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


async def test_a_partition_whose_half_stream_holds_its_write_holds_up_no_other(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each partition's log stands alone: while partition 0's half stream does not answer
    (a leader election, say), partition 1 prepares and commits on."""
    held = HalfWrites(monkeypatch, 0)
    async with run_coordinator(private_nc, options=TWO):
        clients = [CoordinatorClient(private_nc, partition=p) for p in (0, 1)]
        for p, client in enumerate(clients):
            await client.prepare(txid(p, "warm-up"), message())  # the topic stream exists
        held.writes.clear()
        held.shut()
        prepared: dict[str, Prepared] = {}

        async def prepare(client: CoordinatorClient, name: str) -> None:
            prepared[name] = await client.prepare(txid(client.partition, name), message())

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(prepare, clients[0], "held")
            await eventually(lambda: len(held.writes) == 1, what="partition 0's write held")
            with anyio.fail_after(10):
                for i in range(3):
                    receipt = await clients[1].prepare(txid(1, f"free-{i}"), message())
                    ended = await clients[1].end(receipt.txid, receipt.token, Decision.COMMIT)
                    assert ended.state == "committed"
            assert "held" not in prepared, "partition 0 still waits for its stream"
            held.gate.set()
        receipt = prepared["held"]
        ended = await clients[0].end(receipt.txid, receipt.token, Decision.COMMIT)
        assert ended.state == "committed"


async def test_stopping_a_partition_leaves_its_pending_half_to_be_written(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers outlive their instance: a half queued when its partition stopped is still
    stored (its dedupe id makes that safe), and the other partition is not held up."""
    held = HalfWrites(monkeypatch, 1)
    async with run_coordinator(private_nc, options=TWO) as coordinator:
        clients = [CoordinatorClient(private_nc, partition=p) for p in (0, 1)]
        for p, client in enumerate(clients):
            await client.prepare(txid(p, "warm-up"), message())
        held.writes.clear()
        held.shut()
        prepared: dict[str, Prepared] = {}
        refused: dict[str, str] = {}

        async def prepare(client: CoordinatorClient, name: str) -> None:
            try:
                prepared[name] = await client.prepare(txid(client.partition, name), message())
            except CommandError as error:
                refused[name] = error.code

        async with anyio.create_task_group() as abandoned:
            abandoned.start_soon(prepare, clients[1], "p1")
            await eventually(lambda: len(held.writes) == 1, what="p1's write held")
            # answered `timeout` once its partition stops while the half is queued
            abandoned.start_soon(prepare, clients[1], "p1-queued")
            await held.queued(1)
            ref = coordinator.owned[1].ref
            assert ref is not None
            await ref.stop()
            receipt = await clients[0].prepare(txid(0, "p0"), message())
            ended = await clients[0].end(receipt.txid, receipt.token, Decision.COMMIT)
            assert ended.state == "committed"
            held.gate.set()
            js = private_nc.jetstream()
            stopped = txid(1, "p1-queued")

            async def stored() -> bool:
                last = await js.get_last_msg(layout.half_stream(1), layout.half_subject(1))
                return read_raw_halves(last)[0].txid == stopped

            await eventually(stored, what="the stopped partition's queued half stored")
            abandoned.cancel_scope.cancel()
    assert "p1-queued" not in prepared
    assert refused == {"p1": ErrorCode.TIMEOUT, "p1-queued": ErrorCode.TIMEOUT}


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


async def test_a_partition_that_stops_answers_the_prepares_it_took_on(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handed over (or its lease lost) while a prepare's halves are being written, the
    instance answers `timeout` (its halves may still land) instead of leaving its caller to
    its own timeout."""
    held = HalfWrites(monkeypatch, 0)
    async with run_coordinator(private_nc, options=TWO) as coordinator:
        client = CoordinatorClient(private_nc, partition=0)
        await client.prepare(txid(0, "warm-up"), message())
        held.writes.clear()
        held.shut()
        answers: list[BaseException] = []

        async def prepare() -> None:
            try:
                await client.prepare(txid(0, "held"), message())
            except CommandError as error:
                answers.append(error)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(prepare)
            await eventually(lambda: len(held.writes) == 1, what="the prepare's write held")
            ref = coordinator.owned[0].ref
            assert ref is not None
            with anyio.fail_after(3):  # well before the client's own timeout
                await ref.stop()
                await eventually(lambda: answers, what="the prepare answered")
            held.gate.set()
    [error] = answers
    assert isinstance(error, CommandError) and error.code == ErrorCode.TIMEOUT
    assert error.retry_after is None, "its halves may land: not 'send it again'"
