"""The handler's view of a delivery, built from a JetStream message with no server."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from txactors.consumer import ConsumedMessage
from txactors.wire.layout import COMMITTED_AT_HEADER, KEYS_HEADER, MSG_ID_HEADER, TXID_HEADER
from txactors.wire.protocol import CONTENT_TYPE_HEADER, Encoding


class Paid(msgspec.Struct):
    order: str
    cents: int


def delivery(subject: str, data: bytes, headers: dict[str, str] | None) -> Msg:
    # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>
    reply = "$JS.ACK.TOPIC_orders.points.3.42.7.1700000000000000000.0"
    return Msg(_client=Client(), subject=subject, reply=reply, data=data, headers=headers)


def test_reads_the_commit_headers() -> None:
    headers = {
        MSG_ID_HEADER: "abc:1",
        TXID_HEADER: "abc",
        KEYS_HEADER: "o-1,user-9",
        COMMITTED_AT_HEADER: "1700000000.25",
        CONTENT_TYPE_HEADER: Encoding.JSON.value,
        "Region": "eu",
    }
    msg = ConsumedMessage.from_nats(
        delivery("topic.orders.paid", b'{"order":"o-1","cents":5}', headers)
    )
    assert (msg.topic, msg.tag, msg.txid, msg.msg_id) == ("orders", "paid", "abc", "abc:1")
    assert msg.keys == ("o-1", "user-9")
    assert (msg.deliveries, msg.reconsume_times, msg.stream_seq) == (3, 2, 42)
    assert msg.committed_at == 1700000000.25
    assert msg.decode(Paid) == Paid("o-1", 5)
    assert msg.properties == {CONTENT_TYPE_HEADER: Encoding.JSON.value, "Region": "eu"}


def test_a_message_from_outside_a_transaction_still_has_a_stable_id() -> None:
    msg = ConsumedMessage.from_nats(
        delivery("topic.orders._", msgspec.msgpack.encode(Paid("o", 1)), None)
    )
    assert msg.msg_id == "TOPIC_orders:42"  # stream and sequence: the same on every redelivery
    assert (msg.tag, msg.txid, msg.keys, msg.committed_at) == (None, None, (), None)
    assert msg.decode(Paid) == Paid("o", 1)


def test_a_body_of_the_wrong_shape_fails_to_decode() -> None:
    msg = ConsumedMessage.from_nats(delivery("topic.orders._", msgspec.msgpack.encode([1]), None))
    with pytest.raises(msgspec.ValidationError):
        msg.decode(Paid)
