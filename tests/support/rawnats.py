"""Speaking the NATS client protocol over a plain socket, as a broken or hostile client would.

nats-py only sends header blocks it built itself; these helpers send any bytes at all.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import anyio

CONNECT = b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'

MALFORMED_BLOCKS = (b"ab", b"NATS/1.0", b"\x00", b"NATS/1.")
"""Header blocks that nats-py 2.16's parser raises on in its read loop (shorter than
`NATS/1.0` plus one byte); nats-server relays them untouched."""


async def raw_hpub(
    url: str, subject: str, reply: str, header_block: bytes, body: bytes = b""
) -> None:
    """HPUB `header_block` + `body` to `subject`, and return once the server has taken it."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    async with await anyio.connect_tcp(parts.hostname, parts.port) as stream:
        received = b""
        with anyio.fail_after(5):
            while b"\r\n" not in received:  # INFO
                received += await stream.receive()
            line = f"HPUB {subject} {reply} {len(header_block)} {len(header_block) + len(body)}"
            await stream.send(
                CONNECT + line.encode() + b"\r\n" + header_block + body + b"\r\nPING\r\n"
            )
            received = b""
            while b"PONG\r\n" not in received:  # the server processed the HPUB before it
                received += await stream.receive()
                assert b"-ERR" not in received, received
