"""A NATS cluster of embedded servers on one machine, for the tests and for trying R3 streams.

`EmbeddedNatsCluster` runs N `EmbeddedNatsServer` nodes (default 3) with routes to each other,
one cluster name, JetStream in a store directory per node and an HTTP monitoring port each, all
on free ports picked up front (never 4222), so a node killed or restarted comes back on its own
ports and store. `urls` is what NATS_URL takes.

For fault tests a node can also be paused (SIGSTOP) and resumed, and, with `route_relays`,
cut off from the others while its clients stay connected to it, then healed: every route
then goes through a relay (`embedded/relays.py`) that a cut closes.

Ready means what a client needs: every running node is healthy (`/healthz`), the JetStream meta
group has a leader that sees every running node current (`/jsz`), and every stream has a
leader with each of its running replicas current. A fresh cluster elects within a second of its
last node starting; a node restarted after a kill needs its streams to catch up first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import anyio
import nats
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ClusterInfo

from txactors.embedded.relays import RouteRelays
from txactors.embedded.server import DEFAULT_HOST, EmbeddedNatsServer
from txactors.embedded.setup import (
    DEFAULT_FSYNC,
    DEFAULT_FSYNC_INTERVAL,
    ClusterNode,
    Fsync,
    FsyncSetting,
)
from txactors.errors import NatsServerError
from txactors.observe.logs import get_logger
from txactors.wire.replicas import why_not_current

__all__ = ["DEFAULT_CLUSTER_NAME", "EmbeddedNatsCluster", "free_ports"]

DEFAULT_CLUSTER_NAME: Final = "txactors"
_POLL: Final = 0.1
_HTTP_TIMEOUT: Final = 1.0

log = get_logger(__name__)


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports nothing listens on now (held together while picking, so distinct;
    from the kernel's ephemeral range, which excludes NATS's well-known ports)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


class EmbeddedNatsCluster:
    """`size` nats-server nodes forming one JetStream cluster; nodes are killed and restarted
    by index (0-based; node `i` is named `n{i+1}`).

    `data_dir=None` uses a temporary directory that `stop()` removes; node `i` stores into
    `data_dir/n{i+1}`. `fsync`/`fsync_interval` apply to every node (durable by default).
    `route_relays` routes the nodes through relays, so that `cut` and `heal` work; each route
    byte then crosses a thread of this process.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        size: int = 3,
        name: str = DEFAULT_CLUSTER_NAME,
        host: str = DEFAULT_HOST,
        binary: str | os.PathLike[str] | None = None,
        fsync: Fsync = DEFAULT_FSYNC,
        fsync_interval: float = DEFAULT_FSYNC_INTERVAL,
        ready_timeout: float = 30.0,
        route_relays: bool = False,
    ) -> None:
        if size < 1:
            raise NatsServerError(f"a cluster needs at least one node, got size={size}")
        FsyncSetting(fsync=fsync, fsync_interval=fsync_interval)  # raises a bad one
        self.size = size
        self.name = name
        self.ready_timeout = ready_timeout
        self._temporary = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="txactors-cluster-"))
        # The relays bind theirs first: a port picked here is free only until its node binds it.
        self._relays = RouteRelays(host, size) if route_relays else None
        ports = free_ports(host, size * 3)
        client, route, monitor = ports[:size], ports[size : 2 * size], ports[2 * size :]
        self._monitors = [f"{host}:{port}" for port in monitor]
        if self._relays is not None:
            self._relays.forward_to(route)
        self.nodes = [
            EmbeddedNatsServer(
                self.data_dir / f"n{i + 1}",
                port=client[i],
                host=host,
                binary=binary,
                fsync=fsync,
                fsync_interval=fsync_interval,
                cluster=ClusterNode(
                    server_name=f"n{i + 1}",
                    cluster_name=name,
                    listen=f"{host}:{route[i]}",
                    routes=self._routes(i, host, route),
                    monitor=self._monitors[i],
                    advertise=self._relays.advertise(i) if self._relays else None,
                ),
            )
            for i in range(size)
        ]

    def _routes(self, index: int, host: str, ports: list[int]) -> tuple[str, ...]:
        if self._relays is not None:
            return self._relays.routes(index)
        return tuple(f"nats-route://{host}:{port}" for port in ports)

    # -- what clients need ---------------------------------------------------------------

    @property
    def url_list(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def urls(self) -> str:
        """Every node's URL, comma-joined: the value for NATS_URL."""
        return ",".join(self.url_list)

    def index_of(self, server_name: str) -> int:
        """The index of the node called `server_name` (as stream and meta leaders are named)."""
        for i, node in enumerate(self.nodes):
            if node.cluster is not None and node.cluster.server_name == server_name:
                return i
        raise NatsServerError(f"no node called {server_name!r} in cluster {self.name}")

    async def stream_leader(
        self, js: JetStreamContext, stream: str, timeout: float | None = None
    ) -> int:
        """The index of the node leading `stream` (waiting out an election in progress)."""
        async with asyncio.timeout(timeout or self.ready_timeout):
            while True:
                with contextlib.suppress(nats.errors.TimeoutError, nats.js.errors.APIError):
                    info = await js.stream_info(stream)
                    if info.cluster is not None and info.cluster.leader:
                        return self.index_of(info.cluster.leader)
                await asyncio.sleep(_POLL)

    async def meta_leader(self) -> int | None:
        """The index of the node leading the JetStream meta group, as the running nodes see
        it; None while they elect one (they name a killed leader for seconds after)."""
        running = {self._server_name(i) for i, node in enumerate(self.nodes) if node.running}
        for name in sorted(running):
            _, jsz = await self._monitor(self.index_of(name), "/jsz")
            leader = (jsz.get("meta_cluster") or {}).get("leader")
            if leader in running:
                return self.index_of(leader)
        return None

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop()  # no node outlives a cluster that never came up
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self, indexes: Iterable[int] | None = None, *, wait: bool = True) -> None:
        """Start the nodes `indexes` (default: all that are not running); with `wait`, return
        once the cluster is ready (see `wait_ready`; only when every node runs then)."""
        if self._relays is not None:
            self._relays.start()
        todo = [i for i in (range(self.size) if indexes is None else indexes)]
        await asyncio.gather(*(self.nodes[i].start() for i in todo if not self.nodes[i].running))
        if wait and all(node.running for node in self.nodes):
            await self.wait_ready()

    async def kill(self, index: int) -> None:
        """SIGKILL node `index`, as a crash would; its ports and store are kept for `restart`."""
        await self.nodes[index].kill()

    async def restart(self, index: int, *, wait: bool = True) -> None:
        """Start node `index` again on its ports and store (stopping it gracefully first if it
        runs); with `wait`, return once the cluster is ready, the node caught up."""
        node = self.nodes[index]
        await (node.restart() if node.running else node.start())
        if wait:
            await self.wait_ready()

    def pause(self, index: int) -> None:
        """SIGSTOP node `index`: its connections stay open, unanswered, until `resume`."""
        self.nodes[index].pause()

    def resume(self, index: int) -> None:
        """SIGCONT node `index` after `pause`."""
        self.nodes[index].resume()

    async def cut(self, index: int) -> None:
        """Cut node `index` off from the others (its clients stay connected to it): every
        route to or from it is closed, and refused until `heal` (needs `route_relays`)."""
        await self._relays_or_error().cut(index)

    async def heal(self, index: int) -> None:
        """Let node `index` route to the others again (they redial within a second or two)."""
        await self._relays_or_error().heal(index)

    def is_cut(self, index: int) -> bool:
        return self._relays is not None and self._relays.is_cut(index)

    def _relays_or_error(self) -> RouteRelays:
        if self._relays is None:
            raise NatsServerError(
                f"cluster {self.name} routes directly: make it with route_relays=True to cut it"
            )
        return self._relays

    async def stop(self) -> None:
        """Stop every node; removes the store only if it was a temporary directory."""
        for node in self.nodes:
            await node.stop()
        if self._relays is not None:
            self._relays.close()
        if self._temporary:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # -- readiness -----------------------------------------------------------------------

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Return once every running node is healthy, the meta leader sees each of them
        current, and every stream has a leader and its running replicas are current."""
        limit = timeout or self.ready_timeout
        why: str | None = "not checked yet"
        try:
            async with asyncio.timeout(limit):
                # the servers' state, polled: nothing tells us when it changes
                while (why := await self._not_ready()) is not None:  # noqa: ASYNC110
                    await asyncio.sleep(_POLL)
        except TimeoutError:
            raise NatsServerError(
                f"cluster {self.name} was not ready within {limit:g}s: {why}"
            ) from None
        log.info("nats_cluster_ready", urls=self.urls)

    async def _not_ready(self) -> str | None:
        """Why the cluster is not ready yet, or None when it is."""
        running = [i for i, node in enumerate(self.nodes) if node.running]
        if not running:
            return "no node is running"
        names = {self._server_name(i) for i in running}
        for i in running:
            status, body = await self._monitor(i, "/healthz")
            if status != 200:
                return f"{self._server_name(i)} is not healthy: {body.get('error', body)}"
        _, jsz = await self._monitor(running[0], "/jsz")
        meta = jsz.get("meta_cluster") or {}
        leader = meta.get("leader")
        if not leader:
            return "JetStream has no meta leader"
        if leader not in names:
            return f"the meta leader {leader} is not running"
        _, jsz = await self._monitor(self.index_of(leader), "/jsz")
        meta = jsz.get("meta_cluster") or {}
        current = {peer["name"] for peer in meta.get("replicas") or () if peer.get("current")}
        lagging = sorted(names - current - {leader})
        if lagging:
            return f"the meta leader {leader} does not see {', '.join(lagging)} current"
        return await self._streams_not_ready(names)

    async def _streams_not_ready(self, names: set[str]) -> str | None:
        try:
            nc = await nats.connect(
                [self.nodes[self.index_of(n)].url for n in sorted(names)],
                allow_reconnect=False,
                connect_timeout=_HTTP_TIMEOUT,
                error_cb=_ignore,  # a failed poll is retried, not news
            )
        except (nats.errors.Error, TimeoutError, OSError) as error:
            return f"no node takes a connection: {error!r}"
        try:
            js = nc.jetstream(timeout=_HTTP_TIMEOUT * 2)
            for listed in await js.streams_info():
                stream = listed.config.name or "?"
                cluster = (await js.stream_info(stream)).cluster
                why = _group_not_ready(f"stream {stream}", cluster, names)
                if why is None:
                    for consumer in await js.consumers_info(stream):
                        what = f"consumer {stream}/{consumer.name}"
                        if (why := _group_not_ready(what, consumer.cluster, names)) is not None:
                            break
                if why is not None:
                    return why
        except (nats.errors.Error, TimeoutError, OSError) as error:
            return f"streams cannot be listed: {error!r}"
        finally:
            await nc.close()
        return None

    async def routed_to(self, index: int) -> set[str]:
        """The names of the nodes node `index` has a route to now (its `/routez`)."""
        _, routez = await self._monitor(index, "/routez")
        return {route.get("remote_name", "?") for route in routez.get("routes") or ()}

    def _server_name(self, index: int) -> str:
        cluster = self.nodes[index].cluster
        assert cluster is not None
        return cluster.server_name

    async def _monitor(self, index: int, path: str) -> tuple[int, dict[str, Any]]:
        """GET the node's monitoring endpoint: (HTTP status, JSON body); 0 when unreachable."""
        url = f"http://{self._monitors[index]}{path}"

        def get() -> tuple[int, dict[str, Any]]:
            try:
                with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT) as answer:
                    return answer.status, json.loads(answer.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read() or b"{}")
            except (OSError, ValueError) as error:
                return 0, {"error": repr(error)}

        return await asyncio.to_thread(get)


async def _ignore(error: Exception) -> None:
    pass


def _group_not_ready(what: str, cluster: ClusterInfo | None, names: set[str]) -> str | None:
    """Why a stream's or consumer's replica group is not ready (no leader, a running
    replica behind), or None."""
    if cluster is None:
        return f"{what} has no leader"
    return why_not_current(what, cluster, lambda peer: peer.name in names)
