"""`OpWriter` group commit: records nobody waits for share the next decision's write."""

from __future__ import annotations

import itertools

import anyio
import anyio.lowlevel
from nats.aio.client import Client
from nats.js.api import Header

from tests.support.logstreams import ensure_log_streams
from tests.support.wait import eventually
from txactors.coordinator.core.records import OpKind, OpRecord
from txactors.coordinator.partition.checkpoints import decode_ops
from txactors.coordinator.partition.oplog import FencedOut, OpLog, OpWriter
from txactors.wire import layout


async def test_a_done_record_waits_to_share_the_next_decisions_write(private_nc: Client) -> None:
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=60.0)
    reported: list[tuple[list[int], int]] = []

    async def report(op_ids: list[int], seq: int) -> None:
        reported.append((op_ids, seq))

    writer = OpWriter(private_nc, js)
    oplog = writer.open(0, 0, report, failed=lambda error: None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        oplog.append(1, (OpRecord(txid="a", kind=OpKind.DONE),))
        for _ in range(10):  # the writer's turns: a done alone is not written yet
            await anyio.lowlevel.checkpoint()
        oplog.append(2, (OpRecord(txid="b", kind=OpKind.COMMIT, half_seqs=(1,)),))
        await eventually(lambda: reported, what="the first write reported")
        oplog.append(3, (OpRecord(txid="b", kind=OpKind.DONE),))  # alone: written soon anyway
        await eventually(lambda: len(reported) >= 2, what="the second write reported")
        tg.cancel_scope.cancel()
    assert reported == [([1, 2], 1), ([3], 2)]
    first = await js.get_msg(layout.op_stream(0), 1)
    assert [(r.txid, r.kind) for r in decode_ops(first.data or b"")] == [
        ("a", OpKind.DONE),
        ("b", OpKind.COMMIT),
    ]


class Logs:
    """What an `OpWriter` reports and fails, by partition."""

    def __init__(self) -> None:
        self.reported: dict[int, list[tuple[list[int], int]]] = {}
        self.failed: dict[int, list[Exception]] = {}

    def open(self, writer: OpWriter, partition: int, last_seq: int = 0) -> OpLog:
        async def report(op_ids: list[int], seq: int) -> None:
            self.reported.setdefault(partition, []).append((op_ids, seq))

        failed = self.failed.setdefault(partition, []).append
        return writer.open(partition, last_seq, report, failed)


def commit(txid: str) -> tuple[OpRecord, ...]:
    return (OpRecord(txid=txid, kind=OpKind.COMMIT, half_seqs=(1,)),)


async def test_two_partitions_decisions_go_each_alone_to_its_own_stream_and_fenced(
    private_nc: Client,
) -> None:
    """A small write is no atomic batch: nats-server acks one of those milliseconds later
    than the same messages sent alone (`ATOMIC_MIN_MESSAGES`), and a lone commit would wait.
    Each partition's records are on its own stream."""
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=60.0)
    writer, logs = OpWriter(private_nc, js), Logs()
    p0, p1 = logs.open(writer, 0), logs.open(writer, 1)
    p0.append(1, commit("a"))  # queued before the writer's first turn: one write for both
    p1.append(1, commit("b"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        await eventually(lambda: len(logs.reported) == 2, what="both partitions reported")
        tg.cancel_scope.cancel()
    assert logs.reported == {0: [([1], 1)], 1: [([1], 1)]}
    for partition in (0, 1):
        stored = await js.get_msg(layout.op_stream(partition), 1)
        assert stored.headers is not None
        assert Header.BATCH_ID not in stored.headers, "each alone"
        assert stored.headers[layout.EXPECTED_LAST_SUBJECT_SEQ_HEADER] == "0"


async def test_another_partitions_decision_leaves_a_done_waiting_for_its_own(
    private_nc: Client,
) -> None:
    """A done is not taken along by another partition's decision (its flush would hold that
    decision's ack back): it still waits for a decision of its own partition to share."""
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=60.0)
    writer, logs = OpWriter(private_nc, js), Logs()
    p0 = logs.open(writer, 0)

    async def reported(op_ids: list[int], seq: int) -> None:
        logs.reported.setdefault(1, []).append((op_ids, seq))
        p0.append(2, commit("c"))  # p0's own decision, while its done waits

    p0.append(1, (OpRecord(txid="a", kind=OpKind.DONE),))
    writer.open(1, 0, reported, failed=lambda error: None).append(1, commit("b"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        await eventually(lambda: len(logs.reported) == 2, what="both partitions reported")
        tg.cancel_scope.cancel()
    assert logs.reported == {1: [([1], 1)], 0: [([1, 2], 1)]}, "the done shared p0's decision"


async def test_a_done_left_behind_is_written_while_other_decisions_keep_coming(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=60.0)
    writer, logs = OpWriter(private_nc, js), Logs()
    p0 = logs.open(writer, 0)
    decisions = itertools.count(2)

    async def reported(op_ids: list[int], seq: int) -> None:
        if 0 not in logs.reported:  # p1 decides on and on, p0 never does
            p1.append(next(decisions), commit(f"b{seq}"))

    p0.append(1, (OpRecord(txid="a", kind=OpKind.DONE),))
    p1 = writer.open(1, 0, reported, failed=lambda error: None)
    p1.append(1, commit("b"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        await eventually(lambda: 0 in logs.reported, what="p0's done written")
        tg.cancel_scope.cancel()
    [(op_ids, _)] = logs.reported[0]
    assert op_ids == [1]


async def test_a_group_commit_of_several_messages_goes_as_one_atomic_batch_fenced_once(
    private_nc: Client,
) -> None:
    """Records beyond `OP_BATCH_BYTES` make several messages: stored all or nothing, next to
    each other, the first one fenced (nothing can come between them)."""
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=60.0)
    writer, logs = OpWriter(private_nc, js), Logs()
    records = tuple(
        OpRecord(txid=f"t{i:06d}", kind=OpKind.COMMIT, half_seqs=(i,)) for i in range(15_000)
    )
    logs.open(writer, 0).append(1, records)
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        await eventually(lambda: 0 in logs.reported, what="the group commit reported")
        tg.cancel_scope.cancel()
    [(op_ids, last)] = logs.reported[0]
    assert op_ids == [1] and last >= 2, "several messages"
    stored = [await js.get_msg(layout.op_stream(0), seq) for seq in range(1, last + 1)]
    assert [r.txid for m in stored for r in decode_ops(m.data or b"")] == [r.txid for r in records]
    batches = {(m.headers or {}).get(Header.BATCH_ID) for m in stored}
    assert len(batches) == 1 and None not in batches, "one atomic batch"
    fences = [(m.headers or {}).get(layout.EXPECTED_LAST_SUBJECT_SEQ_HEADER) for m in stored]
    assert fences == ["0"] + [None] * (last - 1)


async def test_a_partition_fenced_out_fails_alone_and_the_others_records_are_stored(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    await ensure_log_streams(js, half_retention=60.0)
    writer, logs = OpWriter(private_nc, js), Logs()
    p0, p1 = logs.open(writer, 0), logs.open(writer, 1)
    await js.publish(layout.op_subject(1), b"a successor's record")  # p1's fence is now stale
    p0.append(1, commit("a"))
    p1.append(1, commit("b"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        await eventually(lambda: logs.reported and logs.failed[1], what="p0 stored, p1 fenced")
        p1.append(2, commit("c"))  # a fenced partition writes nothing more
        p0.append(2, commit("d"))
        await eventually(lambda: len(logs.reported[0]) == 2, what="p0's second write")
        tg.cancel_scope.cancel()
    assert logs.reported == {0: [([1], 1), ([2], 2)]}
    assert [type(error) for error in logs.failed[1]] == [FencedOut]
    assert logs.failed[0] == []
    last = await js.get_last_msg(layout.op_stream(1), layout.op_subject(1))
    assert last.seq == 1, "nothing of the fenced partition's was stored"
