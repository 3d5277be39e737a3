"""The form of a dead letter, without a server: the fullest entry that fits, every time."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from txactors.consumer.dlq import dead_letter_entry
from txactors.consumer.message import ConsumedMessage
from txactors.wire.framing import JETSTREAM_MAX_HEADER_BYTES, header_block_bytes
from txactors.wire.layout import (
    DLQ_OMITTED_HEADER,
    ERROR_HEADER,
    MSG_ID_HEADER,
    ORIGIN_SEQ_HEADER,
    ORIGIN_STREAM_HEADER,
)

MiB = 1024 * 1024


def consumed(body: bytes, headers: dict[str, str], msg_id: str = "tx1:0") -> ConsumedMessage:
    return ConsumedMessage(
        topic="orders",
        tag=None,
        keys=(),
        txid="tx1",
        msg_id=msg_id,
        body=body,
        headers={MSG_ID_HEADER: msg_id, **headers},
        deliveries=17,
        stream_seq=42,
        committed_at=None,
        subject="topic.orders._",
    )


def test_a_small_message_is_copied_whole() -> None:
    entry = dead_letter_entry(consumed(b"body", {"Region": "eu"}), ValueError("no"), MiB)
    assert entry.omitted == ()
    assert entry.body == b"body"
    assert entry.headers["Region"] == "eu"
    assert (entry.headers[ORIGIN_STREAM_HEADER], entry.headers[ORIGIN_SEQ_HEADER]) == (
        "TOPIC_orders",
        "42",
    )
    assert DLQ_OMITTED_HEADER not in entry.headers


def test_no_jetstream_control_header_of_the_original_reaches_the_copy() -> None:
    """Anyone may publish to a topic subject: a copied `Nats-Expected-*` or `Nats-Rollup` would
    make the DLQ refuse the copy for good, or purge it."""
    hostile = {
        "Nats-Expected-Last-Sequence": "0",
        " nats-rollup": "sub",
        "NATS-TTL": "1s",
        "Nats-Expected-Stream": "ELSEWHERE",
        "Region": "eu",
    }
    entry = dead_letter_entry(consumed(b"body", hostile, msg_id="tx9:0"), ValueError("no"), MiB)
    control = [k for k in entry.headers if k.strip().lower().startswith("nats-")]
    assert control == [MSG_ID_HEADER]
    assert entry.headers[MSG_ID_HEADER] == "tx9:0"
    assert entry.headers["Region"] == "eu"


def test_a_body_near_max_payload_goes_by_reference() -> None:
    message = consumed(b"x" * (MiB - 200), {"Region": "eu"})
    entry = dead_letter_entry(message, ValueError("y" * 500), MiB)
    assert (entry.body, entry.omitted) == (b"", ("body",))
    assert entry.headers[DLQ_OMITTED_HEADER] == "body"
    assert (entry.headers["Region"], entry.headers[MSG_ID_HEADER]) == ("eu", "tx1:0")


def test_headers_near_the_jetstream_limit_are_left_out_too() -> None:
    message = consumed(b"x", {"Big": "h" * (JETSTREAM_MAX_HEADER_BYTES - 300)})
    entry = dead_letter_entry(message, ValueError("y" * 1000), MiB)
    assert entry.omitted == ("body", "headers")
    assert "Big" not in entry.headers
    assert entry.headers[MSG_ID_HEADER] == "tx1:0"
    assert entry.headers[ERROR_HEADER] == "ValueError: " + "y" * 1000


@given(
    body=st.integers(0, 70_000),
    header=st.integers(0, 70_000),
    error=st.integers(0, 2000),
    max_payload=st.integers(8_000, 80_000),
)
def test_the_entry_is_the_fullest_form_that_fits(
    body: int, header: int, error: int, max_payload: int
) -> None:
    message = consumed(b"b" * body, {"P": "p" * header})
    entry = dead_letter_entry(message, RuntimeError("e" * error), max_payload)
    block = header_block_bytes(entry.headers)
    assert block <= JETSTREAM_MAX_HEADER_BYTES
    assert block + len(entry.body) <= max_payload
    assert entry.headers[ERROR_HEADER].startswith("RuntimeError:")
    assert entry.headers[ORIGIN_SEQ_HEADER] == "42"
    # Each part left out is left out only because the fuller form would not have fit.
    limit = min(max_payload, JETSTREAM_MAX_HEADER_BYTES)
    copied = {**message.headers, **entry.headers}
    copied.pop(DLQ_OMITTED_HEADER, None)
    if entry.omitted:
        assert entry.body == b""
        full = header_block_bytes(copied)
        assert full > JETSTREAM_MAX_HEADER_BYTES or full + body > max_payload
    else:
        assert entry.body == message.body
    if "headers" in entry.omitted:
        assert header_block_bytes({**copied, DLQ_OMITTED_HEADER: "body"}) > limit
    else:
        assert entry.headers["P"] == "p" * header
