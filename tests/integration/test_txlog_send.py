"""The one-call form `TxLog.send_in_transaction` against a real coordinator: the message
is delivered if and only if the business change committed, whatever happens at each step
(an exception, a cancellation, a failed commit, a producer SIGKILLed), with the check-back
served by the same process or by another instance of the group."""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from tests.peers.txlog_producer import TOPIC as KILL_TOPIC
from tests.support.partition import serving_partitions
from tests.support.txlogs import PG_DSN, Backend, SqliteBackend, backend
from tests.support.txn import FAST, topic_ids
from tests.support.wait import eventually
from txactors.actors import RemoteActorRef
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError, ConfigError, PrepareFailed, RolledBackByCheck
from txactors.faults import CRASH_EXIT_CODE, FAULT_ENV, FaultPoint
from txactors.observe.metrics import CoordinatorMetrics
from txactors.ops.txn import list_transactions, show
from txactors.producer import Transaction, TransactionProducer, TransactionResult, TxMessage
from txactors.producer.txlog.sqlite import SqliteLocal, SqliteTxLog
from txactors.testing import ManualClock
from txactors.wire import layout
from txactors.wire.layout import check_instance_subject
from txactors.wire.protocol import (
    CheckResult,
    CheckTransaction,
    Decision,
    Error,
    ErrorCode,
    Prepared,
)

pytestmark = [pytest.mark.postgres, pytest.mark.mariadb]  # the kill test runs on each

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "paid"
SETTLE = 30.0


@pytest_asyncio.fixture
async def sqlite(tmp_path: Path) -> AsyncIterator[SqliteBackend]:
    db = SqliteBackend(tmp_path / "shop.db")
    try:
        yield db
    finally:
        await db.close()


@asynccontextmanager
async def coordinated(nc: Client) -> AsyncIterator[None]:
    async with run_coordinator(nc, config=CoordinatorConfig(**FAST)):
        yield


async def none_open(nc: Client) -> None:
    """Until the coordinator holds no open transaction: every one is settled."""
    await eventually(
        lambda: list_transactions(nc),
        until=lambda open_ones: not open_ones,
        timeout=SETTLE,
        what="no open transaction",
    )


async def settled(nc: Client) -> set[str]:
    """The txids delivered on TOPIC once the coordinator holds no open transaction."""
    await none_open(nc)
    return {msg_id.split(":")[0] for msg_id in await topic_ids(nc, TOPIC)}


async def test_a_committed_work_is_delivered(private_nc: Client, sqlite: SqliteBackend) -> None:
    txlog = await sqlite.instance("shop")
    async with (
        coordinated(private_nc),
        TransactionProducer(private_nc, "shop", txlog.check) as producer,
    ):
        result = await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"42"), sqlite.write)
        assert result.state == "committed"
        assert await settled(private_nc) == {result.txid}
    assert await sqlite.committed(result.txid)
    assert await txlog.lookup(result.txid) == "committed"


async def test_a_failing_work_rolls_both_back(private_nc: Client, sqlite: SqliteBackend) -> None:
    txlog = await sqlite.instance("shop")
    txids: list[str] = []

    async def work(conn: Any, txid: str) -> None:
        txids.append(txid)
        await sqlite.write(conn, txid)
        raise ZeroDivisionError

    async with (
        coordinated(private_nc),
        TransactionProducer(private_nc, "shop", txlog.check) as producer,
    ):
        with pytest.raises(ZeroDivisionError):
            await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"42"), work)
        assert await settled(private_nc) == set()
    assert not await sqlite.committed(txids[0])
    assert await txlog.lookup(txids[0]) is None


async def test_a_cancelled_work_is_rolled_back_by_the_same_process_check(
    private_nc: Client, sqlite: SqliteBackend
) -> None:
    """Cancelled, the send ends nothing; the coordinator's check-back comes to this very
    process, whose log claims the txid: ROLLBACK, and nothing is delivered."""
    txlog = await sqlite.instance("shop")
    started = anyio.Event()
    txids: list[str] = []

    async def work(conn: Any, txid: str) -> None:
        txids.append(txid)
        await sqlite.write(conn, txid)
        await eventually(lambda: list_transactions(private_nc))  # the half is stored
        started.set()
        await anyio.sleep_forever()

    async with (
        coordinated(private_nc),
        TransactionProducer(private_nc, "shop", txlog.check) as producer,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(txlog.send_in_transaction, producer, TxMessage(TOPIC, b"42"), work)
            await started.wait()
            tg.cancel_scope.cancel()
        assert await settled(private_nc) == set()
    assert not await sqlite.committed(txids[0])
    assert await txlog.lookup(txids[0]) == "rolled_back"


class FlakyCommit(SqliteTxLog):
    """A log whose commit raises, after committing (`lost_reply`) or instead of it."""

    def __init__(self, path: Path, group: str, *, lost_reply: bool) -> None:
        super().__init__(path, group)
        self.lost_reply = lost_reply

    @asynccontextmanager
    async def local(self) -> AsyncIterator[SqliteLocal]:
        async with super().local() as local:
            commit = local.commit

            async def flaky() -> None:
                if self.lost_reply:
                    await commit()
                raise OSError("the connection dropped during COMMIT")

            local.commit = flaky  # type: ignore[method-assign]
            yield local


@pytest.mark.parametrize("lost_reply", [True, False])
async def test_a_commit_that_raises_is_settled_from_the_log(
    private_nc: Client, sqlite: SqliteBackend, lost_reply: bool
) -> None:
    await sqlite.instance("shop")  # the tables
    txids: list[str] = []

    async def work(conn: Any, txid: str) -> None:
        txids.append(txid)
        await sqlite.write(conn, txid)

    txlog = FlakyCommit(sqlite.path, "shop", lost_reply=lost_reply)
    async with (
        txlog,
        coordinated(private_nc),
        TransactionProducer(private_nc, "shop", txlog.check) as producer,
    ):
        if lost_reply:
            result = await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), work)
            assert result.state == "committed"
        else:
            with pytest.raises(OSError, match="dropped"):
                await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), work)
        delivered = await settled(private_nc)
    assert await sqlite.committed(txids[0]) is lost_reply
    assert delivered == ({txids[0]} if lost_reply else set())


async def test_a_txid_claimed_before_the_record_fails_before_the_work(
    private_nc: Client, sqlite: SqliteBackend
) -> None:
    """Another instance's check-back claims the txid once the half is stored, before the
    local transaction opens: the record fails on the key, the work never runs, and the
    messages are rolled back."""
    txlog = await sqlite.instance("shop")
    other = await sqlite.instance("shop")
    ran: list[str] = []

    async def work(conn: Any, txid: str) -> None:
        ran.append(txid)

    async with (
        coordinated(private_nc),
        TransactionProducer(private_nc, "shop", txlog.check) as producer,
    ):
        started, local = transactions_of(producer), txlog.local

        @asynccontextmanager
        async def lose_the_race_then_open() -> AsyncIterator[SqliteLocal]:
            [txn] = started
            await eventually(lambda: txn.seqs)  # the half is stored: a check can come
            assert await other.claim(txn.txid)  # the check-back got there first
            async with local() as opened:
                yield opened

        txlog.local = lose_the_race_then_open  # type: ignore[method-assign]
        with pytest.raises(RolledBackByCheck):
            await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), work)
        assert await settled(private_nc) == set()
    assert ran == []


async def test_the_log_and_the_producer_must_share_the_group(
    private_nc: Client, sqlite: SqliteBackend
) -> None:
    txlog = await sqlite.instance("shop")
    async with TransactionProducer(private_nc, "bank", txlog.check) as producer:
        with pytest.raises(ConfigError, match="group"):
            await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), sqlite.write)


# -- a producer SIGKILLed at each step, the check served by another instance -------------


KILL_POINTS = [  # in their order; the prepare is out from the start until AFTER_PREPARE
    FaultPoint.AFTER_TXLOG_RECORD,
    "in_work",
    FaultPoint.AFTER_LOCAL_WORK,
    FaultPoint.AFTER_PREPARE,
    FaultPoint.AFTER_LOCAL_COMMIT,
]


@pytest.mark.parametrize("backend_name", ["sqlite", "asyncpg", "mariadb"])
@pytest.mark.parametrize("point", KILL_POINTS)
async def test_a_producer_killed_at_each_step_delivers_iff_it_committed(
    make_nats_server: Any, tmp_path: Path, backend_name: str, point: str
) -> None:
    server = await make_nats_server()
    nc = await nats.connect(server.url)
    db: Backend = backend(backend_name, tmp_path)
    group = f"shop-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NATS_URL": server.url}
    mode = "kill" if point == "in_work" else "fault"
    if mode == "fault":
        env[FAULT_ENV] = point
    try:
        survivor = await db.instance(group)  # another instance of the group
        async with (
            run_coordinator(nc, config=CoordinatorConfig(**FAST)),
            TransactionProducer(nc, group, survivor.check),
        ):
            command = [sys.executable, "-m", "tests.peers.txlog_producer", server.url]
            peer = await anyio.open_process(
                [*command, backend_name, str(tmp_path), group, mode], cwd=ROOT, env=env
            )
            lines = await _died(peer, mode)
            txids = {line.split()[1] for line in lines if line.startswith("TXID")}
            await none_open(nc)
            delivered = {m.split(":")[0] for m in await topic_ids(nc, KILL_TOPIC)}
        committed = {txid for txid in txids if await db.committed(txid)}
        assert delivered == committed
        assert bool(committed) is (point == FaultPoint.AFTER_LOCAL_COMMIT), lines
    finally:
        await db.close()
        await nc.close()


async def _died(peer: anyio.abc.Process, mode: str) -> list[str]:
    """The peer's output lines once it is dead: by its fault point, or by our SIGKILL."""
    assert peer.stdout is not None
    lines: list[str] = []
    buffer = b""
    deadline = time.monotonic() + 60
    try:
        with anyio.fail_after(60):
            async for chunk in peer.stdout:
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                lines += [line.decode() for line in complete]
                if mode == "kill" and "WORKING" in lines:
                    peer.send_signal(signal.SIGKILL)
        code = await peer.wait()
    finally:
        if peer.returncode is None:
            peer.kill()
        await peer.aclose()
    assert time.monotonic() < deadline
    expected = -signal.SIGKILL if mode == "kill" else CRASH_EXIT_CODE
    assert code == expected, lines
    return lines


# -- the prepare is out while the local transaction runs -----------------------------------
#
# The halves reach the coordinator at once; their reply is held until the test releases it,
# so each step of the local transaction can be caught with the prepare still in flight.

OVERLAP_BACKENDS = ["asyncpg", "psycopg"]
"""SQLite awaits the prepare first (`serial_local`): see the test after these."""


@pytest_asyncio.fixture(params=OVERLAP_BACKENDS)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    opened = backend(request.param, tmp_path)
    try:
        yield opened
    finally:
        await opened.close()


class HeldPrepares:
    """Wraps a producer's prepares: each waits for `release` before it is sent (`before`)
    or after the coordinator answered (its reply held); `stored` is set once it was sent."""

    def __init__(self, producer: TransactionProducer, *, before: bool = False) -> None:
        self.entered = anyio.Event()
        self.stored = anyio.Event()
        self.release = anyio.Event()
        prepare = producer._client.prepare

        async def held(*args: Any) -> Prepared:
            self.entered.set()
            if before:
                await self.release.wait()
            try:
                return await prepare(*args)
            finally:
                self.stored.set()
                await self.release.wait()

        producer._client.prepare = held  # type: ignore[method-assign]


async def check_here(
    nc: Client, producer: TransactionProducer, txid: str, *, last: bool = False
) -> Decision:
    """A check-back for `txid`, asked of `producer`'s instance as the coordinator asks."""
    check = CheckTransaction(
        txid=txid, group=producer.group, check_id=1, check_times=0, messages=[], last=last
    )
    subject = check_instance_subject(producer.group, producer.instance)
    reply = await RemoteActorRef(nc, subject, CheckResult).ask(check, timeout=5)
    resolution: Decision = reply.resolution
    return resolution


def new_group() -> str:
    return f"shop-{uuid.uuid4().hex[:8]}"


async def test_a_failed_prepare_rolls_back_the_work_done_meanwhile(
    private_nc: Client, db: Backend
) -> None:
    """The work runs while the prepare is out; the coordinator then refuses the prepare:
    nothing is committed locally, and the check-back is ROLLBACK without the log."""
    group = new_group()
    txlog = await db.instance(group)
    written = anyio.Event()
    txids: list[str] = []

    async def work(conn: Any, txid: str) -> None:
        txids.append(txid)
        await db.write(conn, txid)
        written.set()

    refusal = Error(ErrorCode.BAD_REQUEST, "refused for the test")
    async with (
        serving_partitions(private_nc, refuse_prepare=lambda _: refusal),
        TransactionProducer(private_nc, group, txlog.check) as producer,
        anyio.create_task_group() as tg,
    ):
        held = HeldPrepares(producer, before=True)
        tg.start_soon(_release_on, written, held.release)
        with pytest.raises(PrepareFailed, match="refused for the test"):
            await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), work)
        assert await check_here(private_nc, producer, txids[0]) is Decision.ROLLBACK
    assert not await db.committed(txids[0])
    assert await txlog.lookup(txids[0]) is None  # the producer answered, not the log


async def _release_on(event: anyio.Event, release: anyio.Event) -> None:
    await event.wait()
    release.set()


async def test_a_check_while_the_work_runs_is_unknown(private_nc: Client, db: Backend) -> None:
    """Halves stored and the local transaction still running, with the prepare's reply on
    its way and after it came: the check-back is UNKNOWN, and the log is not asked."""
    group = new_group()
    txlog = await db.instance(group)
    answers: list[Decision] = []

    async with (
        coordinated(private_nc),
        TransactionProducer(private_nc, group, txlog.check) as producer,
    ):
        held, begun = HeldPrepares(producer), transactions_of(producer)

        async def work(conn: Any, txid: str) -> None:
            await db.write(conn, txid)
            with anyio.fail_after(SETTLE):
                await held.stored.wait()
            answers.append(await check_here(private_nc, producer, txid))  # reply held
            held.release.set()
            await eventually(lambda: begun[0].seqs)  # the reply came
            answers.append(await check_here(private_nc, producer, txid))

        result = await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), work)
        assert answers == [Decision.UNKNOWN, Decision.UNKNOWN]
        assert result.state == "committed"
        assert await settled(private_nc) == {result.txid}
    assert await db.committed(result.txid)
    assert await txlog.lookup(result.txid) == "committed"  # never claimed


CANCEL_STEPS = ["in the work, reply held", "in the work, prepared", "awaiting the prepare"]


@pytest.mark.parametrize("step", CANCEL_STEPS)
async def test_a_send_cancelled_at_each_step_is_settled_without_delivery(
    private_nc: Client, db: Backend, step: str
) -> None:
    """Cancelled before the local commit, with the prepare out or answered: nothing is
    committed, and the check-back rolls the stored halves back (the log claims the txid,
    or, when the cancel cut the prepare off, the producer answers for the failed send)."""
    group = new_group()
    txlog = await db.instance(group)
    txids: list[str] = []
    at_step = anyio.Event()

    async with (
        coordinated(private_nc),
        TransactionProducer(private_nc, group, txlog.check) as producer,
    ):
        held, begun = HeldPrepares(producer), transactions_of(producer)

        async def work(conn: Any, txid: str) -> None:
            txids.append(txid)
            await db.write(conn, txid)
            with anyio.fail_after(SETTLE):
                await held.stored.wait()
            await eventually(lambda: list_transactions(private_nc))  # the halves are stored
            if step == "in the work, prepared":
                held.release.set()
                await eventually(lambda: begun[0].seqs)  # the reply came
            at_step.set()
            if step != "awaiting the prepare":
                await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            tg.start_soon(txlog.send_in_transaction, producer, TxMessage(TOPIC, b"1"), work)
            with anyio.fail_after(SETTLE):
                await at_step.wait()  # awaiting the prepare: the send task waits on it now
            tg.cancel_scope.cancel()
        held.release.set()  # a prepare still out completes
        assert await settled(private_nc) == set()
        failed = producer._client.failed_sends.reason(txids[0])
    assert not await db.committed(txids[0])
    if step == "awaiting the prepare":  # the cancel reached the prepare: a failed send
        assert failed is not None and "interrupted" in failed
        assert await txlog.lookup(txids[0]) is None
    else:
        assert failed is None
        assert await txlog.lookup(txids[0]) == "rolled_back"


def transactions_of(producer: TransactionProducer) -> list[Transaction]:
    """The transactions `producer` begins from now on, to watch their sends."""
    begun: list[Transaction] = []
    begin = producer.begin

    def begin_and_keep(**options: Any) -> Transaction:
        begun.append(begin(**options))
        return begun[-1]

    producer.begin = begin_and_keep  # type: ignore[method-assign]
    return begun


async def test_a_oneway_end_does_not_hold_the_caller(
    private_nc: Client, sqlite: SqliteBackend
) -> None:
    """With the one-way end mode the call returns once the end is published: nobody
    answers ends here, and the result is unconfirmed (the check-back settles a lost end)."""
    txlog = await sqlite.instance("shop")
    async with (
        serving_partitions(private_nc, serve_end=False) as coord,
        TransactionProducer(
            private_nc, "shop", txlog.check, end_mode="oneway", request_timeout=30
        ) as producer,
    ):
        ends = await private_nc.subscribe(layout.end_filter(0))
        with anyio.fail_after(5):  # far less than the request timeout an acked end would wait
            result = await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), sqlite.write)
        end = await ends.next_msg(timeout=5)
        assert not end.reply  # published, not asked
        await ends.unsubscribe()
    assert (result.local_state, result.state) == (Decision.COMMIT, None)
    assert [prepare.txid for _, prepare in coord.prepares] == [result.txid]
    assert await sqlite.committed(result.txid)


async def test_on_sqlite_the_prepare_is_awaited_before_the_local_transaction(
    private_nc: Client, sqlite: SqliteBackend
) -> None:
    """Its local transactions take turns on one writer: a refused prepare runs no work, and
    a held one holds no writer (another local transaction commits meanwhile)."""
    txlog = await sqlite.instance("shop")
    ran: list[str] = []

    async def work(conn: Any, txid: str) -> None:
        ran.append(txid)

    refusal = Error(ErrorCode.BAD_REQUEST, "refused for the test")
    failures: list[BaseException] = []

    async def call() -> None:
        try:
            await txlog.send_in_transaction(producer, TxMessage(TOPIC, b"1"), work)
        except PrepareFailed as error:
            failures.append(error)

    async with (
        serving_partitions(private_nc, refuse_prepare=lambda _: refusal),
        TransactionProducer(private_nc, "shop", txlog.check) as producer,
        anyio.create_task_group() as tg,
    ):
        held = HeldPrepares(producer, before=True)
        tg.start_soon(call)
        with anyio.fail_after(SETTLE):
            await held.entered.wait()  # the prepare is held before it goes out
            async with txlog.local() as local:  # and the writer is free meanwhile
                await sqlite.write(local.connection, "meanwhile")
                await local.commit()
        held.release.set()
    assert ran == []
    assert [type(error) for error in failures] == [PrepareFailed]
    assert await sqlite.committed("meanwhile")


async def test_a_call_finding_no_free_connection_holds_none_while_its_prepare_travels(
    private_nc: Client, db: Backend
) -> None:
    """Where every connection of the pool is taken (`pool_exhausted`), the prepare is awaited
    before a connection is: freed meanwhile, the connections stay free for other calls, and
    the work runs only once the halves are stored. With a free connection, the prepare
    overlaps the work as before."""
    txlog = await db.instance(new_group())
    stored_when_working: list[bool] = []
    working = anyio.Event()

    async def work(conn: Any, txid: str) -> None:
        stored_when_working.append(held.stored.is_set())
        working.set()

    async with (
        serving_partitions(private_nc),
        TransactionProducer(private_nc, txlog.group, txlog.check) as producer,
        anyio.create_task_group() as tg,
    ):
        held = HeldPrepares(producer, before=True)
        async with AsyncExitStack() as taken:
            while not txlog.pool_exhausted():
                await taken.enter_async_context(txlog.local())
            tg.start_soon(txlog.send_in_transaction, producer, TxMessage(TOPIC, b"1"), work)
            with anyio.fail_after(SETTLE):
                await held.entered.wait()
        assert not txlog.pool_exhausted()  # every connection is free again
        # A negative to observe, so a bounded window: an overlapping call, queued for a
        # connection, is handed one and works within milliseconds (both drivers).
        with anyio.move_on_after(0.5):
            await working.wait()
        assert stored_when_working == []
        held.release.set()
        with anyio.fail_after(SETTLE):
            await working.wait()
        assert stored_when_working == [True]

        held = HeldPrepares(producer, before=True)
        working = anyio.Event()
        tg.start_soon(txlog.send_in_transaction, producer, TxMessage(TOPIC, b"2"), work)
        with anyio.fail_after(SETTLE):
            await working.wait()  # the pool has room: the work runs with the prepare held
        held.release.set()
    assert stored_when_working == [True, False]


# -- a local transaction that outlives the whole check schedule ----------------------------


@pytest.mark.parametrize("kind", ["sqlite", "asyncpg"])
async def test_the_last_check_claims_a_local_transaction_still_running(
    private_nc: Client, tmp_path: Path, kind: str
) -> None:
    """The work outlasts all `check_max` check-backs (on the coordinator's manual clock).
    The first three find it in flight: UNKNOWN. The last one, which would discard it,
    rolls it back instead, and the late local commit is refused as a claimed one is: the
    caller gets `RolledBackByCheck`, no business row, nothing delivered, nothing discarded."""
    db = backend(kind, tmp_path)
    registry = CollectorRegistry()
    clock = ManualClock()
    release = anyio.Event()
    txids: list[str] = []
    outcome: list[TransactionResult | Exception] = []

    async def work(conn: Any, txid: str) -> None:
        txids.append(txid)
        await db.write(conn, txid)
        await release.wait()

    def count(name: str) -> float:
        return registry.get_sample_value(name, {"partition": "0"}) or 0.0

    async def decided() -> bool:
        """Whether the coordinator decided; if not, the clock is moved to its next check."""
        if count("txactors_rollbacks_total") or count("txactors_discards_total"):
            return True
        if txids:
            info = await show(private_nc, txids[0])
            if info.state == "prepared" and info.next_check_at is not None:
                clock.advance(max(info.next_check_at - clock(), 0.0))
        return False

    try:
        txlog = await db.instance(new_group())
        async with (
            run_coordinator(
                private_nc,
                config=CoordinatorConfig(check_max=4),
                clock=clock,
                metrics=CoordinatorMetrics(registry),
            ),
            TransactionProducer(private_nc, txlog.group, txlog.check) as producer,
            anyio.create_task_group() as tg,
        ):

            async def send() -> None:
                try:
                    message = TxMessage(TOPIC, b"late")
                    outcome.append(await txlog.send_in_transaction(producer, message, work))
                except Exception as error:
                    outcome.append(error)

            tg.start_soon(send)
            await eventually(  # not_found while the prepare travels (asyncpg: overlapped)
                decided, timeout=SETTLE, ignoring=(CommandError,), what="the checks decided"
            )
            release.set()
            await eventually(lambda: outcome, timeout=SETTLE, what="the send returned")
            assert isinstance(outcome[0], RolledBackByCheck), outcome
            assert await settled(private_nc) == set()
        assert count("txactors_checks_inconclusive_total") == 3
        assert (count("txactors_rollbacks_total"), count("txactors_discards_total")) == (1, 0)
        assert not await db.committed(txids[0])
    finally:
        await db.close()


async def test_the_last_check_during_the_local_commit_waits_for_it(
    private_nc: Client, tmp_path: Path
) -> None:
    """The last check-back comes once the local commit has begun (held, on asyncpg): too
    late to claim, so the log answers, waiting on the recorded row: COMMIT, and delivered."""
    db = backend("asyncpg", tmp_path)
    committing, proceed = anyio.Event(), anyio.Event()
    answers: list[Decision] = []
    results: list[TransactionResult] = []
    txids: list[str] = []
    try:
        txlog = await db.instance(new_group())
        opened = txlog.local

        @asynccontextmanager
        async def held_commit() -> AsyncIterator[Any]:
            async with opened() as local:
                commit = local.commit

                async def held() -> None:
                    committing.set()
                    await proceed.wait()
                    await commit()

                local.commit = held  # type: ignore[method-assign]
                yield local

        async def work(conn: Any, txid: str) -> None:
            txids.append(txid)
            await db.write(conn, txid)

        txlog.local = held_commit  # type: ignore[method-assign]
        async with (
            coordinated(private_nc),
            TransactionProducer(private_nc, txlog.group, txlog.check) as producer,
            anyio.create_task_group() as tg,
        ):

            async def send() -> None:
                message = TxMessage(TOPIC, b"1")
                results.append(await txlog.send_in_transaction(producer, message, work))

            async def last_check() -> None:
                answers.append(await check_here(private_nc, producer, txids[0], last=True))

            tg.start_soon(send)
            with anyio.fail_after(SETTLE):
                await committing.wait()
            tg.start_soon(last_check)
            try:
                await eventually(claims_waiting, what="the log's claim waits on the row")
                assert answers == []
            finally:
                proceed.set()  # the commit is shielded: left held, it would never end
            await eventually(lambda: answers and results, what="the check and the send")
            assert answers == [Decision.COMMIT] and results[0].state == "committed"
            assert await settled(private_nc) == {txids[0]}
        assert await db.committed(txids[0])
    finally:
        await db.close()


async def claims_waiting() -> bool:
    """Whether a claim of the log waits on a row lock (PostgreSQL)."""
    conn = await asyncpg.connect(PG_DSN)
    try:
        waiting = await conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE '%INSERT INTO txactors_txlog%'"
        )
    finally:
        await conn.close()
    return bool(waiting)
