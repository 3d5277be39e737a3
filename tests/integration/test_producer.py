"""The producer against a real nats-server and a stand-in coordinator.

This is a protocol test of the producer: the coordinator actor is built separately, so the
partition stand-in of tests/support/partition.py, served with `serve()`, records every
command and answers as the protocol says (tokens, conflicts, states). End-to-end tests
with the real coordinator (delivery, check-backs driven by its checker, crashes) live with
the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import anyio
import msgspec
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.support.partition import STATE_AFTER, serving_partitions
from tests.support.wait import eventually, within
from txactors.actors import RemoteActorRef
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError, EndRefused, PrepareFailed, TransactionStateError
from txactors.producer import CheckView, EndMode, Transaction, TransactionProducer, TxMessage
from txactors.wire.layout import (
    check_group_subject,
    check_instance_subject,
    end_subject,
    partition_of,
    prepare_subject,
)
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    CheckedMessage,
    CheckResult,
    CheckTransaction,
    Decision,
    EndTransaction,
    Error,
    ErrorCode,
    Prepare,
    encode,
)


class Transfer(msgspec.Struct):
    account: str
    amount: int


# -- producers and checkers --------------------------------------------------------------------


class RecordingChecker:
    def __init__(self, answer: Any = Decision.COMMIT) -> None:
        self.answer = answer
        self.views: list[CheckView] = []

    async def __call__(self, view: CheckView) -> Decision:
        self.views.append(view)
        if isinstance(self.answer, Exception):
            raise self.answer
        result: Decision = self.answer
        return result


class LocalSpy:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, msg: Any, arg: Any) -> Decision:
        self.calls.append(msg)
        return Decision.COMMIT


def new_group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def producer(nc: Client, group: str | None = None, **kwargs: Any) -> TransactionProducer:
    kwargs.setdefault("request_timeout", 1.0)
    checker = kwargs.pop("checker", RecordingChecker())
    return TransactionProducer(nc, group or new_group(), checker, **kwargs)


def message(topic: str = "payments", **kwargs: Any) -> TxMessage:
    return TxMessage(topic, kwargs.pop("body", b"hello"), **kwargs)


def check_for(group: str, txid: str | None = None, check_id: int = 7) -> CheckTransaction:
    body = msgspec.msgpack.encode(Transfer("A", 10))
    return CheckTransaction(
        txid=txid or uuid.uuid4().hex,
        group=group,
        check_id=check_id,
        check_times=2,
        messages=[
            CheckedMessage(
                index=0, topic="payments", body=body, keys=["k1"], tag="t", properties={"p": "v"}
            )
        ],
    )


async def ask_instance(nc: Client, p: TransactionProducer, check: CheckTransaction) -> Any:
    subject = check_instance_subject(p.group, p.instance)
    return await RemoteActorRef(nc, subject, CheckResult).ask(check, timeout=2)


def events(logs: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == name]


# -- send_in_transaction -----------------------------------------------------------------------


async def commit(msg: Any, arg: Any) -> Decision:
    return Decision.COMMIT


async def rollback(msg: Any, arg: Any) -> Decision:
    return Decision.ROLLBACK


async def unknown(msg: Any, arg: Any) -> Decision:
    return Decision.UNKNOWN


def explode(msg: Any, arg: Any) -> Decision:  # a plain function works too
    raise RuntimeError("database is down")


async def not_a_decision(msg: Any, arg: Any) -> Any:
    return True


@pytest.mark.parametrize(
    ("local", "local_state"),
    [
        (commit, Decision.COMMIT),
        (rollback, Decision.ROLLBACK),
        (unknown, Decision.UNKNOWN),
        (explode, Decision.UNKNOWN),
        (not_a_decision, Decision.UNKNOWN),
    ],
)
async def test_send_in_transaction_prepares_runs_the_local_transaction_and_ends_with_it(
    nc: Client, local: Any, local_state: Decision
) -> None:
    seen: list[tuple[Any, Any]] = []

    def local_transaction(msg: Any, arg: Any) -> Any:
        seen.append((msg, arg))
        return local(msg, arg)  # a coroutine or a plain result: both are accepted

    sent = message(body=Transfer("A", 10), keys=["order-1"], tag="paid", properties={"x": "1"})
    async with serving_partitions(nc) as coord, producer(nc) as p:
        with structlog.testing.capture_logs() as logs:
            result = await p.send_in_transaction(sent, local_transaction, arg="ctx")

    assert seen == [(sent, "ctx")]
    [(_, prepare)] = coord.prepares
    assert (prepare.group, prepare.producer, prepare.token) == (p.group, p.instance, None)
    [outgoing] = prepare.messages
    assert msgspec.msgpack.decode(outgoing.body, type=Transfer) == Transfer("A", 10)
    assert (outgoing.keys, outgoing.tag, outgoing.properties) == (["order-1"], "paid", {"x": "1"})
    [end] = coord.ends
    assert (end.txid, end.token, end.decision) == (
        result.txid,
        coord.tokens[result.txid],
        local_state,
    )
    assert (result.local_state, result.state, result.seqs) == (
        local_state,
        STATE_AFTER[local_state],
        (1,),
    )
    assert result.confirmed
    if local is explode:
        [failure] = events(logs, "local_transaction_failed")
        assert failure["exc_info"] is True
    if local is not_a_decision:
        assert events(logs, "local_transaction_bad_result")


async def test_a_refused_prepare_raises_and_the_local_transaction_does_not_run(
    nc: Client,
) -> None:
    local = LocalSpy()
    refuse = lambda _: Error(ErrorCode.BAD_REQUEST, "topic too long")  # noqa: E731
    async with serving_partitions(nc, refuse_prepare=refuse) as coord, producer(nc) as p:
        with pytest.raises(PrepareFailed, match="topic too long") as caught:
            await p.send_in_transaction(message(), local)
    assert caught.value.code == ErrorCode.BAD_REQUEST
    assert local.calls == []
    assert coord.ends == []


async def test_an_unreachable_coordinator_fails_the_prepare_and_its_check_is_rolled_back(
    nc: Client,
) -> None:
    local = LocalSpy()
    checker = RecordingChecker(Decision.COMMIT)
    async with producer(nc, checker=checker) as p:
        with pytest.raises(PrepareFailed, match="did not confirm") as caught:
            await p.send_in_transaction(message(), local)
        assert caught.value.code is None
        # Halves might have been stored after all: this instance knows the answer.
        reply = await ask_instance(nc, p, check_for(p.group, caught.value.txid))
    assert local.calls == []
    assert reply.resolution is Decision.ROLLBACK
    assert checker.views == []


async def test_an_end_that_cannot_reach_the_coordinator_is_logged_and_left_to_the_check(
    nc: Client,
) -> None:
    checker = RecordingChecker(Decision.ROLLBACK)
    async with serving_partitions(nc, serve_end=False), producer(nc, checker=checker) as p:
        with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as logs:
            result = await p.send_in_transaction(message(), commit)
        reply = await ask_instance(nc, p, check_for(p.group, result.txid))

    assert (result.local_state, result.state, result.confirmed) == (Decision.COMMIT, None, False)
    [warning] = events(logs, "end_unconfirmed")
    assert (warning["txid"], warning["decision"]) == (result.txid, Decision.COMMIT)
    # The check-back gets the local decision, not the checker's guess.
    assert reply == CheckResult(txid=result.txid, check_id=7, resolution=Decision.COMMIT)
    assert checker.views == []


async def test_an_end_the_coordinator_could_not_apply_is_retried_by_ending_again(
    nc: Client,
) -> None:
    checker = RecordingChecker(Decision.ROLLBACK)
    failing = Error(ErrorCode.INTERNAL, "op stream unavailable")
    async with (
        serving_partitions(nc, refuse_end=failing) as coord,
        producer(nc, checker=checker) as p,
    ):
        async with p.begin() as txn:
            await txn.send(message())
            assert not (await txn.commit()).confirmed
            coord.refuse_end = None
            assert (await txn.commit()).state == "committed"
        # Confirmed now: the coordinator's word counts, so a check asks the checker again.
        reply = await ask_instance(nc, p, check_for(p.group, txn.txid))
    assert [e.decision for e in coord.ends] == [Decision.COMMIT, Decision.COMMIT]
    assert reply.resolution is Decision.ROLLBACK
    assert len(checker.views) == 1


async def test_a_refused_end_raises_end_refused(nc: Client) -> None:
    conflict = Error(ErrorCode.CONFLICT, "already rolled back")
    async with serving_partitions(nc, refuse_end=conflict), producer(nc) as p:
        with pytest.raises(EndRefused, match="already rolled back") as caught:
            await p.send_in_transaction(message(), commit)
    assert caught.value.code == ErrorCode.CONFLICT


async def test_a_oneway_end_is_published_without_a_reply_subject_and_remembered(
    nc: Client,
) -> None:
    checker = RecordingChecker(Decision.ROLLBACK)
    async with serving_partitions(nc, serve_end=False), producer(nc, checker=checker) as p:
        subscription = await nc.subscribe(end_subject(0, p.group))
        await nc.flush()
        async with p.begin(end_mode="oneway") as txn:
            await txn.send(message())
        end = await subscription.next_msg(timeout=5)
        await subscription.unsubscribe()
        # Nothing confirms a one-way end: a check-back gets the decision this producer kept.
        reply = await ask_instance(nc, p, check_for(p.group, txn.txid))
    assert txn.result is not None
    assert (txn.result.local_state, txn.result.state) == (Decision.COMMIT, None)
    assert end.reply == ""
    command = msgspec.msgpack.decode(end.data, type=EndTransaction)
    assert (command.txid, command.decision, command.version) == (
        txn.txid,
        Decision.COMMIT,
        PROTOCOL_VERSION,
    )
    assert reply.resolution is Decision.COMMIT
    assert checker.views == []


async def test_the_end_mode_is_the_producers_unless_a_transaction_chooses(nc: Client) -> None:
    async with serving_partitions(nc) as coord, producer(nc, end_mode=EndMode.ONEWAY) as p:
        oneway = await p.send_in_transaction(message(), commit)
        async with p.begin(end_mode="ack") as txn:
            await txn.send(message())
        await eventually(  # the one-way end has no answer to wait for
            lambda: len(coord.ends) >= 2, what="both ends received"
        )
    assert (oneway.state, oneway.confirmed) == (None, False)
    assert txn.result is not None and txn.result.state == "committed"
    assert all(end.version == PROTOCOL_VERSION for end in coord.ends)
    assert all(prepare.version == PROTOCOL_VERSION for _, prepare in coord.prepares)
    with pytest.raises(ValueError, match="end_mode must be one of 'ack', 'oneway'"):
        producer(nc, end_mode="fire-and-forget")


async def test_transactions_go_to_the_partition_of_their_txid(private_nc: Client) -> None:
    nc = private_nc  # a server of its own: the session's coordinators have 1 partition
    async with serving_partitions(nc, partitions=3) as coord, producer(nc) as p:
        results = [await p.send_in_transaction(message(), commit) for _ in range(12)]
    routed = {prepare.txid: partition for partition, prepare in coord.prepares}
    assert routed == {r.txid: partition_of(r.txid, 3) for r in results}
    assert all(r.state == "committed" for r in results)


# -- begin() -----------------------------------------------------------------------------------


async def test_one_transaction_sends_to_two_topics_and_commits_when_the_block_ends(
    nc: Client,
) -> None:
    async with serving_partitions(nc) as coord, producer(nc) as p, p.begin() as txn:
        assert await txn.send(message("orders")) == (1,)
        assert await txn.send([message("points"), message("cart")]) == (2, 3)
    [(_, first), (_, second)] = coord.prepares
    assert first.txid == second.txid == txn.txid
    assert (first.token, second.token) == (None, coord.tokens[txn.txid])
    assert [m.topic for m in second.messages] == ["points", "cart"]
    [end] = coord.ends
    assert end.decision is Decision.COMMIT
    assert txn.result is not None
    assert (txn.result.state, txn.result.seqs) == ("committed", (1, 2, 3))


async def test_an_exception_in_the_block_rolls_back_and_propagates(nc: Client) -> None:
    async with serving_partitions(nc) as coord, producer(nc) as p:
        with pytest.raises(ZeroDivisionError):
            async with p.begin() as txn:
                await txn.send(message())
                1 / 0  # noqa: B018
    assert [e.decision for e in coord.ends] == [Decision.ROLLBACK]


async def test_leave_unknown_hands_the_transaction_to_the_check_back(nc: Client) -> None:
    async with serving_partitions(nc) as coord, producer(nc) as p, p.begin() as txn:
        await txn.send(message())
        result = await txn.leave_unknown()
    assert [e.decision for e in coord.ends] == [Decision.UNKNOWN]
    assert (result.local_state, result.state) == (Decision.UNKNOWN, "prepared")


async def test_a_second_end_with_another_decision_is_refused_before_sending(
    nc: Client,
) -> None:
    async with serving_partitions(nc) as coord, producer(nc) as p, p.begin() as txn:
        await txn.send(message())
        first = await txn.commit()
        with pytest.raises(TransactionStateError, match="already ended with commit"):
            await txn.rollback()
        assert await txn.commit() is first  # the same decision again: nothing sent
        with pytest.raises(TransactionStateError, match="already ended"):
            await txn.send(message())
    assert len(coord.ends) == 1


async def test_started_sends_go_out_in_order_and_the_commit_waits_for_them(nc: Client) -> None:
    """`start_send` returns at once; the sends keep their order (the first fixes the token),
    a check meanwhile is UNKNOWN, and the block's commit waits for a send never awaited."""
    checker = RecordingChecker(Decision.COMMIT)
    async with (
        serving_partitions(nc) as coord,
        producer(nc, checker=checker) as p,
        p.begin() as txn,
    ):
        first = txn.start_send(message(body=b"1"))
        txn.start_send(message(body=b"2"))  # never awaited
        assert await ask_instance(nc, p, check_for(p.group, txn.txid)) == CheckResult(
            txid=txn.txid, check_id=7, resolution=Decision.UNKNOWN
        )
        assert await first == (1,)
    assert [(m.token, m.messages[0].body) for _, m in coord.prepares] == [
        (None, b"1"),
        (coord.tokens[txn.txid], b"2"),
    ]
    assert txn.result is not None and txn.result.seqs == (1, 2)
    assert [e.decision for e in coord.ends] == [Decision.COMMIT]
    assert checker.views == []


async def test_a_started_send_that_fails_can_only_roll_back(nc: Client) -> None:
    refuse = lambda _: Error(ErrorCode.BAD_REQUEST, "topic too long")  # noqa: E731
    async with serving_partitions(nc, refuse_prepare=refuse) as coord, producer(nc) as p:
        txn = p.begin()
        with pytest.raises(PrepareFailed, match="topic too long"):
            await txn.start_send(message())
        with pytest.raises(TransactionStateError, match="failed"):
            txn.start_send(message())  # refused at once, before anything goes out
        with pytest.raises(TransactionStateError, match="only part"):
            await txn.commit()
        assert (await txn.rollback()).local_state is Decision.ROLLBACK
    assert len(coord.prepares) == 1
    assert coord.ends == []  # no token: nothing to end


async def test_a_transaction_that_sent_nothing_makes_no_request(nc: Client) -> None:
    async with serving_partitions(nc) as coord, producer(nc) as p, p.begin() as txn:
        pass
    assert (coord.prepares, coord.ends) == ([], [])
    assert txn.result is not None
    assert (txn.result.local_state, txn.result.confirmed) == (Decision.COMMIT, False)


def refuse_later_sends(prepare: Prepare) -> Error | None:
    """The first send of a transaction is stored, every later one refused."""
    return Error(ErrorCode.BAD_REQUEST, "too big") if prepare.token else None


async def test_after_a_failed_send_only_a_rollback_is_possible(nc: Client) -> None:
    async with (
        serving_partitions(nc, refuse_prepare=refuse_later_sends) as coord,
        producer(nc) as p,
    ):
        with pytest.raises(PrepareFailed):
            async with p.begin() as txn:
                await txn.send(message())
                await txn.send(message())
        txn2: Transaction
        async with p.begin() as txn2:
            await txn2.send(message())
            with pytest.raises(PrepareFailed):
                await txn2.send(message())
            with pytest.raises(TransactionStateError, match="only part"):
                await txn2.commit()
            await txn2.rollback()
    assert [e.decision for e in coord.ends] == [Decision.ROLLBACK, Decision.ROLLBACK]


async def test_a_cancelled_block_sends_no_end(nc: Client) -> None:
    async with serving_partitions(nc) as coord, producer(nc) as p:
        with anyio.CancelScope() as scope:
            async with p.begin() as txn:
                await txn.send(message())
                scope.cancel()
                await anyio.sleep(1)  # the scenario: cancelled here, inside the block
    assert coord.ends == []


# -- check-backs -------------------------------------------------------------------------------


async def test_a_check_on_the_instance_subject_is_answered_by_the_checker(nc: Client) -> None:
    checker = RecordingChecker(Decision.ROLLBACK)
    async with producer(nc, checker=checker) as p:
        check = check_for(p.group)
        reply = await ask_instance(nc, p, check)
    assert reply == CheckResult(txid=check.txid, check_id=7, resolution=Decision.ROLLBACK)
    [view] = checker.views
    assert (view.txid, view.group, view.check_times) == (check.txid, p.group, 2)
    [half] = view.messages
    assert (half.index, half.topic, half.keys, half.tag) == (0, "payments", ("k1",), "t")
    assert half.properties == {"p": "v"}
    assert half.decode(Transfer) == Transfer("A", 10)


async def test_a_group_check_is_answered_by_exactly_one_member(nc: Client) -> None:
    group = new_group()
    checkers = [RecordingChecker(Decision.COMMIT), RecordingChecker(Decision.COMMIT)]
    replies: list[Msg] = []

    async def collect(msg: Msg) -> None:
        replies.append(msg)

    async with producer(nc, group, checker=checkers[0]), producer(nc, group, checker=checkers[1]):
        inbox = nc.new_inbox()
        subscription = await nc.subscribe(inbox, cb=collect)
        for _ in range(4):
            await nc.publish(check_group_subject(group), encode(check_for(group)), reply=inbox)
        await eventually(lambda: len(replies) >= 4, timeout=2, what="four answers")
        await anyio.sleep(0.2)  # the scenario: room for a duplicate answer to show up
        await subscription.unsubscribe()
    assert len(replies) == 4
    assert len(checkers[0].views) + len(checkers[1].views) == 4
    decoded = [msgspec.msgpack.decode(r.data, type=CheckResult) for r in replies]
    assert {r.resolution for r in decoded} == {Decision.COMMIT}


@pytest.mark.parametrize(
    ("answer", "hint"),
    [(RuntimeError("db down"), "RuntimeError: db down"), ("commit", "must return a Decision")],
)
async def test_a_failing_checker_is_answered_with_an_internal_error(
    nc: Client, answer: Any, hint: str
) -> None:
    checker = RecordingChecker(answer)
    async with producer(nc, checker=checker) as p:
        with (
            structlog.testing.capture_logs() as logs,
            pytest.raises(CommandError, match=hint) as caught,
        ):
            await ask_instance(nc, p, check_for(p.group))
        checker.answer = Decision.ROLLBACK
        later = await ask_instance(nc, p, check_for(p.group))  # the responder keeps serving
    assert caught.value.code == ErrorCode.INTERNAL
    assert events(logs, "checker_failed") or events(logs, "checker_bad_result")
    assert later.resolution is Decision.ROLLBACK


async def test_a_slow_check_does_not_hold_up_checks_of_other_transactions(nc: Client) -> None:
    release = anyio.Event()
    slow_started = anyio.Event()

    async def checker(view: CheckView) -> Decision:
        if view.txid == "slow":
            slow_started.set()
            await release.wait()
        return Decision.COMMIT

    async with (
        producer(nc, checker=checker, checker_concurrency=2) as p,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(ask_instance, nc, p, check_for(p.group, "slow"))
        with within(10, "the slow check started"):
            await slow_started.wait()
        with anyio.fail_after(1):
            reply = await ask_instance(nc, p, check_for(p.group, "fast"))
        release.set()
    assert reply.txid == "fast"


async def test_a_checker_that_takes_too_long_is_answered_with_a_timeout(nc: Client) -> None:
    async def stuck(view: CheckView) -> Decision:
        await anyio.sleep(10)  # the scenario: a checker far slower than its timeout
        return Decision.COMMIT

    async with producer(nc, checker=stuck, check_timeout=0.1) as p:
        with pytest.raises(CommandError, match="did not answer within") as caught:
            await ask_instance(nc, p, check_for(p.group))
    assert caught.value.code == ErrorCode.TIMEOUT


async def test_a_check_for_another_group_is_refused(nc: Client) -> None:
    async with producer(nc) as p:
        with pytest.raises(CommandError) as caught:
            await ask_instance(nc, p, check_for("someone-else"))
    assert caught.value.code == ErrorCode.BAD_REQUEST


async def test_a_check_for_a_transaction_still_in_flight_is_unknown_without_the_checker(
    nc: Client,
) -> None:
    checker = RecordingChecker(Decision.COMMIT)
    async with serving_partitions(nc), producer(nc, checker=checker) as p:
        async with p.begin() as txn:
            await txn.send(message())
            during = await ask_instance(nc, p, check_for(p.group, txn.txid))
            assert checker.views == []
        after = await ask_instance(nc, p, check_for(p.group, txn.txid))
    assert during == CheckResult(txid=txn.txid, check_id=7, resolution=Decision.UNKNOWN)
    assert after.resolution is Decision.COMMIT  # ended and confirmed: the checker answers
    assert [view.txid for view in checker.views] == [txn.txid]


async def test_a_check_while_the_prepare_awaits_its_reply_is_unknown(nc: Client) -> None:
    checker = RecordingChecker(Decision.COMMIT)
    failed: list[PrepareFailed] = []
    async with producer(nc, checker=checker, request_timeout=1.0) as p:
        txn = p.begin()
        # No coordinator answers; the test only sees the prepare go out.
        prepares = await nc.subscribe(prepare_subject(partition_of(txn.txid, 1), p.group))

        async def send() -> None:
            try:
                await txn.send(message())
            except PrepareFailed as error:
                failed.append(error)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await prepares.next_msg(timeout=2)
            during = await ask_instance(nc, p, check_for(p.group, txn.txid))
        await prepares.unsubscribe()
        await txn.rollback()
        after = await ask_instance(nc, p, check_for(p.group, txn.txid))
    assert len(failed) == 1
    assert during.resolution is Decision.UNKNOWN
    assert after.resolution is Decision.ROLLBACK  # the remembered decision, not the checker
    assert checker.views == []


# -- a transaction the caller gave up on is not in flight -------------------------------------
#
# Each way of leaving the local work without an end is tried while the caller still holds
# what a real caller would (the cancelled task, the timeout's exception, whose traceback holds
# the transaction), and with the garbage collector off, so only what the producer does itself
# can clear the mark: the check-back that follows must reach the checker.


@contextmanager
def collector_off() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Work:
    """A local transaction that waits forever, or raises, once it has started."""

    def __init__(self, *, raises: bool = False) -> None:
        self.started = anyio.Event()
        self.raises = raises

    async def __call__(self, msg: Any = None, arg: Any = None) -> Decision:
        self.started.set()
        if self.raises:
            raise RuntimeError("the local transaction failed")
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


Caller = Callable[[Callable[[], Awaitable[object]], Work], Awaitable[object]]
"""Runs the producer call, gives up on it in its own way, and returns what it still holds."""


async def task_cancelled(call: Callable[[], Awaitable[object]], work: Work) -> object:
    task = asyncio.ensure_future(call())
    with anyio.fail_after(10):
        await work.started.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return task  # a cancelled task keeps its CancelledError, and that its traceback


async def anyio_fail_after(call: Callable[[], Awaitable[object]], work: Work) -> object:
    async def expire(scope: anyio.CancelScope) -> None:
        await work.started.wait()
        scope.deadline = anyio.current_time()

    with pytest.raises(TimeoutError) as caught, anyio.fail_after(60) as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(expire, scope)
            await call()
    return caught.value


async def asyncio_timeout(call: Callable[[], Awaitable[object]], work: Work) -> object:
    async def expire(timeout: asyncio.Timeout) -> None:
        await work.started.wait()
        timeout.reschedule(asyncio.get_running_loop().time())

    with pytest.raises(TimeoutError) as caught:
        async with asyncio.timeout(60) as timeout:
            helper = asyncio.ensure_future(expire(timeout))
            await call()
    await helper
    return caught.value


async def asyncio_wait_for(call: Callable[[], Awaitable[object]], work: Work) -> object:
    with pytest.raises(TimeoutError) as caught:
        await asyncio.wait_for(call(), timeout=1.0)  # the prepare or the local work: both count
    return caught.value


async def raised(call: Callable[[], Awaitable[object]], work: Work) -> object:
    work.raises = True
    with contextlib.suppress(RuntimeError):  # the block re-raises; send_in_transaction does not
        return await call()
    return None


GIVE_UP: dict[str, Caller] = {
    "exception": raised,
    "task cancelled": task_cancelled,
    "anyio.fail_after": anyio_fail_after,
    "asyncio.timeout": asyncio_timeout,
    "asyncio.wait_for": asyncio_wait_for,
}


async def assert_the_checker_answers(
    nc: Client, p: TransactionProducer, checker: RecordingChecker, txid: str
) -> None:
    assert txid not in p._client.in_flight
    reply = await ask_instance(nc, p, check_for(p.group, txid))
    assert reply.resolution is checker.answer
    assert [view.txid for view in checker.views] == [txid]


@pytest.mark.parametrize("way", GIVE_UP)
async def test_a_send_in_transaction_given_up_on_is_left_to_the_checker(
    nc: Client, way: str
) -> None:
    checker, work = RecordingChecker(Decision.ROLLBACK), Work()
    async with serving_partitions(nc) as coord, producer(nc, checker=checker) as p:
        with collector_off():
            held = await GIVE_UP[way](lambda: p.send_in_transaction(message(), work), work)
            [(_, prepare)] = coord.prepares
            await assert_the_checker_answers(nc, p, checker, prepare.txid)
            del held
    # Given up, nothing was sent; after an exception the end says UNKNOWN, as documented.
    assert [end.decision for end in coord.ends] == (
        [Decision.UNKNOWN] if way == "exception" else []
    )


@pytest.mark.parametrize("way", GIVE_UP)
async def test_a_begin_block_given_up_on_is_left_to_the_checker(nc: Client, way: str) -> None:
    checker, work = RecordingChecker(Decision.ROLLBACK), Work()
    txids: list[str] = []

    async def block() -> None:
        async with p.begin() as txn:
            txids.append(txn.txid)
            await txn.send(message())
            await work()

    async with serving_partitions(nc) as coord, producer(nc, checker=checker) as p:
        with collector_off():
            held = await GIVE_UP[way](block, work)
            await assert_the_checker_answers(nc, p, checker, txids[0])
            del held
    assert [end.decision for end in coord.ends] == (
        [Decision.ROLLBACK] if way == "exception" else []
    )


async def test_a_block_whose_end_is_cancelled_is_left_to_the_checker(nc: Client) -> None:
    """The commit at the block's exit is a request too; cut off, nothing is in flight."""
    checker = RecordingChecker(Decision.COMMIT)
    async with (
        serving_partitions(nc, serve_end=False),
        producer(nc, checker=checker, request_timeout=30) as p,
    ):
        txn = p.begin()
        # Someone takes the end and never answers: it waits until cut off.
        ends = await nc.subscribe(end_subject(partition_of(txn.txid, 1), p.group))
        with collector_off():
            with pytest.raises(TimeoutError) as caught, anyio.fail_after(60) as scope:
                async with txn:
                    await txn.send(message())
                    scope.deadline = anyio.current_time() + 0.2
            await assert_the_checker_answers(nc, p, checker, txn.txid)
            del caught
        await ends.unsubscribe()


async def assert_the_producer_rolls_it_back(
    nc: Client, p: TransactionProducer, checker: RecordingChecker, txid: str
) -> None:
    """A send of it failed: whatever the checker would say, the answer is ROLLBACK."""
    assert txid not in p._client.in_flight
    reply = await ask_instance(nc, p, check_for(p.group, txid))
    assert reply.resolution is Decision.ROLLBACK
    assert checker.views == []


async def test_a_send_cancelled_while_its_prepare_is_out_is_rolled_back_by_the_producer(
    nc: Client,
) -> None:
    """Without a block, as `begin()` and `send()` may be used: the caller's task was
    cancelled in the send, and whoever holds that task does not end the transaction. Its
    half may be stored, so only a rollback is possible, also in the check-back."""
    checker = RecordingChecker(Decision.COMMIT)
    async with producer(nc, checker=checker) as p:
        txn = p.begin()
        prepares = await nc.subscribe(prepare_subject(partition_of(txn.txid, 1), p.group))
        with collector_off():
            task = asyncio.ensure_future(txn.send(message()))  # nobody answers the prepare
            await prepares.next_msg(timeout=5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await assert_the_producer_rolls_it_back(nc, p, checker, txn.txid)
        await prepares.unsubscribe()
        with pytest.raises(TransactionStateError, match="interrupted by CancelledError"):
            await txn.commit()  # halves may exist: only part of it could be delivered
        assert (await txn.rollback()).local_state is Decision.ROLLBACK
        del task


@pytest.mark.parametrize("how", ["after a send", "after a failed send"])
async def test_a_dropped_transaction_is_not_in_flight_at_once(nc: Client, how: str) -> None:
    """Dropped after a send, its check-back is the checker's; after a failed send, the
    producer answers ROLLBACK itself (the checker would say COMMIT)."""
    checker = RecordingChecker(Decision.COMMIT)
    async with (
        serving_partitions(nc, refuse_prepare=refuse_later_sends),
        producer(nc, checker=checker) as p,
    ):
        with collector_off():
            dropped = p.begin()
            txid = dropped.txid
            await dropped.send(message())
            if how == "after a failed send":
                with contextlib.suppress(PrepareFailed):
                    await dropped.send(message())
            del dropped  # never ended, and nothing can end it now
            if how == "after a failed send":
                await assert_the_producer_rolls_it_back(nc, p, checker, txid)
            else:
                await assert_the_checker_answers(nc, p, checker, txid)


async def test_leave_unknown_after_a_failed_send_rolls_back(nc: Client) -> None:
    """Only part of it could be committed, so there is nothing for a check-back to decide."""
    async with (
        serving_partitions(nc, refuse_prepare=refuse_later_sends) as coord,
        producer(nc) as p,
        p.begin() as txn,
    ):
        await txn.send(message())
        with pytest.raises(PrepareFailed):
            await txn.send(message())
        with structlog.testing.capture_logs() as logs:
            result = await txn.leave_unknown()
        assert await txn.rollback() is result  # the same decision: nothing sent again
    assert [e.decision for e in coord.ends] == [Decision.ROLLBACK]
    assert (result.local_state, result.state) == (Decision.ROLLBACK, "rolled_back")
    [warning] = events(logs, "transaction_unknown_rolled_back")
    assert "too big" in warning["reason"]
    assert p._client.failed_sends.reason(txn.txid) is None  # confirmed: nobody will ask


async def test_a_block_left_normally_after_a_failed_send_is_rolled_back_by_the_producer(
    nc: Client,
) -> None:
    """The caller swallowed the failed send: the block's commit is refused, the transaction
    is left without an end, and its check-back is ROLLBACK whatever the checker says."""
    checker = RecordingChecker(Decision.COMMIT)
    async with (
        serving_partitions(nc, refuse_prepare=refuse_later_sends) as coord,
        producer(nc, checker=checker) as p,
    ):
        with pytest.raises(TransactionStateError, match="only part"):
            async with p.begin() as txn:
                await txn.send(message())
                with contextlib.suppress(PrepareFailed):
                    await txn.send(message())
        assert coord.ends == []
        await assert_the_producer_rolls_it_back(nc, p, checker, txn.txid)
        assert (await txn.rollback()).state == "rolled_back"  # the caller may still send it
    assert [e.decision for e in coord.ends] == [Decision.ROLLBACK]


# -- TxMessage ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"topic": "a.b"}, "topic 'a.b' may contain only"),
        ({"topic": "orders>"}, "may contain only"),
        ({"tag": "x y"}, "tag 'x y' may contain only"),
        ({"tag": "_"}, "reserved for messages without a tag"),
        ({"properties": {"Nats-Msg-Id": "1"}}, "reserved prefix 'Nats-'"),
        ({"properties": {"txn-id": "1"}}, "reserved prefix 'Txn-'"),
        ({"properties": {"bad name": "1"}}, "header token"),
        ({"properties": {"ok": "line\nbreak"}}, "without line breaks"),
        ({"keys": ["a,b"]}, "without commas"),
        ({"keys": "abc"}, "list of strings"),
        ({"check_immunity": 0}, "positive number"),
        ({"body": "text"}, "bytes or a msgspec.Struct"),
    ],
)
def test_tx_message_refuses_what_cannot_travel(kwargs: dict[str, Any], error: str) -> None:
    fields = {"topic": "orders", "body": b"x", **kwargs}
    with pytest.raises((ValueError, TypeError), match=error):
        TxMessage(**fields)


def test_tx_message_converts_to_the_wire_form() -> None:
    sent = TxMessage(
        "orders", Transfer("B", 5), keys=["k"], tag="paid", properties={"a": "1"}, check_immunity=9
    ).to_outgoing()
    assert msgspec.msgpack.decode(sent.body, type=Transfer) == Transfer("B", 5)
    assert (sent.topic, sent.keys, sent.tag, sent.properties, sent.check_immunity) == (
        "orders",
        ["k"],
        "paid",
        {"a": "1"},
        9,
    )
    assert TxMessage("orders", bytearray(b"raw")).to_outgoing().body == b"raw"


async def test_an_error_in_the_block_leaves_producer_and_coordinator_cleanly(
    private_nc: Client,
) -> None:
    """The error a user's block raises is what comes out: the producer's check endpoint must
    leave every task group it entered, or the coordinator's block around it breaks too."""
    with pytest.raises(ValueError, match="the user's own error"):
        async with (
            run_coordinator(private_nc),
            TransactionProducer(private_nc, "shop", lambda view: Decision.ROLLBACK),
        ):
            raise ValueError("the user's own error")
