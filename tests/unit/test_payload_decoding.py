"""A user's payload is read by one rule wherever it is read (`wire.protocol.decode_payload`):
JSON when its producer marked it `Content-Type: application/json`, msgpack otherwise. The
consumer, the check-back's `MessageView` and the Spark sink agree."""

from __future__ import annotations

import msgspec
import pytest

from txactors.producer.checks import MessageView
from txactors.wire.layout import CONTENT_TYPE_HEADER
from txactors.wire.protocol import Encoding, decode_payload


class Order(msgspec.Struct):
    order_id: str
    quantity: int


ORDER = Order("o-1", 3)
JSON = {CONTENT_TYPE_HEADER: Encoding.JSON.value}


@pytest.mark.parametrize(
    ("body", "headers"),
    [(msgspec.msgpack.encode(ORDER), {}), (msgspec.json.encode(ORDER), JSON)],
    ids=["msgpack", "json"],
)
def test_a_check_back_reads_a_half_as_a_consumer_reads_it(
    body: bytes, headers: dict[str, str]
) -> None:
    view = MessageView(0, "orders", body, (), None, headers)
    assert view.decode(Order) == decode_payload(body, headers, Order) == ORDER


def test_the_spark_sink_reads_a_json_payload_into_its_columns() -> None:
    pytest.importorskip("pyspark")
    from spark_sinks.schema import BatchBuilder, Committed

    messages = [
        Committed(1, 0, {}, msgspec.msgpack.encode(ORDER)),
        Committed(2, 0, JSON, msgspec.json.encode(Order("o-2", 5))),
    ]
    rows = BatchBuilder("orders", Order).build(messages).to_pylist()
    assert [(row["order_id"], row["quantity"], row["_error"]) for row in rows] == [
        ("o-1", 3, None),
        ("o-2", 5, None),
    ]
