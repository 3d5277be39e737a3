"""The header block as NATS frames it, without a server: counted and parsed by one rule."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from txactors.coordinator.boundary import PROPERTY_NAME
from txactors.wire.framing import header_block_bytes, parse_header_block

NAMES = st.from_regex(PROPERTY_NAME, fullmatch=True)
VALUES = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=40).map(
    str.strip
)


def framed(headers: dict[str, str]) -> bytes:
    """The block as nats-py writes it for a publish."""
    lines = b"".join(f"{name}: {value}\r\n".encode() for name, value in headers.items())
    return b"NATS/1.0\r\n" + lines + b"\r\n"


def test_header_block_bytes_counts_what_nats_sends() -> None:
    assert header_block_bytes({}) == len(b"NATS/1.0\r\n\r\n")
    assert header_block_bytes({"A": "café"}) == len(b"NATS/1.0\r\nA: caf\xc3\xa9\r\n\r\n")


def test_a_name_counts_in_bytes_as_its_value_does() -> None:
    """Whatever spells a name, its bytes are counted, as they are sent."""
    assert header_block_bytes({"Né": "é"}) == len(framed({"Né": "é"}))


@given(st.dictionaries(NAMES, VALUES, max_size=8))
def test_a_block_is_counted_as_sent_and_read_back_as_written(headers: dict[str, str]) -> None:
    block = framed(headers)
    assert header_block_bytes(headers) == len(block)
    assert parse_header_block(block) == headers


def test_a_line_without_a_colon_is_skipped() -> None:
    assert parse_header_block(b"NATS/1.0\r\nX\r\nA: b\r\n\r\n") == {"A": "b"}
