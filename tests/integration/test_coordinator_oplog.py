"""`OpLog` group commit: records nobody waits for share the next decision's write."""

from __future__ import annotations

import anyio
import anyio.lowlevel
from nats.aio.client import Client

from tests.support.wait import eventually
from txactors.coordinator.core.records import OpKind, OpRecord
from txactors.coordinator.partition.oplog import OpLog
from txactors.coordinator.partition.store import decode_ops, ensure_streams
from txactors.wire import layout


async def test_a_done_record_waits_to_share_the_next_decisions_write(private_nc: Client) -> None:
    js = private_nc.jetstream()
    await ensure_streams(js, half_retention=60.0)
    reported: list[tuple[list[int], int]] = []

    async def report(op_ids: list[int], seq: int) -> None:
        reported.append((op_ids, seq))

    oplog = OpLog(private_nc, js, 0, 0, report)
    async with anyio.create_task_group() as tg:
        tg.start_soon(oplog.run)
        oplog.append(1, (OpRecord(txid="a", kind=OpKind.DONE),))
        for _ in range(10):  # the writer's turns: a done alone is not written yet
            await anyio.lowlevel.checkpoint()
        oplog.append(2, (OpRecord(txid="b", kind=OpKind.COMMIT, half_seqs=(1,)),))
        await eventually(lambda: reported, what="the first write reported")
        oplog.append(3, (OpRecord(txid="b", kind=OpKind.DONE),))  # alone: written soon anyway
        await eventually(lambda: len(reported) >= 2, what="the second write reported")
        tg.cancel_scope.cancel()
    assert reported == [([1, 2], 1), ([3], 2)]
    first = await js.get_msg(layout.OP_STREAM, 1)
    assert [(r.txid, r.kind) for r in decode_ops(first.data or b"")] == [
        ("a", OpKind.DONE),
        ("b", OpKind.COMMIT),
    ]
