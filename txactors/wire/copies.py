"""What a copy of a stored record carries: the producer's headers and ours, nothing of the server's.

JetStream stores a message with the headers it was published with, and some of those are
instructions to the server rather than data: a message written as part of an atomic batch keeps
`Nats-Batch-Id`, `Nats-Batch-Sequence` and `Nats-Batch-Commit`; a publisher's `Nats-Msg-Id`,
`Nats-Expected-*`, `Nats-Rollup` or `Nats-TTL` are kept too; a direct get, a republish or a
sourced stream adds `Nats-Stream`, `Nats-Sequence`, `Nats-Subject`, `Nats-Time-Stamp`, ….
Published again, each makes the server act again, on the copy: a batch header on a stream
without atomic publish is refused for good (10174), an expected sequence fails, a rollup purges,
the source's id makes the copy a duplicate of something else.

So every path that writes a stored record somewhere else (a discarded half, a quarantined
record, a dead letter, a replay) starts from `copied_headers`, and sets its own `Nats-Msg-Id`
where a second copy must be dropped; a consumer's handler sees the same selection. None of our
own `Nats-*` headers is copied either: each write sets the ones it means.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from functools import lru_cache

from nats.js.api import RawStreamMsg

from txactors.wire.framing import parse_header_block
from txactors.wire.layout import RESERVED_HEADER_NAMES

SERVER_PREFIX = "nats-"
"""Lower-cased: the namespace of headers the NATS server (JetStream) reads or sets."""


@lru_cache(maxsize=1024)
def is_server_header(name: str) -> bool:
    """A header the server acts on or NATS clients read as control (`Status`, `Description`,
    `KV-Operation`), however it is spelled (any case, surrounding blanks).

    Cached: a consumer asks this of every header of every message, and names repeat."""
    folded = name.strip().lower()
    return folded.startswith(SERVER_PREFIX) or folded in RESERVED_HEADER_NAMES


def copied_headers(headers: Mapping[str, object]) -> dict[str, str]:
    """The headers a copy of a record keeps: every one but the server's (`is_server_header`)."""
    return {str(k): str(v) for k, v in headers.items() if not is_server_header(str(k))}


def stored_headers(raw: RawStreamMsg) -> dict[str, str]:
    """The headers of a message read with `get_msg`, every value a `str`, as stored.

    nats-py parses the headers of a (non-direct) `get_msg` as an email, which turns a
    non-ASCII value (`café`) into an `email.header.Header`; we parse the raw block instead,
    as NATS defines it (`framing.parse_header_block`).
    """
    if not raw.hdrs:
        return {str(k): str(v) for k, v in (raw.headers or {}).items()}
    return parse_header_block(base64.b64decode(raw.hdrs))
