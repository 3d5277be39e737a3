"""How NATS frames a message's headers, and how large JetStream lets the block be.

A header block is `NATS/1.0\\r\\n`, then `Name: Value\\r\\n` per header, then `\\r\\n`, all in
UTF-8. Every writer that must know beforehand whether a message fits (a half at its prepare, a
dead letter, a replayed copy) counts its headers with `header_block_bytes`, and a block read
back raw (`copies.stored_headers`) is parsed with `parse_header_block`: one rule both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

JETSTREAM_MAX_HEADER_BYTES: Final = 65_535
"""JetStream refuses a message whose header block is larger ("header size exceeds maximum
allowed of 64k")."""
_STATUS_LINE: Final = b"NATS/1.0\r\n"
_LINE_END: Final = b"\r\n"
_FRAME: Final = len(_STATUS_LINE) + len(_LINE_END)
_SEPARATOR_AND_LINE_END: Final = len(b": ") + len(_LINE_END)


def header_block_bytes(headers: Mapping[str, str]) -> int:
    """The bytes of the header block NATS sends for `headers` (counted in C, one join and
    one encoding each for the names and the values, rather than one per header: the boundary
    counts every prepared half's)."""
    names = len("".join(headers.keys()).encode())
    values = len("".join(headers.values()).encode())
    return _FRAME + names + values + _SEPARATOR_AND_LINE_END * len(headers)


def parse_header_block(block: bytes) -> dict[str, str]:
    """The headers of a raw block, as NATS defines it: the status line, then `Name: Value`
    lines (blanks around either trimmed), UTF-8 values; a line without a colon is skipped."""
    headers: dict[str, str] = {}
    for line in block.split(_LINE_END)[1:]:  # the first line is the status, `NATS/1.0`
        name, colon, value = line.partition(b":")
        if colon:
            headers[name.strip().decode("ascii", "replace")] = value.strip().decode(
                "utf-8", "replace"
            )
    return headers
