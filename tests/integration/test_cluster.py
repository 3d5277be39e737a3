"""txactors on a real 3-node NATS cluster (the `nats_cluster` fixture), as docs/operations.md
deploys it: every stream and consumer with three replicas, a node killed and restarted, and a
coordinator started while the cluster is still forming."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from nats.aio.client import Client
from nats.js.api import ClusterInfo
from structlog.testing import capture_logs

from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.embedded.cluster import DEFAULT_CLUSTER_NAME, EmbeddedNatsCluster
from txactors.embedded.server import CONFIG_FILE_NAME
from txactors.embedded.setup import DEFAULT_FSYNC_INTERVAL, ClusterNode, server_config
from txactors.errors import ConfigError, NatsServerError, PrepareFailed
from txactors.nats.client import connect
from txactors.nats.topics import ensure_topic_stream
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]
NODES = {"n1", "n2", "n3"}
REPLICATED = (
    "TXN_LOG_0",
    "TXN_DISCARD",
    "KV_TXN_CHECKPOINT",
    "KV_TXN_LEASE",
    "TOPIC_orders",
    "DLQ_audit",
)


async def commit_checker(view: CheckView) -> Decision:
    return Decision.COMMIT


@asynccontextmanager
async def txactors_on(nc: Client) -> AsyncIterator[tuple[TransactionProducer, list[str]]]:
    """A coordinator and a consumer with three replicas, and a producer, on `nc`."""
    received: list[str] = []

    async def handle(message: ConsumedMessage) -> None:
        received.append(message.msg_id)

    async with (
        run_coordinator(nc, options=CoordinatorOptions(replicas=3)),
        Consumer(nc, "orders", "audit", handle, replicas=3),
        TransactionProducer(nc, "shop", commit_checker) as producer,
    ):
        yield producer, received


async def commit(producer: TransactionProducer, received: list[str], body: bytes) -> None:
    """Commit one transaction, retrying a PrepareFailed (the documented retriable error: the
    local transaction did not run) as an application would, and wait for its delivery."""
    result = await eventually(
        lambda: producer.send_in_transaction(
            TxMessage("orders", body), lambda message, arg: Decision.COMMIT
        ),
        ignoring=(PrepareFailed,),
        timeout=30,
        interval=0.1,
    )
    await eventually(lambda: f"{result.txid}:0" in received, timeout=30)


def connected_url(nc: Client) -> str:
    url = nc.connected_url
    assert url is not None
    return f"nats://{url.hostname}:{url.port}"


def assert_three_copies(what: str, cluster: ClusterInfo | None) -> None:
    assert cluster is not None and cluster.leader in NODES, what
    followers = {peer.name for peer in cluster.replicas or ()}
    assert len(cluster.replicas or ()) == 2 and followers | {cluster.leader} == NODES, what


async def test_every_stream_and_the_durable_consumer_have_three_replicas(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    nc = await connect(nats_cluster.url_list)
    try:
        async with txactors_on(nc) as (producer, received):
            await commit(producer, received, b"one")
        js = nc.jetstream()
        for stream in REPLICATED:
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert_three_copies(stream, info.cluster)
        durable = (await js.consumers_info("TOPIC_orders"))[0]
        assert durable.name == "audit"
        assert_three_copies("the durable consumer", durable.cluster)
    finally:
        await nc.close()


async def test_a_consumer_told_no_replica_count_keeps_its_dead_letters_as_its_topic(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    """The topic's stream has the coordinator's three copies: a consumer group's dead
    letters get as many, though its consumer was not told a count."""
    nc = await connect(nats_cluster.url_list)
    try:
        await ensure_topic_stream(nc.jetstream(), "orders", replicas=3)

        async def handle(message: ConsumedMessage) -> None:
            pass

        async with Consumer(nc, "orders", "untold", handle):
            info = await nc.jetstream().stream_info(layout.dlq_stream("untold"))
        assert info.config.num_replicas == 3
        assert_three_copies(layout.dlq_stream("untold"), info.cluster)
    finally:
        await nc.close()


async def test_a_killed_node_restarts_and_catches_up_while_the_cluster_serves(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    nc = await connect(nats_cluster.url_list)
    try:
        async with txactors_on(nc) as (producer, received):
            await commit(producer, received, b"before")
            js = nc.jetstream()
            # Neither the leader of the halves nor the server our client is connected to
            # (a request in flight on a dropped connection waits out its timeout): those
            # faults are the slow tests'. Any other stream or consumer it leads elects anew.
            spared = {
                await nats_cluster.stream_leader(js, layout.half_stream(0)),
                nats_cluster.url_list.index(connected_url(nc)),
            }
            victim = min({0, 1, 2} - spared)
            await nats_cluster.kill(victim)
            await commit(producer, received, b"while one node is down")
            await nats_cluster.restart(victim)  # returns once every stream caught up
            await commit(producer, received, b"after")
            for stream in REPLICATED:
                assert_three_copies(stream, (await js.stream_info(stream)).cluster)
            assert len(received) == 3
    finally:
        await nc.close()


async def test_a_coordinator_started_before_the_cluster_formed_comes_up_and_serves(
    tmp_path: Path,
) -> None:
    """A fresh cluster elects its first meta leader only once every node is up; until then
    the coordinator's declarations are retried, not fatal."""
    cluster = EmbeddedNatsCluster(tmp_path / "cluster")
    await cluster.start([0], wait=False)
    nc = await connect(cluster.nodes[0].url)
    try:
        with capture_logs() as logs:
            async with anyio.create_task_group() as tasks:
                up = anyio.Event()

                async def coordinate() -> None:
                    async with run_coordinator(nc, options=CoordinatorOptions(replicas=3)):
                        up.set()
                        await anyio.sleep_forever()

                tasks.start_soon(coordinate)
                await eventually(
                    lambda: any(e["event"] == "declare_retry" for e in logs), timeout=30
                )
                assert not up.is_set()
                await cluster.start([1, 2])
                with anyio.fail_after(30):
                    await up.wait()
                received: list[str] = []

                async def handle(message: ConsumedMessage) -> None:
                    received.append(message.msg_id)

                async with (
                    Consumer(nc, "orders", "audit", handle, replicas=3),
                    TransactionProducer(nc, "shop", commit_checker) as producer,
                ):
                    await commit(producer, received, b"formed")
                tasks.cancel_scope.cancel()
        assert (await nc.jetstream().stream_info(layout.half_stream(0))).config.num_replicas == 3
    finally:
        await nc.close()
        await cluster.stop()


async def test_more_replicas_than_the_cluster_has_is_a_config_error_after_the_deadline(
    nats_cluster: EmbeddedNatsCluster,
) -> None:
    nc = await connect(nats_cluster.url_list)
    try:
        with capture_logs() as logs, pytest.raises(ConfigError, match="needs 5 replicas"):
            await ensure_topic_stream(nc.jetstream(), "orders", replicas=5, deadline=0.5)
        assert any(e["event"] == "declare_retry" for e in logs), "retried until the deadline"
    finally:
        await nc.close()


async def test_txactors_server_nodes_3_runs_a_cluster_that_holds_three_replicas(
    tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "TXACTORS_"))}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "txactors.cli", "server", "--nodes", "3"),
        *("--data-dir", str(tmp_path / "cli")),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    try:
        with anyio.fail_after(30):
            urls = (await proc.stdout.readline()).decode().strip()
        assert len(urls.split(",")) == 3, urls
        nc = await connect(urls.split(","))
        try:
            await ensure_topic_stream(nc.jetstream(), "orders", replicas=3)
            assert_three_copies(
                "TOPIC_orders", (await nc.jetstream().stream_info("TOPIC_orders")).cluster
            )
        finally:
            await nc.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
    config = (tmp_path / "cli" / "n2" / CONFIG_FILE_NAME).read_text()
    assert 'server_name: "n2"' in config and "sync_interval: always" in config


def test_the_documented_node_configuration_is_what_the_fixture_writes() -> None:
    """docs/operations.md shows node n1's file as `server_config` writes it for the fixture
    (there with the test's ports and directories), plus the client `listen` line that the
    fixture passes on the command line instead."""
    text = (ROOT / "docs" / "operations.md").read_text()
    block = text.split("<!-- cluster-node-config", 1)[1].split("```", 2)[1]
    lines = block.strip("\n").splitlines()
    assert lines[:2] == ["# n1.conf", "listen: 0.0.0.0:4222"]
    node = ClusterNode(
        server_name="n1",
        cluster_name=DEFAULT_CLUSTER_NAME,
        listen="0.0.0.0:6222",
        routes=tuple(f"nats-route://n{i}:6222" for i in (1, 2, 3)),
        monitor="0.0.0.0:8222",
    )
    written = server_config(Path("/var/lib/nats"), "always", DEFAULT_FSYNC_INTERVAL, None, node)
    assert "\n".join(lines[2:]) + "\n" == written


async def test_a_cluster_that_never_gets_ready_leaves_no_server_running(tmp_path: Path) -> None:
    cluster = EmbeddedNatsCluster(tmp_path / "cluster", size=3, ready_timeout=0.01)
    with pytest.raises(NatsServerError, match="not ready"):
        async with cluster:
            pass
    pids = [node.pid for node in cluster.nodes]
    assert all(not node.running for node in cluster.nodes), pids
