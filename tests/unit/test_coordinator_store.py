"""What the coordinator stores per transaction: only what a reader needs, read back whole, and
records an earlier 0.x wrote (longer headers) read the same."""

from __future__ import annotations

import hashlib

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from txactors.coordinator.boundary import half_header_bytes
from txactors.coordinator.core import tokens
from txactors.coordinator.core.records import DiscardReason, OpKind, OpRecord
from txactors.coordinator.partition.checkpoints import decode_ops, encode_ops
from txactors.coordinator.partition.halves import (
    StoredHalf,
    half_headers,
    read_half,
    seconds_text,
    stored_half,
)
from txactors.wire import layout
from txactors.wire.framing import header_block_bytes
from txactors.wire.protocol import PROTOCOL_VERSION, OutgoingMessage, Prepare

TOKEN = tokens.new_tokens(1)[0]
MESSAGE = OutgoingMessage(
    topic="orders",
    body=b"body",
    keys=["k1", "k2"],
    tag="eu",
    properties={"Region": "eu", "traceparent": "00-ab-cd-01"},
    check_immunity=2.5,
)


def half(*, begins: bool = True, index: int = 3, born: float = 1_795_636_350.585356) -> StoredHalf:
    return stored_half(
        txid="tx-1",
        token_digest=tokens.digest(TOKEN),
        group="shop",
        producer="p-1",
        begins=begins,
        index=index,
        born=born,
        message=MESSAGE,
        seq=7,
    )


def test_a_half_stores_its_txid_and_index_once_and_reads_back_whole() -> None:
    for begins in (True, False):
        stored = half(begins=begins)
        headers = half_headers(stored)
        assert headers[layout.MSG_ID_HEADER] == "tx-1:3:half"
        assert not {layout.TXID_HEADER, layout.INDEX_HEADER} & headers.keys()
        assert (layout.BEGINS_HEADER in headers) is begins
        assert len(headers[layout.TOKEN_HEADER]) == 22
        assert headers[layout.BORN_HEADER] == "1795636350.585"
        back = read_half(7, headers, b"body")
        assert back == half(begins=begins, born=1795636350.585)


def test_a_half_written_before_the_header_diet_reads_as_the_same_half() -> None:
    old = {
        "Region": "eu",
        "traceparent": "00-ab-cd-01",
        layout.MSG_ID_HEADER: "tx-1:3:half",
        layout.TXID_HEADER: "tx-1",
        layout.TOKEN_HEADER: "sha256:" + hashlib.sha256(TOKEN.encode()).hexdigest(),
        layout.GROUP_HEADER: "shop",
        layout.PRODUCER_HEADER: "p-1",
        layout.BEGINS_HEADER: "0",
        layout.INDEX_HEADER: "3",
        layout.TOPIC_HEADER: "orders",
        layout.BORN_HEADER: "1795636350.585",
        layout.TAG_HEADER: "eu",
        layout.KEYS_HEADER: "k1,k2",
        layout.IMMUNITY_HEADER: "2.5",
    }
    assert read_half(7, old, b"body") == half(begins=False, born=1795636350.585)


def test_an_op_record_leaves_out_its_defaults_and_old_full_records_read_the_same() -> None:
    done = OpRecord(txid="tx-1", kind=OpKind.DONE)
    assert msgspec.msgpack.decode(encode_ops([done])) == [{"txid": "tx-1", "kind": "done"}]
    records = [
        OpRecord(txid="tx-1", kind=OpKind.COMMIT, half_seqs=(4, 5)),
        done,
        OpRecord(txid="tx-2", kind=OpKind.DISCARD, check_times=15, reason=DiscardReason.CHECK_MAX),
        OpRecord(txid="tx-3", kind=OpKind.RESUME, by_operator=True),
    ]
    assert decode_ops(encode_ops(records)) == records
    old = msgspec.msgpack.encode([msgspec.structs.asdict(r) for r in records])  # every field
    assert len(old) > len(encode_ops(records))
    assert decode_ops(old) == records


_NAMES = st.text("abcXYZ019_-", min_size=1, max_size=20)
_TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=20)
MESSAGES = st.builds(
    OutgoingMessage,
    topic=_NAMES,
    body=st.just(b"body"),
    keys=st.lists(_TEXT.filter(lambda k: k and "," not in k), max_size=3),
    tag=st.none() | _NAMES,
    properties=st.dictionaries(st.text("abcXYZ-_.", min_size=1, max_size=10), _TEXT, max_size=3),
    check_immunity=st.none() | st.floats(0, 3600),
)


@given(
    index=st.integers(0, 2**63 - 1),
    born=st.floats(allow_nan=False, allow_infinity=False),
    begins=st.booleans(),
    token=st.text("0123456789abcdef", min_size=32, max_size=32),
    txid=_NAMES,
    message=MESSAGES,
)
def test_the_boundary_counts_a_half_header_block_at_its_longest(
    index: int, born: float, begins: bool, token: str, txid: str, message: OutgoingMessage
) -> None:
    """The boundary counts a half's headers from their lengths: exactly the block of the
    half at its longest, and never less than any half of that message."""
    prepare = Prepare(
        txid=txid, group="shop", producer="p-1", messages=[message], version=PROTOCOL_VERSION
    )
    written = stored_half(
        txid=txid,
        token_digest=tokens.digest(token),
        group="shop",
        producer="p-1",
        begins=begins,
        index=index,
        born=born,
        message=message,
    )
    assert header_block_bytes(half_headers(written)) <= half_header_bytes(prepare, message)
    worst = msgspec.structs.replace(
        written,
        begins=True,
        half=msgspec.structs.replace(written.half, index=2**63 - 1, born=-1.7976931348623157e308),
    )
    assert header_block_bytes(half_headers(worst)) == half_header_bytes(prepare, message)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_a_time_in_a_header_is_never_later_than_it_was(seconds: float) -> None:
    """A half's birth read back later than it was would put its first check-back past the
    transaction timeout (a test advancing a manual clock by exactly the timeout saw none)."""
    written = float(seconds_text(seconds))
    assert written <= seconds
    assert seconds - written < 0.0011


def _seconds_text_by_round(seconds: float) -> str:
    """`seconds_text` as it was first written: what its shortcut must give, text for text."""
    rounded = round(seconds, 3)
    if rounded > seconds:
        rounded = round(rounded - 0.001, 3)
    return repr(rounded)


@settings(max_examples=5000)
@given(
    st.floats(min_value=0.5, max_value=2e12)
    | st.floats(allow_nan=False)
    | st.integers(1, 10**12).map(lambda ms: ms / 1000)
    | st.integers(1, 10**12).map(lambda ms: ms / 1000 - 0.0005)
)
def test_a_time_is_written_as_rounding_writes_it(seconds: float) -> None:
    assert seconds_text(seconds) == _seconds_text_by_round(seconds)
