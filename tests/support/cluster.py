"""The `nats_cluster` fixture: three nats-server nodes forming one JetStream cluster.

Each node has its own store directory under the test's tmp_path and free client, route and
monitoring ports (never 4222); the fixture returns once the cluster is ready (a meta leader
that sees every node current). Tests kill and restart nodes through it (`kill(i)`,
`restart(i)`), which reuse the node's ports and store, as a restarted pod would; pause and
resume them (`pause(i)`, `resume(i)`: SIGSTOP, SIGCONT); and cut one off from the others while
its clients stay on it (`cut(i)`, `heal(i)`): its routes go through relays for that.

`longest_election` bounds what a test waits for a stream to elect a leader after a kill: it
derives from the server's raft timeout, not from how fast the machine is today.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from nats.aio.client import ServerVersion

from txactors.embedded.cluster import EmbeddedNatsCluster

ELECTION_ROUNDS = 2
"""Rounds of voting an election may take: the two followers left may both campaign at once and
split the vote (seen as elections of twice the timeout)."""
LOAD_MARGIN = 6.0
"""Seconds a loaded machine adds to an election: the votes, the new leader catching up, a
client round trip on starved cores."""


def election_timeout(server: ServerVersion) -> float:
    """The longest a raft follower of this nats-server waits for a lost leader before it
    campaigns (`maxElectionTimeoutDefault`: 5 s until v2.9, 9 s since v2.10)."""
    return 9.0 if (server.major, server.minor) >= (2, 10) else 5.0


def longest_election(server: ServerVersion) -> float:
    """Seconds from a leader's kill until its stream has a new one, on a loaded machine."""
    return ELECTION_ROUNDS * election_timeout(server) + LOAD_MARGIN


@pytest_asyncio.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[EmbeddedNatsCluster]:
    """A started 3-node cluster, stopped (and its stores kept in tmp_path) after the test."""
    async with EmbeddedNatsCluster(tmp_path / "cluster", size=3, route_relays=True) as cluster:
        yield cluster
