"""The `nats_cluster` fixture: three nats-server nodes forming one JetStream cluster.

Each node has its own store directory under the test's tmp_path and free client, route and
monitoring ports (never 4222); the fixture returns once the cluster is ready (a meta leader
that sees every node current). Tests kill and restart nodes through it (`kill(i)`,
`restart(i)`), which reuse the node's ports and store, as a restarted pod would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from txactors.embedded.cluster import EmbeddedNatsCluster


@pytest_asyncio.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[EmbeddedNatsCluster]:
    """A started 3-node cluster, stopped (and its stores kept in tmp_path) after the test."""
    async with EmbeddedNatsCluster(tmp_path / "cluster", size=3) as cluster:
        yield cluster
