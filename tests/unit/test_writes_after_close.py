"""A write on a connection already closed is dropped on any event loop (uvloop raises there,
asyncio drops it, and nats-py counts on the drop): txactors/nats/client.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from txactors.nats.client import TolerantClient, WritesAfterClose


class FakeTransport:
    """A nats-py TCP transport over a stream writer whose socket may be closing."""

    def __init__(self) -> None:
        self.closing = False
        self.written: list[bytes] = []
        self._io_writer = SimpleNamespace(
            transport=SimpleNamespace(is_closing=lambda: self.closing)
        )

    def write(self, payload: bytes) -> None:
        if self.closing:
            raise RuntimeError("unable to perform operation: the handler is closed")
        self.written.append(payload)

    def writelines(self, payload: list[bytes]) -> None:
        for chunk in payload:
            self.write(chunk)

    async def read(self, size: int) -> bytes:
        return b""

    async def drain(self) -> None:
        return None

    def at_eof(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


def test_writes_pass_while_open_and_are_dropped_once_closed() -> None:
    inner = FakeTransport()
    guarded = WritesAfterClose(inner)
    guarded.write(b"PUB a 1\r\n")
    guarded.writelines([b"x", b"y"])
    inner.close()
    guarded.write(b"PING\r\n")  # would raise on the inner transport
    guarded.writelines([b"lost"])
    assert inner.written == [b"PUB a 1\r\n", b"x", b"y"]
    assert guarded.at_eof() and bool(guarded) == bool(inner)


def test_every_transport_the_client_is_given_is_guarded_and_read_back_as_is() -> None:
    client: Any = TolerantClient()
    assert client._transport is None
    inner = FakeTransport()
    client._transport = inner
    assert isinstance(client._transport, WritesAfterClose)
    assert client._transport is client._transport  # one wrapper, read without rewrapping
    assert client._transport.close is not None  # anything else reaches the transport
    client._transport = None
    assert client._transport is None
