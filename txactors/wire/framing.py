"""How NATS frames a message's headers, and how large JetStream lets the block be.

A header block is `NATS/1.0\\r\\n`, then `Name: Value\\r\\n` per header, then `\\r\\n`, all in
UTF-8. Every writer that must know beforehand whether a message fits (a half at its prepare, a
dead letter, a replayed copy) counts its headers with `header_block_bytes`, and a block read
back raw (`copies.stored_headers`) is parsed with `parse_header_block`: one rule both ways.
The client (`nats/client.py`) sends the block `header_block` builds and reads a delivered one
with `parse_header_lines`: nats-py 2.16's own rules, byte for byte, at less cost.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

JETSTREAM_MAX_HEADER_BYTES: Final = 65_535
"""JetStream refuses a message whose header block is larger ("header size exceeds maximum
allowed of 64k")."""
_STATUS_LINE: Final = b"NATS/1.0\r\n"
_LINE_END: Final = b"\r\n"
_FRAME: Final = len(_STATUS_LINE) + len(_LINE_END)
_SEPARATOR_AND_LINE_END: Final = len(b": ") + len(_LINE_END)

HEADER_NAMES_KEPT: Final = 4096
"""Header names remembered as valid by `header_block` (a bound: names are the user's too)."""
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A name nats-py 2.16 sends (`_HEADER_KEY_RE`); it refuses any other."""
_NEWLINES = str.maketrans({"\r": " ", "\n": " "})
_BYTES_BLANKS: Final = " \t\n\r\x0b\x0c"
"""What `bytes.strip()` strips (`str.strip()` strips more: `\x1c`-`\x1f`, `\x85`, …)."""
_valid_names: dict[str, str] = {}
"""Name as given -> as sent (stripped), for names already found valid."""


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


def header_block(headers: Mapping[str, Any]) -> bytes | None:
    """The header block nats-py 2.16 sends for `headers`, byte for byte, or None if a name is
    empty or invalid once stripped (nats-py skips or refuses it). Valid names are remembered;
    a value is translated only if it holds a line break."""
    lines = []
    for key, value in headers.items():
        name = _valid_names.get(key)
        if name is None:
            name = key.strip()
            if not name or not _HEADER_NAME.fullmatch(name):
                return None
            if len(_valid_names) < HEADER_NAMES_KEPT:
                _valid_names[key] = name
        text = value.strip()
        if "\r" in text or "\n" in text:
            text = text.translate(_NEWLINES)
        lines.append(f"{name}: {text}\r\n")
    return _STATUS_LINE + "".join(lines).encode() + _LINE_END


def parse_header_lines(raw: bytes) -> dict[str, str]:
    """The headers of a delivered message's block as nats-py 2.16's
    `Client._parse_header_lines` reads them, result for result, at a third of its cost (it
    tests a name for whitespace one character at a time in a generator, which made header
    parsing the largest part of what a consumer spends per message). An ASCII block (the
    usual one) is decoded once, not twice per line."""
    out: dict[str, str] = {}
    if raw.isascii():
        for text in raw.decode("ascii").split("\r\n"):
            head, colon, tail = text.partition(":")
            if not colon:
                continue
            field = head.strip(_BYTES_BLANKS)
            if field and field.split() != [field]:
                continue
            out[field] = tail.strip(_BYTES_BLANKS)
        return out
    for line in raw.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if not sep:  # an empty line has none either
            continue
        try:
            key = name.strip().decode("ascii")
        except UnicodeDecodeError:
            continue
        # Whitespace inside the name (any `str.isspace` character): split() is one C pass.
        if key and key.split() != [key]:
            continue
        out[key] = value.strip().decode("utf-8", "replace")
    return out
