"""`txactors top` rendered against a running coordinator: partitions and their owners (one
left without), open and discarded transactions, commits per second from the coordinator's
metrics endpoint, and a group's dead letters growing between two looks."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

from nats.aio.client import Client
from rich.console import Console

from tests.support.txn import CoordinatorClient, message
from tests.support.wait import eventually
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.observe.metrics import CoordinatorMetrics, serve_metrics
from txactors.ops.top import Snapshot, take_snapshot, total
from txactors.ops.top_view import render_top
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, Decision, ListTransactions

PARTITIONS = 3
COMMITS = "txactors_commits_total"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def txid_in(partition: int, prefix: str) -> str:
    """A txid whose partition (of PARTITIONS) is `partition`."""
    n = 0
    while layout.partition_of(f"{prefix}-{n}", PARTITIONS) != partition:
        n += 1
    return f"{prefix}-{n}"


def text(renderable: object) -> str:
    console = Console(record=True, width=220, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    console.file.close()
    return console.export_text()


def row(frame: str, first: str) -> list[str]:
    """The cells of the frame's row whose first cell is `first`."""
    for line in frame.splitlines():
        cells = line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{frame}")


async def _cli(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "txactors.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_a_frame_of_a_running_coordinator(private_nc: Client) -> None:
    js = private_nc.jetstream()
    await js.add_stream(name=layout.dlq_stream("billing"), subjects=[layout.dlq_filter("billing")])
    await js.publish(layout.dlq_subject("billing", "orders"), b"gave up")
    metrics = CoordinatorMetrics()
    port = free_port()
    server = serve_metrics(metrics.registry, port, addr="127.0.0.1")
    endpoint = f"http://127.0.0.1:{port}/metrics"
    # Two of three partitions: partition 2 stays without an owner.
    options = CoordinatorOptions(partitions=PARTITIONS, max_partitions=2)
    try:
        async with run_coordinator(private_nc, options=options, metrics=metrics, owner="coord-a"):
            client = CoordinatorClient(private_nc, partition=0)
            waiting = txid_in(0, "waiting")
            await client.prepare(waiting, message())
            before = await take_snapshot(private_nc, metrics=[endpoint])

            for n in range(4):
                txid = txid_in(0, f"paid{n}")
                prepared = await client.prepare(txid, message())
                await client.end(txid, prepared.token, Decision.COMMIT)
            await js.publish(layout.dlq_subject("billing", "orders"), b"gave up again")

            def settled(snapshot: Snapshot) -> bool:  # the `done` records written, counted
                open_ = [t.txid for t in snapshot.views[0].transactions]
                return open_ == [waiting] and total(snapshot, COMMITS, 0) == 4

            after = await eventually(
                lambda: take_snapshot(private_nc, metrics=[endpoint]),
                until=settled,
                what="4 commits done, one transaction open",
            )
            frame = text(render_top(before, after, interval=1))

            assert "3 partition(s), 2 held by 1 coordinator(s)" in frame, frame
            elapsed = after.taken_at - before.taken_at
            p0 = row(frame, "0")
            assert p0[1:6] == ["coord-a", "1", "0", "0", p0[5]], frame  # one open, none checking
            commits_per_second = float(p0[6])
            assert abs(commits_per_second - 4 / elapsed) < 0.1 + 4 / elapsed * 0.05, frame
            assert row(frame, "1")[1:3] == ["coord-a", "0"], frame
            assert row(frame, "2")[1:5] == ["no", "owner", "no", "answer"], frame
            assert row(frame, "billing")[1] == "2", frame
            assert float(row(frame, "billing")[2]) > 0, "one more dead letter since the last look"
            assert row(frame, waiting)[1:4] == ["0", "g", "prepared"], frame
            assert row(frame, "all")[1:3] == ["1", "0"], frame

            # The command prints one frame, as an operator sees it.
            url = private_nc.connected_url
            assert url is not None
            code, out, err = await _cli(
                "top", "--once", "--interval", "0.2", "--metrics", endpoint, "--url", url.geturl()
            )
            assert code == 0, err
            assert row(out, "0")[1:3] == ["coord-a", "1"], out
            assert row(out, "2")[1:3] == ["no", "owner"], out
            assert waiting in out and "billing" in out, out
    finally:
        server.shutdown()
        server.server_close()


async def test_discarded_and_checking_show_without_metrics(private_nc: Client) -> None:
    """Without an endpoint the rates are '-', and the frame says where they come from."""
    from txactors.wire.rules import CoordinatorConfig

    config = CoordinatorConfig(
        transaction_timeout=0.2,
        check_interval=0.1,
        check_interval_max=0.1,
        check_answer_timeout=0.2,
        check_max=1,
    )
    async with run_coordinator(private_nc, config=config, owner="coord-b"):
        client = CoordinatorClient(private_nc)
        await client.prepare("orphan", message())  # no producer answers its check-backs

        async def discarded() -> list[str]:
            where = ListTransactions(states=["discarded"], version=PROTOCOL_VERSION)
            return [t.txid for t in (await client.admin(where)).transactions]

        await eventually(
            discarded, until=lambda ids: ids == ["orphan"], timeout=20, what="orphan discarded"
        )
        frame = text(render_top(None, await take_snapshot(private_nc)))
        assert row(frame, "0")[1:6] == ["coord-b", "0", "0", "1", "-"], frame
        assert "--metrics" in frame and "no consumer group" in frame, frame
        assert "open transactions: none" in frame, frame
