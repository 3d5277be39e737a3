"""The halves a partition stores at one moment go as one TXN_HALF message, a pack: read back
whole and in order, split only where a pack would outgrow `max_payload`, and halves stored
alone (before packs) still read the same."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txactors.coordinator.core import tokens
from txactors.coordinator.partition.halves import (
    StoredHalf,
    half_headers,
    half_in,
    read_half,
    stored_half,
)
from txactors.coordinator.partition.packs import is_pack, pack_appends, read_halves
from txactors.wire import layout
from txactors.wire.protocol import OutgoingMessage

names = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
seconds = st.floats(min_value=0, max_value=1e12, allow_nan=False)


@st.composite
def halves(draw: st.DrawFn) -> StoredHalf:
    message = OutgoingMessage(
        topic=draw(names),
        body=draw(st.binary(max_size=600)),
        keys=draw(st.lists(names, max_size=3)),
        tag=draw(st.none() | names),
        properties=draw(st.dictionaries(names, texts, max_size=3)),
        check_immunity=draw(st.none() | seconds),
    )
    return stored_half(
        txid=draw(names),
        token_digest=tokens.digest(tokens.new_tokens(1)[0]),
        group=draw(names),
        producer=draw(names),
        begins=draw(st.booleans()),
        index=draw(st.integers(min_value=0, max_value=2**63 - 1)),
        born=draw(seconds),
        message=message,
    )


def at(seq: int, half: StoredHalf) -> StoredHalf:
    return msgspec.structs.replace(half, half=msgspec.structs.replace(half.half, seq=seq))


@settings(max_examples=200, deadline=None)
@given(st.lists(halves(), min_size=1, max_size=20), st.integers(min_value=1, max_value=2**40))
def test_a_pack_reads_back_as_the_halves_written_at_its_sequence(
    written: list[StoredHalf], seq: int
) -> None:
    [(append, count)] = pack_appends(3, written, 1 << 20)
    assert count == len(written)
    assert append.subject == layout.half_subject(3) and append.stream == layout.half_stream(3)
    assert is_pack(append.headers)
    assert append.headers[layout.MSG_ID_HEADER].endswith(":pack")
    assert read_halves(seq, append.headers, append.payload) == [at(seq, h) for h in written]


@settings(max_examples=200, deadline=None)
@given(st.lists(halves(), min_size=1, max_size=30), st.integers(min_value=1, max_value=8000))
def test_packs_split_under_max_bytes_keep_order_and_count(
    written: list[StoredHalf], max_bytes: int
) -> None:
    packs = pack_appends(0, written, max_bytes)
    assert sum(count for _, count in packs) == len(written)
    read: list[StoredHalf] = []
    for seq, (append, count) in enumerate(packs, 1):
        back = read_halves(seq, append.headers, append.payload)
        assert len(back) == count
        if count > 1:
            assert len(append.payload) <= max_bytes
        read.extend(back)
    seqs = [seq for seq, (_, count) in enumerate(packs, 1) for _ in range(count)]
    assert read == [at(seq, h) for seq, h in zip(seqs, written, strict=True)]
    ids = {append.headers[layout.MSG_ID_HEADER] for append, _ in packs}
    assert len(ids) == len(packs), "each pack its own Nats-Msg-Id"


def test_a_half_too_large_for_any_pack_goes_alone() -> None:
    small = [half("a", b"x"), half("b", b"y")]
    large = half("big", b"z" * 5000)
    packs = pack_appends(0, [*small, large, *small], 1000)
    assert [count for _, count in packs] == [2, 1, 2]
    assert [h.txid for h in read_halves(9, packs[1][0].headers, packs[1][0].payload)] == ["big"]


def test_a_half_stored_alone_reads_as_before() -> None:
    alone = half("old", b"body")
    headers = half_headers(alone)
    assert not is_pack(headers)
    assert read_halves(5, headers, b"body") == [read_half(5, headers, b"body")]


def test_a_pack_of_another_version_or_garbage_is_unreadable() -> None:
    [(append, _)] = pack_appends(0, [half("a", b"x")], 1000)
    newer = {**append.headers, layout.PACK_HEADER: "2"}
    with pytest.raises(ValueError):
        read_halves(1, newer, append.payload)
    with pytest.raises(msgspec.DecodeError):
        read_halves(1, append.headers, b"\x93not a pack")


def test_half_in_finds_a_half_of_its_pack_by_txid_and_index() -> None:
    [(append, _)] = pack_appends(0, [half("a", b"x"), half("b", b"y")], 1000)
    read = read_halves(4, append.headers, append.payload)
    assert half_in(read, "b", 0).message.body == b"y"
    with pytest.raises(KeyError):
        half_in(read, "b", 1)


def half(txid: str, body: bytes) -> StoredHalf:
    return stored_half(
        txid=txid,
        token_digest=tokens.digest(tokens.new_tokens(1)[0]),
        group="g",
        producer="p",
        begins=True,
        index=0,
        born=1_795_636_350.585,
        message=OutgoingMessage(topic="orders", body=body),
    )
