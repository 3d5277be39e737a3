"""Never two owners writing: an owner paused past its lease TTL (SIGSTOP, as in a long GC pause
or a frozen VM) is replaced; resumed (SIGCONT), it stops serving the partition without writing
it, and under producer load throughout, every committed transaction's messages are on their
topic exactly once and no rolled-back one is."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import anyio
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.support.coordinator_process import CoordinatorProcess
from tests.support.servers import MakeNatsServer
from tests.support.txn import topic_messages
from tests.support.wait import eventually
from txactors.errors import PrepareFailed, TxActorsError
from txactors.nats.client import connect
from txactors.ops import leases as lease_admin
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.wire import layout

PARTITIONS = 2
TTL = 1.5
STOPPED_SERVING = {"lease_expiring_stop_serving", "lease_lost", "partition_actor_died"}
"""What the keeper logs when it stops serving a partition it may no longer hold."""


async def test_an_owner_paused_past_its_ttl_is_fenced_and_nothing_is_lost_or_doubled(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    server = await make_nats_server()
    coordinators = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        coordinators.append(
            CoordinatorProcess(
                server.url,
                tmp_path / name,
                partitions=PARTITIONS,
                extra_args=["--lease-ttl", str(TTL)],
            )
        )
    nc = await connect(server.url, name="fencing-test")
    expected: set[str] = set()
    """Labels of transactions that must end on the topic (their prepare was confirmed and
    their decision was COMMIT: an unconfirmed end is settled by the check-back)."""
    forbidden: set[str] = set()
    committed_on: list[tuple[float, int]] = []
    """(when, partition) of each commit the coordinator confirmed."""
    stopping = anyio.Event()

    async def produce(producer: TransactionProducer, worker: int) -> None:
        for n in itertools.count():
            if stopping.is_set():
                return
            label = f"{worker}-{n}"
            decision = Decision.ROLLBACK if n % 3 == 0 else Decision.COMMIT
            try:
                result = await producer.send_in_transaction(
                    TxMessage("orders", label.encode()), lambda m, a, d=decision: d
                )
            except PrepareFailed:
                forbidden.add(label)  # rolled back by the producer (nothing to commit)
                continue
            except TxActorsError:
                continue  # refused end: either outcome, but at most once
            (expected if decision is Decision.COMMIT else forbidden).add(label)
            if result.state == "committed":
                committed_on.append((time.monotonic(), layout.partition_of(result.txid, 2)))

    def commits_on(partition: int, since: float) -> int:
        return sum(1 for at, p in committed_on if p == partition and at > since)

    try:
        for coordinator in coordinators:
            await coordinator.start()
        table = await _leases_until(nc, lambda t: sorted(m.held for m in t.members) == [1, 1])
        [victim] = [c for c in coordinators if f"-{c.pid}-" in (table.leases[0].owner or "")]
        [survivor] = [c for c in coordinators if c is not victim]
        async with (
            TransactionProducer(
                nc, "shop", lambda view: Decision.ROLLBACK, partitions=2, request_timeout=1.0
            ) as producer,
            anyio.create_task_group() as load,
        ):
            for worker in range(4):
                load.start_soon(produce, producer, worker)
            await eventually(lambda: commits_on(0, 0) >= 10)

            victim.pause()
            await _leases_until(
                nc, lambda t: f"-{survivor.pid}-" in (t.leases[0].owner or ""), timeout=4 * TTL
            )
            taken_over = time.monotonic()
            await eventually(lambda: commits_on(0, taken_over) >= 10)  # the successor serves it

            victim.resume()
            await eventually(lambda: _stopped_serving(victim, 0))
            resumed = time.monotonic()
            await eventually(lambda: commits_on(0, resumed) >= 10 and commits_on(1, resumed) >= 10)
            assert victim.alive(), victim.log_tail()
            stopping.set()
            # Every confirmed commit reaches the topic (unconfirmed ends via the check-back).
            await eventually(
                lambda: topic_messages(nc, "orders"),
                until=lambda messages: expected <= _labels(messages),
                timeout=20,
                interval=0.2,
                what="every confirmed commit on the topic",
            )
        messages = await topic_messages(nc, "orders")
        ids = [(m.headers or {})[layout.MSG_ID_HEADER] for m in messages]
        labels = [m.data.decode() for m in messages]
        assert len(ids) == len(set(ids)) and len(labels) == len(set(labels)), "exactly once"
        assert expected <= set(labels)
        assert not forbidden & set(labels), "no rolled-back transaction is on the topic"
        assert len(expected) > 40
    finally:
        await nc.close()
        for coordinator in coordinators:
            await coordinator.kill()


def _labels(messages: list[Msg]) -> set[str]:
    return {m.data.decode() for m in messages}


def _stopped_serving(coordinator: CoordinatorProcess, partition: int) -> bool:
    """Its log says it stopped serving `partition` (without handing it over: it was not its)."""
    for line in coordinator.log_tail(10_000).splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") in STOPPED_SERVING and event.get("partition") == partition:
            return True
    return False


async def _leases_until(
    nc: Client, done: Callable[[lease_admin.LeaseTable], bool], timeout: float = 10.0
) -> lease_admin.LeaseTable:
    return await eventually(
        lambda: lease_admin.list_leases(nc, partitions=PARTITIONS),
        until=done,
        timeout=timeout,
        what="the lease table as expected",
    )
