"""nats-server itself killed (SIGKILL) and restarted on the same store, mid-run.

Producers keep sending, the coordinator keeps deciding and the consumer keeps reading
across the outage; afterwards every transaction whose local side committed is delivered,
once as an idempotent consumer sees it, and no rolled-back one ever.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import sys
import time

import anyio
import nats
import pytest
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from tests.support.servers import MakeNatsServer
from tests.support.txn import FAST, CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator import CoordinatorConfig, CoordinatorOptions
from txactors.coordinator.partition.packs import read_halves
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.service import run_coordinator
from txactors.errors import ActorDeadError, AskTimeout, CommandError, TxActorsError
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, Prepare, Prepared

pytestmark = pytest.mark.slow


async def test_nothing_committed_is_lost_when_the_broker_is_killed_mid_run(
    make_nats_server: MakeNatsServer,
) -> None:
    server = await make_nats_server()
    nc = await nats.connect(
        server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1, name="broker-fault"
    )
    local_db: dict[str, Decision] = {}  # what each producer's local transaction decided
    deliveries: collections.Counter[str] = collections.Counter()

    async def checker(view: CheckView) -> Decision:
        return local_db.get(view.txid, Decision.ROLLBACK)

    async def handle(message: ConsumedMessage) -> None:
        deliveries[message.txid or ""] += 1

    numbers = itertools.count()
    sending = True

    async def produce(producer: TransactionProducer) -> None:
        while sending:
            n = next(numbers)
            decision = Decision.ROLLBACK if n % 4 == 0 else Decision.COMMIT

            def local(message: TxMessage, arg: object, decision: Decision = decision) -> Decision:
                txid = message.keys[0]
                local_db[txid] = decision
                return decision

            txn = producer.begin()
            try:
                await txn.send(TxMessage("orders", str(n).encode(), keys=[txn.txid]))
            except TxActorsError:
                await anyio.sleep(0.05)  # the load's pace: prepare failed, nothing happened
                continue
            await txn.end(local(TxMessage("orders", b"", keys=[txn.txid]), None))

    try:
        async with (
            run_coordinator(nc, config=CoordinatorConfig(**FAST)),
            Consumer(nc, "orders", "audit", handle, concurrency=8),
            TransactionProducer(nc, "shop", checker, request_timeout=2.0) as producer,
        ):
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(produce, producer)
                # The scenario: a second of load, a second without the server, two with it back.
                await anyio.sleep(1.0)
                await server.kill()
                await anyio.sleep(1.0)
                await server.start()
                await anyio.sleep(2.0)
                sending = False
            committed = {t for t, d in local_db.items() if d is Decision.COMMIT}
            rolled_back = {t for t, d in local_db.items() if d is Decision.ROLLBACK}
            assert len(committed) > 20 and rolled_back, "the run did real work on both sides"
            await eventually(
                lambda: committed <= set(deliveries), timeout=60, what="every commit delivered"
            )
            ids = await topic_ids(nc, "orders")
        assert set(deliveries) == committed, "every committed one, and no rolled-back one"
        assert len(ids) == len(set(ids)) == len(committed), "the topic holds each one once"
    finally:
        await nc.close()


def _txid_on(partition: int, partitions: int, name: str) -> str:
    """A txid that hashes to `partition`."""
    return next(
        txid
        for i in itertools.count()
        if layout.partition_of(txid := f"{name}-{i}", partitions) == partition
    )


async def _commit_once_up(
    client: CoordinatorClient, partition: int, partitions: int, timeout: float
) -> None:
    """Prepare and commit a transaction, trying again (a new one) until the partition is back."""
    attempts = itertools.count()

    async def commit_one() -> str:
        txid = _txid_on(partition, partitions, f"probe-{next(attempts)}")
        prepared = await client.prepare_ref.ask(
            Prepare(
                txid=txid, group="g", producer="p1", messages=[message()], version=PROTOCOL_VERSION
            ),
            timeout=1.0,
        )
        return (await client.end(txid, prepared.token, Decision.COMMIT, timeout=1.0)).state

    state = await eventually(
        commit_one,
        until=lambda _: True,
        ignoring=(ActorDeadError, AskTimeout, CommandError),
        timeout=timeout,
        interval=0.05,
        what=f"a commit on partition {partition}",
    )
    assert state == "committed"


async def test_in_flight_writes_resume_within_seconds_of_the_broker_return(
    make_nats_server: MakeNatsServer,
) -> None:
    """1,000 halves in flight (a pack per prepare) when nats-server is SIGKILLed: after it
    is back, every partition commits again within seconds (the lost acks fail at once, they
    do not each wait out a timeout), and the re-issued packs are not stored twice."""
    partitions, prepares, per_prepare = 2, 100, 10
    server = await make_nats_server()
    nc = await nats.connect(server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    clients = [CoordinatorClient(nc, p) for p in range(partitions)]
    answered: list[Prepared | CommandError] = []

    async def prepare(n: int) -> None:
        txid = f"inflight-{n}"
        client = clients[layout.partition_of(txid, partitions)]
        messages = [message() for _ in range(per_prepare)]
        command = Prepare(
            txid=txid, group="g", producer="p1", messages=messages, version=PROTOCOL_VERSION
        )
        with contextlib.suppress(ActorDeadError, AskTimeout):
            try:
                answered.append(await client.prepare_ref.ask(command, timeout=30))
            except CommandError as refused:  # told to come back, or `timeout`: answered
                answered.append(refused)

    try:
        async with run_coordinator(
            nc,
            config=CoordinatorConfig(transaction_timeout=600, max_immunity=600),
            options=CoordinatorOptions(partitions=partitions),
        ):
            for p in range(partitions):  # warm up: the topic stream exists, partitions serve
                await _commit_once_up(clients[p], p, partitions, timeout=10)
            freezer = await anyio.open_process(
                [
                    sys.executable,
                    "-m",
                    "tests.peers.freezer",
                    server.url,
                    "txn.coord.*.prepare.*",
                    str(server.pid),
                ]
            )
            assert freezer.stdout is not None
            lines = BufferedByteReceiveStream(freezer.stdout)
            with structlog.testing.capture_logs() as logs:
                async with anyio.create_task_group() as tg:
                    with anyio.fail_after(10):
                        assert await lines.receive_until(b"\n", 100) == b"ready"
                    for n in range(prepares):
                        tg.start_soon(prepare, n)
                    with anyio.fail_after(10):
                        assert await lines.receive_until(b"\n", 100) == b"frozen"
                    await server.kill()  # acks of the frozen server's appends are lost
                    await freezer.wait()
                    await anyio.sleep(0.5)  # the scenario: the server stays down a moment
                    await server.start()
                    back = time.monotonic()
                    async with anyio.create_task_group() as probes:
                        for p in range(partitions):
                            probes.start_soon(_commit_once_up, clients[p], p, partitions, 60)
                    recovered = time.monotonic() - back
            print(f"every partition committed {recovered:.2f} s after nats-server was back")
            assert recovered < 15.0
            reissued = [e for e in logs if e["event"] == "appends_reissued"]
            assert reissued, "some appends were in flight when the server died"
            assert max(e["appends"] for e in reissued) > 1, "pending acks failed together"
            assert answered, "core NATS may lose a request in the dead server, not all of them"
            assert any(isinstance(a, Prepared) for a in answered), "some waited and were stored"
            js = nc.jetstream()
            packs = [
                m
                for p in range(partitions)
                async for m in read_subject(js, layout.half_stream(p), layout.half_subject(p), 1)
            ]
            ids = [(m.headers or {})[layout.MSG_ID_HEADER] for m in packs]
            assert len(ids) == len(set(ids)), "a re-issued pack was not stored twice"
            halves = [
                (h.txid, h.half.index)
                for m in packs
                for h in read_halves(m.metadata.sequence.stream, m.headers or {}, m.data)
            ]
            assert len(halves) == len(set(halves)), "nor any half twice"
            stored = {
                (p.txid, i) for p in answered if isinstance(p, Prepared) for i in range(per_prepare)
            }
            assert stored <= set(halves), "every prepare confirmed has its halves stored"
    finally:
        await nc.close()
