"""nats-server itself killed (SIGKILL) and restarted on the same store, mid-run.

Producers keep sending, the coordinator keeps deciding and the consumer keeps reading
across the outage; afterwards every transaction whose local side committed is delivered,
once as an idempotent consumer sees it, and no rolled-back one ever.
"""

from __future__ import annotations

import collections
import itertools

import anyio
import nats
import pytest

from tests.conftest import MakeNatsServer
from tests.support.txn import FAST, topic_ids
from txactors.consumer import ConsumedMessage, Consumer
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.errors import TxActorsError
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage

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
                await anyio.sleep(0.05)  # prepare failed: nothing happened, try again
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
                await anyio.sleep(1.0)
                await server.kill()
                await anyio.sleep(1.0)
                await server.start()
                await anyio.sleep(2.0)
                sending = False
            committed = {t for t, d in local_db.items() if d is Decision.COMMIT}
            rolled_back = {t for t, d in local_db.items() if d is Decision.ROLLBACK}
            assert len(committed) > 20 and rolled_back, "the run did real work on both sides"
            with anyio.fail_after(60):
                while not committed <= set(deliveries):
                    await anyio.sleep(0.1)
            ids = await topic_ids(nc, "orders")
        assert set(deliveries) == committed, "every committed one, and no rolled-back one"
        assert len(ids) == len(set(ids)) == len(committed), "the topic holds each one once"
    finally:
        await nc.close()
