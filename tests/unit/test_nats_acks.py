"""`ack_fields` reads what nats-py's `Msg.metadata` reads, in either ack subject form."""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from txactors.nats.acks import ack_fields


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.TXN_HALF.late.1.42.7.1700000000000000000.3",
        "$JS.ACK.hub.ACC.TXN_OP.points.2.9001.11.1700000000000000000.0.x1",
    ],
)
def test_ack_fields_agree_with_nats_py(reply: str) -> None:
    msg = Msg(_client=Client(), subject="txn.half.0", reply=reply)
    meta = Msg(_client=Client(), subject="txn.half.0", reply=reply).metadata

    fields = ack_fields(msg)

    assert fields == (
        meta.stream,
        meta.sequence.stream,
        meta.num_delivered,
        meta.num_pending,
    )
    assert fields.seq == meta.sequence.stream and fields.pending == meta.num_pending
