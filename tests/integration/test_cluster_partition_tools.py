"""The 3-node cluster's fault tools: a node cut off from the others (its clients still on it)
and healed, and a node paused and resumed, as every partition and pause test uses them."""

from __future__ import annotations

import nats
import nats.errors
import pytest

from tests.integration.test_coordinator_recovery import capture_logs
from tests.support.wait import eventually
from txactors.embedded.cluster import EmbeddedNatsCluster
from txactors.errors import NatsServerError
from txactors.nats.client import connect

CUT = 0


async def routes(cluster: EmbeddedNatsCluster) -> list[set[str]]:
    return [await cluster.routed_to(i) for i in range(cluster.size)]


async def test_a_cut_node_routes_to_nobody_until_healed_and_its_clients_stay_on_it(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    name = f"n{CUT + 1}"
    others = [f"n{i + 1}" for i in range(nats_cluster.size) if i != CUT]
    assert await routes(nats_cluster) == [
        {n for n in ("n1", "n2", "n3") if n != f"n{i + 1}"} for i in range(nats_cluster.size)
    ]
    nc = await nats.connect(nats_cluster.nodes[CUT].url, allow_reconnect=False)
    log = nats_cluster.nodes[CUT].log_path

    def dials() -> int:
        return log.read_text().count("Route connection created")

    try:
        before = dials()
        await nats_cluster.cut(CUT)

        def isolated(seen: list[set[str]]) -> bool:
            return not seen[CUT] and all(name not in r for i, r in enumerate(seen) if i != CUT)

        await eventually(lambda: routes(nats_cluster), until=isolated, what="n1 cut off")
        # The nodes redial every second: the cut still holds a few dials later.
        await eventually(dials, until=lambda n: n >= before + 6, what="n1's routes redialled")
        assert isolated(await routes(nats_cluster))
        await nc.flush(timeout=2)  # the cut node's client is still connected and answered
        assert nc.is_connected

        await nats_cluster.heal(CUT)
        await eventually(
            lambda: routes(nats_cluster),
            until=lambda seen: seen[CUT] == set(others) and all(name in r for r in seen[1:]),
            what="n1 routed again",
        )
        await nats_cluster.wait_ready()
    finally:
        await nc.close()


async def test_a_paused_node_answers_nothing_until_resumed(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    """And the PONG of the flush that gave up, arriving on resume, leaves the client as it was
    (nats-py's own read loop dies on it)."""
    nc = await connect(nats_cluster.nodes[CUT].url, allow_reconnect=False, server_watch=None)
    try:
        nats_cluster.pause(CUT)
        assert nats_cluster.nodes[CUT].paused
        with pytest.raises(nats.errors.TimeoutError):
            await nc.flush(timeout=0.5)
        nats_cluster.resume(CUT)
        await nc.flush(timeout=5)
        await nats_cluster.wait_ready()
    finally:
        await nc.close()


async def test_a_paused_node_is_stopped_as_promptly_as_a_running_one(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    """A paused process would take SIGTERM only once continued: stop resumes it first."""
    node = nats_cluster.nodes[CUT]
    nats_cluster.pause(CUT)
    with capture_logs() as logs:
        await node.stop(timeout=30)  # not honoured, it would end in a SIGKILL, logged
    assert not node.running
    events = [e["event"] for e in logs if e["event"].startswith("nats_server")]
    assert events == ["nats_server_resumed", "nats_server_stopped"]


async def test_a_cluster_routed_directly_cannot_be_cut() -> None:
    cluster = EmbeddedNatsCluster(size=1)
    with pytest.raises(NatsServerError, match="route_relays"):
        await cluster.cut(0)
    await cluster.stop()
