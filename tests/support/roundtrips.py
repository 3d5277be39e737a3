"""Round trips to a database, counted on the wire by a TCP proxy in front of it.

A round trip is a turn of the conversation: the client sends after the server last spoke
(or first). Drivers wait for each answer before the next request outside pipeline mode, so
the count is exact, whatever the timing; it is what a slower network multiplies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress


class TurnCounter:
    """The proxy's count of round trips, over all its connections."""

    def __init__(self) -> None:
        self.turns = 0
        self._client_spoke_last = False

    def client_sent(self) -> None:
        if not self._client_spoke_last:
            self.turns += 1
        self._client_spoke_last = True

    def server_sent(self) -> None:
        self._client_spoke_last = False


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: bool, seen: TurnCounter
) -> None:
    try:
        while data := await reader.read(65536):
            (seen.client_sent if client else seen.server_sent)()
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@asynccontextmanager
async def counting_proxy(host: str, port: int) -> AsyncIterator[tuple[int, TurnCounter]]:
    """A proxy to `host:port` on a free local port: (its port, its counter)."""
    seen = TurnCounter()
    pumps: set[asyncio.Task[None]] = set()

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(host, port)
        for args in ((client_r, server_w, True), (server_r, client_w, False)):
            task = asyncio.create_task(_pump(*args, seen))
            pumps.add(task)
            task.add_done_callback(pumps.discard)

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield listener.sockets[0].getsockname()[1], seen
    finally:
        listener.close()
        for task in list(pumps):
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await listener.wait_closed()
