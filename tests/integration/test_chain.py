"""A handler that sends (`sends=`, `apply_and_send`): the input applied once, what it sends
published if and only if its change commits, over redeliveries, exceptions and check-backs.
Run with the `txactors_*` fixtures, as a user's own tests would; a process killed at each
step is tests/integration/test_chain_kill.py."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import msgspec
import pytest
import pytest_asyncio

from tests.support.txlogs import backend
from tests.support.txn import topic_ids
from tests.support.wait import eventually
from txactors import (
    ConfigError,
    ConfigTypeError,
    ConsumedMessage,
    Decision,
    Outbox,
    PrepareFailed,
    TxApp,
    TxMessage,
    apply_and_send,
)
from txactors.app.chain import chained_txid
from txactors.ops.txn import list_transactions
from txactors.producer.txlog.sqlite import SqliteTxLog
from txactors.testing import ManualClock
from txactors.wire.protocol import ErrorCode


class OrderPaid(msgspec.Struct):
    order_id: int


class ShipmentBooked(msgspec.Struct):
    order_id: int
    txid: str


@pytest_asyncio.fixture
async def txlog(tmp_path: Path) -> AsyncIterator[SqliteTxLog]:
    async with SqliteTxLog(tmp_path / "logistics.db", "logistics") as log:
        await log.connection.execute(
            "CREATE TABLE shipments (order_id INTEGER PRIMARY KEY, txid TEXT NOT NULL)"
        )
        yield log


async def shipments(txlog: SqliteTxLog) -> list[tuple[int, str]]:
    cursor = await txlog.connection.execute("SELECT order_id, txid FROM shipments")
    return [(int(row[0]), str(row[1])) for row in await cursor.fetchall()]


async def pay(producer: Any, order_id: int) -> None:
    async with producer.begin() as txn:
        await txn.send(TxMessage("orders", msgspec.msgpack.encode(OrderPaid(order_id))))


def logistics(txlog: SqliteTxLog, *, fail_first: bool = False) -> TxApp:
    app = TxApp("logistics")
    attempts: list[int] = []

    @app.consumer("orders", sends=txlog, retry_delays=[0.05])
    async def book(
        order: OrderPaid, conn: aiosqlite.Connection, out: Outbox[aiosqlite.Connection]
    ) -> None:
        await conn.execute("INSERT INTO shipments VALUES (?, ?)", (order.order_id, out.txid))
        booked = ShipmentBooked(order.order_id, out.txid)
        await out.send(TxMessage("shipments", msgspec.msgpack.encode(booked)))
        attempts.append(order.order_id)
        if fail_first and len(attempts) == 1:
            raise RuntimeError("the handler failed after its send")

    return app


async def test_a_paid_order_books_one_shipment_and_sends_it_under_its_derived_txid(
    txlog: SqliteTxLog,
    txactors_coordinator: Any,
    txactors_producer: Any,
    txactors_consumer: Any,
    txactors_app: Any,
) -> None:
    booked = await txactors_consumer("shipments", "notifications")
    handled = await txactors_app(logistics(txlog))
    shop = await txactors_producer("shop", lambda view: Decision.COMMIT)
    await pay(shop, 42)
    [paid] = await handled.wait(1)
    [message] = await booked.wait(1)
    txid = chained_txid("logistics", paid.msg_id, 1)
    assert message.txid == txid
    assert message.decode(ShipmentBooked) == ShipmentBooked(42, txid)
    assert await shipments(txlog) == [(42, txid)]
    assert await txlog.lookup(txid) == "committed"


async def test_a_handler_that_raises_after_its_send_sends_nothing_then_its_retry_commits(
    txlog: SqliteTxLog,
    txactors_nc: Any,
    txactors_coordinator: Any,
    txactors_producer: Any,
    txactors_consumer: Any,
    txactors_app: Any,
) -> None:
    """The first delivery's transaction is rolled back with its change; the second delivery
    prepares a transaction of its own, which alone reaches the topic."""
    booked = await txactors_consumer("shipments", "notifications")
    handled = await txactors_app(logistics(txlog, fail_first=True))
    shop = await txactors_producer("shop", lambda view: Decision.COMMIT)
    await pay(shop, 7)
    [paid] = await handled.wait(1)
    assert paid.deliveries == 2
    [message] = await booked.wait(1)
    first, second = (chained_txid("logistics", paid.msg_id, n) for n in (1, 2))
    assert message.txid == second
    assert await shipments(txlog) == [(7, second)]
    assert await txlog.lookup(first) is None  # rolled back: no row, nothing to claim
    await eventually(lambda: topic_ids(txactors_nc, "shipments"), until=lambda ids: len(ids) == 1)
    assert [i.split(":")[0] for i in await topic_ids(txactors_nc, "shipments")] == [second]


def delivery(msg_id: str, deliveries: int) -> ConsumedMessage:
    return ConsumedMessage(
        topic="orders",
        tag=None,
        keys=(),
        txid="t",
        msg_id=msg_id,
        body=msgspec.msgpack.encode(OrderPaid(5)),
        headers={},
        deliveries=deliveries,
        stream_seq=1,
        committed_at=None,
        subject="topic.orders._",
    )


async def test_a_redelivery_of_an_applied_input_runs_nothing_and_sends_nothing(
    txlog: SqliteTxLog,
    txactors_nc: Any,
    txactors_coordinator: Any,
    txactors_producer: Any,
    txactors_consumer: Any,
) -> None:
    """As after a crash between the local commit and the ack: the second delivery finds the
    apply record and only acks."""
    await txlog.create_table()
    await txlog.create_applied_table()
    booked = await txactors_consumer("shipments", "notifications")
    producer = await txactors_producer("logistics", txlog.check)
    runs: list[str] = []

    async def work(conn: aiosqlite.Connection, out: Outbox[aiosqlite.Connection]) -> None:
        runs.append(out.txid)
        await conn.execute("INSERT INTO shipments VALUES (5, ?)", (out.txid,))
        await out.send(TxMessage("shipments", b"booked 5"))

    assert await apply_and_send(txlog, producer, "logistics", delivery("o:1", 1), work)
    assert not await apply_and_send(txlog, producer, "logistics", delivery("o:1", 2), work)
    assert runs == [chained_txid("logistics", "o:1", 1)]
    [message] = await booked.wait(1)
    assert message.txid == runs[0]
    assert await shipments(txlog) == [(5, runs[0])]
    assert await topic_ids(txactors_nc, "shipments") == [f"{runs[0]}:0"]


async def test_an_input_applied_without_a_send_records_no_transaction(
    txlog: SqliteTxLog, txactors_coordinator: Any, txactors_producer: Any
) -> None:
    await txlog.create_table()
    await txlog.create_applied_table()
    producer = await txactors_producer("logistics", txlog.check)

    async def work(conn: aiosqlite.Connection, out: Outbox[aiosqlite.Connection]) -> None:
        await conn.execute("INSERT INTO shipments VALUES (6, 'none')")

    assert await apply_and_send(txlog, producer, "logistics", delivery("o:2", 1), work)
    assert await txlog.lookup(chained_txid("logistics", "o:2", 1)) is None
    assert await shipments(txlog) == [(6, "none")]
    assert not await apply_and_send(txlog, producer, "logistics", delivery("o:2", 2), work)


async def test_a_prepared_attempt_whose_process_died_is_rolled_back_by_its_check_back(
    txlog: SqliteTxLog,
    txactors_clock: ManualClock,
    txactors_nc: Any,
    txactors_coordinator: Any,
    txactors_producer: Any,
    tmp_path: Path,
) -> None:
    """Delivery 1 prepared and never committed locally (its process gone): the check-back,
    answered by the log, rolls it back; delivery 2 commits its own."""
    await txlog.create_table()
    await txlog.create_applied_table()
    producer = await txactors_producer("logistics", txlog.check)
    first = chained_txid("logistics", "o:3", 1)
    async with producer.begin(txid=first) as txn:  # what the dead process had done
        await txn.send(TxMessage("shipments", b"booked 3, first try"))
        await txn.leave_unknown()

    async def work(conn: aiosqlite.Connection, out: Outbox[aiosqlite.Connection]) -> None:
        await conn.execute("INSERT INTO shipments VALUES (3, ?)", (out.txid,))
        await out.send(TxMessage("shipments", b"booked 3"))

    assert await apply_and_send(txlog, producer, "logistics", delivery("o:3", 2), work)
    txactors_clock.advance(6)  # the first attempt's check-back: no row, claimed, ROLLBACK
    await eventually(lambda: txlog.lookup(first), until=lambda found: found == "rolled_back")
    second = chained_txid("logistics", "o:3", 2)
    await eventually(lambda: topic_ids(txactors_nc, "shipments"), until=lambda ids: len(ids) == 1)
    assert await topic_ids(txactors_nc, "shipments") == [f"{second}:0"]


def test_an_outbox_parameter_needs_sends() -> None:
    app = TxApp("logistics")
    with pytest.raises(ConfigTypeError, match="only a handler declared with sends="):

        @app.consumer("orders")
        async def book(order: OrderPaid, out: Outbox[Any]) -> None: ...


def test_sends_a_producer_needs_its_log_as_idempotent() -> None:
    from txactors import TransactionProducer

    producer = TransactionProducer.__new__(TransactionProducer)
    with pytest.raises(ConfigError, match="needs idempotent="):
        TxApp("logistics").consumer("orders", sends=producer)


async def test_sends_something_else_is_refused_at_start(
    txactors_nc: Any, txactors_coordinator: Any
) -> None:
    app = TxApp("logistics")

    @app.consumer("orders", sends=lambda: "not a log")  # type: ignore[arg-type, return-value]
    async def book(order: OrderPaid) -> None: ...

    with pytest.raises(ConfigError, match="sends= takes a TxLog"):
        async with app.running(txactors_nc):
            pass


@pytest.mark.postgres
@pytest.mark.mariadb
@pytest.mark.parametrize("backend_name", ["asyncpg", "psycopg", "mariadb"])
async def test_two_deliveries_handled_at_once_apply_once_and_send_once(
    backend_name: str,
    tmp_path: Path,
    txactors_nc: Any,
    txactors_coordinator: Any,
    txactors_producer: Any,
) -> None:
    """Delivery 2 comes while delivery 1 still runs (its ack wait passed): the second's apply
    record waits on the first's row, then finds it taken; one change, one message."""
    db = backend(backend_name, tmp_path)
    group = f"logistics-{uuid.uuid4().hex[:8]}"
    try:
        txlog = await db.instance(group)
        await txlog.create_applied_table()
        producer = await txactors_producer(group, txlog.check)
        first_working, release = anyio.Event(), anyio.Event()

        async def work(conn: Any, out: Outbox[Any]) -> None:
            await db.write(conn, out.txid)
            await out.send(TxMessage("shipments", b"booked"))
            if out.txid == chained_txid(group, "o:9", 1):
                first_working.set()
                await release.wait()

        results: dict[int, bool] = {}

        async def handle(deliveries: int) -> None:
            message = delivery("o:9", deliveries)
            results[deliveries] = await apply_and_send(txlog, producer, group, message, work)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(handle, 1)
            await first_working.wait()
            tasks.start_soon(handle, 2)
            await anyio.sleep(0.3)  # the second is waiting on the first's apply record
            assert 2 not in results
            release.set()
        assert results == {1: True, 2: False}
        attempts = [chained_txid(group, "o:9", n) for n in (1, 2)]
        assert [await db.committed(txid) for txid in attempts] == [True, False]
        await eventually(
            lambda: topic_ids(txactors_nc, "shipments"), until=lambda ids: len(ids) == 1
        )
        assert await topic_ids(txactors_nc, "shipments") == [f"{attempts[0]}:0"]
    finally:
        await db.close()


async def test_a_delivery_whose_txid_the_coordinator_holds_is_refused_with_nothing_done(
    txlog: SqliteTxLog,
    txactors_nc: Any,
    txactors_clock: ManualClock,
    txactors_coordinator: Any,
    txactors_producer: Any,
) -> None:
    """Delivery numbers start again only if the group's durable consumer was deleted and
    made anew: then an attempt's derived txid may be one the coordinator holds. Its prepare
    is refused (`conflict`), the local transaction rolls back (no apply record, no log row,
    no change), and the next delivery prepares a txid of its own and commits."""
    await txlog.create_table()
    await txlog.create_applied_table()
    producer = await txactors_producer("logistics", txlog.check)
    held = chained_txid("logistics", "o:4", 1)
    async with producer.begin(txid=held) as txn:  # an attempt of the earlier consumer
        await txn.send(TxMessage("shipments", b"booked 4, earlier"))
        await txn.leave_unknown()

    async def work(conn: aiosqlite.Connection, out: Outbox[aiosqlite.Connection]) -> None:
        await conn.execute("INSERT INTO shipments VALUES (4, ?)", (out.txid,))
        await out.send(TxMessage("shipments", b"booked 4"))

    with pytest.raises(PrepareFailed, match=f"transaction {held} exists already") as refused:
        await apply_and_send(txlog, producer, "logistics", delivery("o:4", 1), work)
    assert refused.value.code == ErrorCode.CONFLICT
    assert await shipments(txlog) == []
    assert await txlog.lookup(held) is None
    assert await apply_and_send(txlog, producer, "logistics", delivery("o:4", 2), work)
    txactors_clock.advance(6)  # the held one's check-back: a failed send here, ROLLBACK
    second = chained_txid("logistics", "o:4", 2)
    await eventually(lambda: list_transactions(txactors_nc), until=lambda found: not found)
    assert await topic_ids(txactors_nc, "shipments") == [f"{second}:0"]
    assert await shipments(txlog) == [(4, second)]


async def test_sends_from_several_tasks_of_one_handler_are_one_transaction(
    txlog: SqliteTxLog,
    txactors_nc: Any,
    txactors_coordinator: Any,
    txactors_producer: Any,
) -> None:
    await txlog.create_table()
    await txlog.create_applied_table()
    producer = await txactors_producer("logistics", txlog.check)

    async def work(conn: aiosqlite.Connection, out: Outbox[aiosqlite.Connection]) -> None:
        async with anyio.create_task_group() as tasks:
            for n in range(3):
                tasks.start_soon(out.send, TxMessage("shipments", f"part {n}".encode()))

    assert await apply_and_send(txlog, producer, "logistics", delivery("o:5", 1), work)
    txid = chained_txid("logistics", "o:5", 1)
    assert await txlog.lookup(txid) == "committed"
    await eventually(lambda: topic_ids(txactors_nc, "shipments"), until=lambda ids: len(ids) == 3)
    assert sorted(await topic_ids(txactors_nc, "shipments")) == [f"{txid}:{n}" for n in range(3)]


async def test_a_producer_of_your_own_sends_with_its_log_as_idempotent(
    txlog: SqliteTxLog,
    txactors_coordinator: Any,
    txactors_producer: Any,
    txactors_consumer: Any,
    txactors_app: Any,
) -> None:
    """`sends=producer, idempotent=txlog`: the app starts no producer of its own."""
    booked = await txactors_consumer("shipments", "notifications")
    mine = await txactors_producer("logistics", txlog.check)
    app = TxApp("logistics")

    @app.consumer("orders", sends=lambda: mine, idempotent=txlog)
    async def book(order: OrderPaid, out: Outbox[Any]) -> None:
        await out.send(TxMessage("shipments", msgspec.msgpack.encode(ShipmentBooked(1, out.txid))))

    await txactors_app(app)
    shop = await txactors_producer("shop", lambda view: Decision.COMMIT)
    await pay(shop, 1)
    [message] = await booked.wait(1)
    assert message.decode(ShipmentBooked).txid == message.txid
    assert not app._producers  # none of its own
