"""Routes between the nodes of an embedded cluster, carried by TCP relays a test can cut.

A network partition needs iptables or root; a relay needs neither. `RouteRelays` gives every
ordered pair of nodes (i dials j) its own listening port, forwarding to node j's route port:
node i's configured routes are its relays to the others, so every byte between two nodes
crosses a relay that knows both ends. `cut(i)` closes every relayed connection to or from
node i and closes at once the new ones it or its peers open, until `heal(i)`; its clients stay
connected to it, as behind a partition.

nats-server also connects routes it learns by gossip, to the address each node advertises.
Each node advertises a port bound by us and never listening, so such a dial is refused (a
learnt route is tried once) and the configured routes through the relays are the only ones.

The relays run on an event loop of their own, in a thread: a test whose loop is busy does not
stall the cluster's replication.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import socket
import threading
from collections.abc import Callable
from typing import Final

from txactors.observe.logs import get_logger

__all__ = ["RouteRelays"]

CHUNK: Final = 65536
"""Bytes read at once from either side of a relayed connection."""
_CONTROL_TIMEOUT: Final = 10.0
"""Seconds a cut, heal or close waits for the relays' loop."""

log = get_logger(__name__)

Pair = tuple[int, int]
"""(the node that dials, the node dialled)."""


class RouteRelays:
    """The route relays of a cluster of `size` nodes on `host`. Sockets are bound at
    construction, before the nodes' own ports are picked, so that no port a node is given can
    be taken by a relay in between; `forward_to` names the nodes' route ports (node j takes
    routes on `route_ports[j]`, its `cluster.listen`), `start` serves, `close` frees them."""

    def __init__(self, host: str, size: int) -> None:
        self.host = host
        self._targets: list[int] = []
        self._listeners: dict[Pair, socket.socket] = {}
        self._refusers: list[socket.socket] = []
        try:
            for pair in itertools.permutations(range(size), 2):
                self._listeners[pair] = _bound(host, listen=True)
            self._refusers = [_bound(host, listen=False) for _ in range(size)]
        except BaseException:
            self._close_sockets()
            raise
        self._cut: set[int] = set()
        self._live: dict[Pair, set[asyncio.Transport]] = {pair: set() for pair in self._listeners}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.Server] = []

    def forward_to(self, route_ports: list[int]) -> None:
        """Relay the routes dialled to node j to `route_ports[j]`."""
        self._targets = list(route_ports)

    # -- what the nodes are configured with ------------------------------------------------

    def routes(self, node: int) -> tuple[str, ...]:
        """The route URLs node `node` dials: its relays to every other node."""
        return tuple(
            f"nats-route://{self.host}:{sock.getsockname()[1]}"
            for (src, _), sock in self._listeners.items()
            if src == node
        )

    def advertise(self, node: int) -> str:
        """The `host:port` node `node` advertises to the others: refused, so that no route
        is made but through a relay."""
        return f"{self.host}:{self._refusers[node].getsockname()[1]}"

    # -- faults ------------------------------------------------------------------------------

    def is_cut(self, node: int) -> bool:
        return node in self._cut

    async def cut(self, node: int) -> None:
        """Close every route connection to or from `node`; refuse new ones until `heal`."""
        await self._control(self._cut_now, node)

    async def heal(self, node: int) -> None:
        """Let `node`'s routes be made again (the nodes redial by themselves within a second
        or two)."""
        await self._control(self._cut.discard, node)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Serve the relays on a loop in a thread of their own (idempotent)."""
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve_all())
            except BaseException as error:  # reported to start(), the caller
                failed.append(error)
            finally:
                ready.set()
            if not failed:
                loop.run_forever()
                pending = asyncio.all_tasks(loop)  # relays still winding down
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="txactors-route-relays", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            self._loop = self._thread = None
            raise failed[0]

    def close(self) -> None:
        """Stop relaying, close every connection and free the ports."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            with contextlib.suppress(RuntimeError, TimeoutError):  # a loop already gone
                asyncio.run_coroutine_threadsafe(self._stop_all(), loop).result(_CONTROL_TIMEOUT)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_CONTROL_TIMEOUT)
        self._loop = self._thread = None
        self._close_sockets()

    # -- on the relays' loop -----------------------------------------------------------------

    async def _control(self, change: Callable[[int], object], node: int) -> None:
        """Run `change(node)` on the relays' loop and wait for it."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the route relays are not started")

        async def apply() -> None:
            change(node)

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(apply(), loop))

    def _cut_now(self, node: int) -> None:
        self._cut.add(node)
        closed = 0
        for pair, transports in self._live.items():
            if node in pair:
                for transport in list(transports):
                    transport.abort()
                    closed += 1
        log.info("route_relays_cut", node=node, connections=closed)

    async def _serve_all(self) -> None:
        for pair, sock in self._listeners.items():
            server = await asyncio.start_server(functools.partial(self._relay, pair), sock=sock)
            self._servers.append(server)

    async def _stop_all(self) -> None:
        for server in self._servers:
            server.close()
        for transports in self._live.values():
            for transport in list(transports):
                transport.abort()
        self._servers.clear()

    async def _relay(
        self, pair: Pair, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """One route connection from node pair[0] to node pair[1], both ways, until either
        side closes or the pair is cut."""
        if self._blocked(pair):
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self._targets[pair[1]])
        except OSError:
            _abort(writer)  # the node is down: its dialler retries
            return
        ends = (_transport(writer), _transport(up_writer))
        if self._blocked(pair):  # cut while we dialled
            for end in ends:
                end.abort()
            return
        self._live[pair].update(ends)
        try:
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
        finally:
            for end in ends:
                self._live[pair].discard(end)
                end.abort()

    def _blocked(self, pair: Pair) -> bool:
        return not self._cut.isdisjoint(pair)

    def _close_sockets(self) -> None:
        for sock in itertools.chain(self._listeners.values(), self._refusers):
            sock.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until its end closes (or either breaks), then close the other."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        _abort(writer)


def _transport(writer: asyncio.StreamWriter) -> asyncio.Transport:
    transport = writer.transport
    assert isinstance(transport, asyncio.Transport)
    return transport


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close at once, dropping what is unsent: a route's peer redials and resyncs."""
    _transport(writer).abort()


def _bound(host: str, *, listen: bool) -> socket.socket:
    """A TCP socket bound to a free port of `host`; listening, or bound only (a dial to it
    is refused, and no other socket can take its port while we hold it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        if listen:
            sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock
