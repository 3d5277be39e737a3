"""The handler's view of a delivery, built from a JetStream message with no server."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from txactors.consumer import ConsumedMessage
from txactors.consumer.message import delivered, handler_headers
from txactors.wire.copies import copied_headers
from txactors.wire.layout import (
    COMMITTED_AT_HEADER,
    CONTENT_TYPE_HEADER,
    KEYS_HEADER,
    MSG_ID_HEADER,
    TXID_HEADER,
)
from txactors.wire.protocol import Encoding


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


def test_the_lag_and_every_field_come_from_either_form_of_the_ack_subject() -> None:
    v1 = delivery("topic.orders._", b"", {MSG_ID_HEADER: "abc:1"})
    # v2: $JS.ACK.<domain>.<account hash>.<stream>.<consumer>.<delivered>.<stream seq>.
    # <consumer seq>.<ns>.<pending>.<random>: read by nats-py's parser.
    v2 = Msg(
        _client=Client(),
        subject=v1.subject,
        reply="$JS.ACK.hub.ACC.TOPIC_orders.points.3.42.7.1700000000000000000.0.x1",
        data=v1.data,
        headers=v1.headers,
    )
    assert delivered(v1) == delivered(v2)
    first, first_lag = delivered(v1)
    assert (first.deliveries, first.stream_seq, first_lag) == (3, 42, 0)
    lagging = Msg(_client=Client(), subject=v1.subject, reply=v1.reply[:-1] + "17")
    assert delivered(lagging)[1] == 17


def test_a_delivery_that_is_not_from_jetstream_is_refused() -> None:
    with pytest.raises(NotJSMessageError):
        delivered(Msg(_client=Client(), subject="topic.orders._", reply="_INBOX.x"))


NAMES = st.sampled_from(
    ["Nats-Msg-Id", "nats-batch-id", " NATS-TTL", "Txn-Id", "Status", "Description", "K", "x"]
)


@given(st.lists(st.dictionaries(NAMES | st.text(max_size=6), st.text(max_size=4)), max_size=4))
def test_the_handler_sees_the_headers_a_copy_keeps(deliveries: list[dict[str, str]]) -> None:
    # Several deliveries in a row: the second of a set of names reads what the first found.
    for stored in deliveries:
        headers = handler_headers(stored)
        assert headers == copied_headers(stored)
        assert list(headers) == list(copied_headers(stored))
        assert headers is not stored
