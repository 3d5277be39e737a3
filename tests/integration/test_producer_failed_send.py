"""A transaction with a failed send is never committed, whoever decides it.

Against a real nats-server and coordinator (fast check-backs): the first send of a
transaction is stored, the second fails (refused: a topic the group's tenant policy does
not give it; or cancelled while its prepare is out, when its half may be stored too), and
then the caller drops the transaction, leaves it unknown, or abandons its block. The user's
checker would answer COMMIT, which would publish the first half alone: the producer must
settle it as a rollback without asking the checker, and nothing may reach the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import structlog
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from nats.aio.client import Client

from tests.support.txn import FAST, topic_ids
from txactors.actors import RemoteActorRef
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError, ConfigError, PrepareFailed
from txactors.nats.client import connect
from txactors.producer import CheckView, Decision, Transaction, TransactionProducer, TxMessage
from txactors.producer.failed_sends import MAX_REASON_LENGTH, FailedSends
from txactors.wire.layout import admin_subject, partition_of
from txactors.wire.protocol import PROTOCOL_VERSION, ErrorCode, ShowTransaction, TransactionInfo

GROUP = "shop"
TOPIC = "orders"
POLICY = {GROUP: [TOPIC]}
"""The tenant policy: the group may write `orders` only, so a prepare into `secrets` is
refused `forbidden` by the coordinator, every time."""


class CommittingChecker:
    """What a checker that finds the local transaction committed says: COMMIT."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def __call__(self, view: CheckView) -> Decision:
        self.asked.append(view.txid)
        return Decision.COMMIT


@asynccontextmanager
async def shop(nc: Client, checker: CommittingChecker) -> AsyncIterator[TransactionProducer]:
    """The coordinator with the tenant policy, and the group's producer on a connection of its
    own with the group's inbox: with a policy, the coordinator answers a group nowhere else."""
    options = CoordinatorOptions(group_topics=POLICY)
    assert nc.connected_url is not None
    url = f"nats://{nc.connected_url.hostname}:{nc.connected_url.port}"
    producer_nc = await connect(url, name=GROUP, inbox_prefix=f"_INBOX.{GROUP}")
    try:
        async with (
            run_coordinator(nc, config=CoordinatorConfig(check_max=50, **FAST), options=options),
            TransactionProducer(producer_nc, GROUP, checker, request_timeout=5.0) as producer,
        ):
            yield producer
    finally:
        await producer_nc.close()


async def final_state(nc: Client, txid: str) -> str:
    """What the coordinator decided, once it did (the check-backs run every 0.1 s)."""
    admin = RemoteActorRef(nc, admin_subject(partition_of(txid, 1)), TransactionInfo)
    with anyio.fail_after(30):
        while True:
            try:
                await admin.ask(ShowTransaction(txid=txid, version=PROTOCOL_VERSION), timeout=5)
            except CommandError as finished:  # no longer open: "<txid>: it is <state>"
                assert finished.code == ErrorCode.NOT_FOUND, finished
                return finished.message.rsplit(" ", 1)[-1]
            await anyio.sleep(0.05)


# -- the second send fails -----------------------------------------------------------------


async def refused(nc: Client, txn: Transaction) -> None:
    """The coordinator refuses the prepare: a topic the group may not write."""
    try:
        await txn.send(TxMessage("secrets", b"not the shop's"))
    except PrepareFailed as error:  # not held after the return: nothing keeps `txn` alive
        assert error.code == ErrorCode.FORBIDDEN
        return
    raise AssertionError("the coordinator accepted a topic its policy forbids")


async def cancelled_while_out(nc: Client, txn: Transaction) -> None:
    """The caller's task is cancelled once the prepare is on its way: published on the
    producer's connection, which sends it whatever happens to the caller. The coordinator may
    store its half (it does here: it writes and fsyncs before it replies), but the producer
    never learns it did. (Watching for the request on a subscription of the test's own timed
    out now and then in full-suite runs, the send having gone through.)"""
    producer_nc = txn._client._nc
    publish = producer_nc.publish
    on_its_way = asyncio.Event()

    async def publish_and_tell(*args: Any, **kwargs: Any) -> None:
        await publish(*args, **kwargs)
        on_its_way.set()

    producer_nc.publish = publish_and_tell  # type: ignore[method-assign]
    try:
        task = asyncio.ensure_future(txn.send(TxMessage(TOPIC, b"second")))
        await asyncio.wait_for(on_its_way.wait(), timeout=10)
    finally:
        del producer_nc.publish  # the class's again
    task.cancel()  # before the reply: the coordinator writes (and fsyncs) first
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert task.cancelled()
    del task  # it holds the CancelledError, whose traceback holds the transaction


FAILURES: dict[str, Callable[[Client, Transaction], Awaitable[None]]] = {
    "refused": refused,
    "cancelled while its prepare is out": cancelled_while_out,
}


# -- the caller then gives up on it ---------------------------------------------------------


async def dropped(nc: Client, p: TransactionProducer, fail: str) -> str:
    txn = p.begin()
    txid = txn.txid
    await txn.send(TxMessage(TOPIC, b"first"))
    await FAILURES[fail](nc, txn)
    del txn  # never ended: only the check-back can settle it
    gc.collect()
    assert txid not in p._client.in_flight  # dropped: the check-back is no longer UNKNOWN
    return txid


async def left_unknown(nc: Client, p: TransactionProducer, fail: str) -> str:
    async with p.begin() as txn:
        await txn.send(TxMessage(TOPIC, b"first"))
        await FAILURES[fail](nc, txn)
        await txn.leave_unknown()  # nothing is left to decide: it rolls back at once
    return txn.txid


async def block_cancelled(nc: Client, p: TransactionProducer, fail: str) -> str:
    txids: list[str] = []
    with anyio.CancelScope() as scope:
        async with p.begin() as txn:
            txids.append(txn.txid)
            await txn.send(TxMessage(TOPIC, b"first"))
            await FAILURES[fail](nc, txn)
            scope.cancel()  # abandoned: no end is sent
            await anyio.sleep_forever()
    assert txids[0] not in p._client.in_flight
    return txids[0]


ENDINGS: dict[str, Callable[[Client, TransactionProducer, str], Awaitable[str]]] = {
    "dropped": dropped,
    "left unknown": left_unknown,
    "block cancelled": block_cancelled,
}


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("fail", FAILURES)
async def test_a_transaction_with_a_failed_send_is_rolled_back_whatever_the_checker_says(
    private_nc: Client, fail: str, ending: str
) -> None:
    checker = CommittingChecker()
    async with shop(private_nc, checker) as p:
        with structlog.testing.capture_logs() as logs:
            txid = await ENDINGS[ending](private_nc, p, fail)
            assert await final_state(private_nc, txid) == "rolled_back"
    assert checker.asked == []
    assert await topic_ids(private_nc, TOPIC) == []
    reason = {
        "refused": f"the coordinator refused the prepare of {txid}: forbidden",
        "cancelled while its prepare is out": "interrupted by CancelledError",
    }[fail]
    overruled = [e for e in logs if e["event"] == "check_rolled_back_after_failed_send"]
    if ending == "left unknown":
        assert overruled == []  # it rolled back at once: nothing was left to check
        [rolled_back] = [e for e in logs if e["event"] == "transaction_unknown_rolled_back"]
        assert rolled_back["reason"].startswith(reason)
    else:
        assert overruled, "the check-back was not answered from the failed send"
        assert all(e["reason"].startswith(reason) for e in overruled), overruled


async def test_a_transaction_without_a_failed_send_is_still_the_checkers(
    private_nc: Client,
) -> None:
    """The control: the same dropped transaction, every send stored, is committed by the
    checker's COMMIT; only a failed send takes the decision from it."""
    checker = CommittingChecker()
    async with shop(private_nc, checker) as p:
        txn = p.begin()
        txid = txn.txid
        await txn.send(TxMessage(TOPIC, b"first"))
        await txn.send(TxMessage(TOPIC, b"second"))
        del txn
        gc.collect()
        assert await final_state(private_nc, txid) == "committed"
    assert checker.asked[-1:] == [txid]
    assert await topic_ids(private_nc, TOPIC) == [f"{txid}:0", f"{txid}:1"]


# -- the record's bounds ---------------------------------------------------------------------


CAPACITY, MAX_AGE = 3, 10.0


class FailedSendsMachine(RuleBasedStateMachine):
    """However failures, forgets and time interleave, the record holds exactly the txids
    that failed within `max_age`, at most `capacity` of them (the newest), with the first
    reason each gave: never more (memory stays bounded), never fewer (a check-back it
    still owes is answered ROLLBACK)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.record = FailedSends(CAPACITY, MAX_AGE, clock=lambda: self.now)
        self.model: dict[str, tuple[float, str]] = {}  # in the order they failed

    def _expire(self) -> None:
        self.model = {t: e for t, e in self.model.items() if e[0] > self.now - MAX_AGE}

    @rule(txid=st.sampled_from("abcdef"), reason=st.text(max_size=400))
    def fail(self, txid: str, reason: str) -> None:
        self.record.add(txid, reason)
        self._expire()
        self.model.setdefault(txid, (self.now, reason[:MAX_REASON_LENGTH]))
        while len(self.model) > CAPACITY:
            del self.model[next(iter(self.model))]

    @rule(txid=st.sampled_from("abcdef"))
    def forget(self, txid: str) -> None:
        self.record.forget(txid)
        self.model.pop(txid, None)

    @rule(seconds=st.floats(0, 2 * MAX_AGE))
    def wait(self, seconds: float) -> None:
        self.now += seconds
        self._expire()

    @invariant()
    def holds_exactly_the_young_newest_failures(self) -> None:
        for txid in "abcdef":
            expected = self.model.get(txid)
            assert self.record.reason(txid) == (expected and expected[1])
        assert len(self.record) == len(self.model) <= CAPACITY


TestFailedSends = FailedSendsMachine.TestCase


def test_failed_sends_refuses_bounds_that_bound_nothing() -> None:
    with pytest.raises(ConfigError):
        FailedSends(capacity=0)
    with pytest.raises(ConfigError):
        FailedSends(max_age=0)
