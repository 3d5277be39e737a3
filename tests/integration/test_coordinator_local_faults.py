"""Faults stay local: one topic's outage, a write outage, a restart of a partition actor.

Against a real nats-server. A stream "temporarily unavailable" (as while its leader is
elected on a cluster) is played by taking its subjects away and answering writes to them
with JetStream's own 503 error.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import msgspec
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.support.partition import serving_partitions
from tests.support.txn import CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.actors import RemoteActorRef, Request
from txactors.actors.cell import TaskFailed
from txactors.coordinator.core.events import Published
from txactors.coordinator.partition.actor import PartitionCoordinator
from txactors.coordinator.service import run_coordinator
from txactors.errors import AskTimeout, CommandError, PrepareFailed
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    Ended,
    Error,
    ErrorCode,
    Prepare,
    PrepareBatch,
    PreparedBatch,
    PrepareItem,
    ShowTransaction,
    encode,
)
from txactors.wire.rules import CoordinatorConfig

UNAVAILABLE = msgspec.json.encode(
    {
        "error": {
            "code": 503,
            "err_code": 10008,
            "description": "JetStream system temporarily unavailable",
        }
    }
)


@asynccontextmanager
async def unavailable(nc: Client, stream: str, subject: str) -> AsyncIterator[None]:
    """`stream` answers writes to `subject` with 503 until the block ends, then is back."""
    js = nc.jetstream()
    config = (await js.stream_info(stream)).config
    subjects = list(config.subjects or [])
    config.subjects = [f"parked.{stream}"]
    await js.update_stream(config)

    async def refuse(msg: Msg) -> None:
        if msg.reply:  # the last message of an atomic batch asks for its answer
            await msg.respond(UNAVAILABLE)

    sub = await nc.subscribe(subject, cb=refuse)
    try:
        yield
    finally:
        await sub.unsubscribe()
        config.subjects = subjects
        await js.update_stream(config)


async def test_one_unavailable_topic_holds_up_only_its_own_commits(private_nc: Client) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        for topic in ("a", "b"):  # both streams declared, and written once
            receipt = await client.prepare(f"warm-{topic}", message(topic))
            await client.end(f"warm-{topic}", receipt.token, Decision.COMMIT)
        async with unavailable(private_nc, "TOPIC_a", "topic.a.>"):
            only_a = await client.prepare("only-a", message("a"))
            both = await client.prepare("both", message("a"), message("b"))
            only_b = await client.prepare("only-b", message("b"))
            ended: dict[str, Ended] = {}

            async def end(txid: str, token: str) -> None:
                ended[txid] = await client.end(txid, token, Decision.COMMIT, timeout=30)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(end, "only-a", only_a.token)
                tasks.start_soon(end, "both", both.token)
                with anyio.fail_after(5):
                    await end("only-b", only_b.token)  # promptly, while topic a is down
                assert ended["only-b"].state == "committed"

                async def b_has_both() -> bool:
                    return "both:1" in await topic_ids(private_nc, "b")

                await eventually(b_has_both, what="the b half of `both`")
                await anyio.sleep(0.5)  # a's commits keep waiting while a is down
                assert "only-a" not in ended and "both" not in ended
                tasks.cancel_scope.cancel()
        with anyio.fail_after(15):  # a is back: the ends asked again see them committed
            assert (await client.end("only-a", only_a.token, Decision.COMMIT)).state == "committed"
            assert (await client.end("both", both.token, Decision.COMMIT)).state == "committed"
    assert await topic_ids(private_nc, "a") == ["warm-a:0", "only-a:0", "both:0"], "once each"
    assert sorted(await topic_ids(private_nc, "b")) == ["both:1", "only-b:0", "warm-b:0"]


async def test_a_deleted_topic_stream_is_declared_again_and_gets_its_commits(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("first", message("a"))
        await client.end("first", receipt.token, Decision.COMMIT)
        await js.delete_stream("TOPIC_a")  # by an operator, while commits go on
        with structlog.testing.capture_logs() as logs:
            for txid in ("x", "y"):
                receipt = await client.prepare(txid, message("a"), message("b"))
                ended = await client.end(txid, receipt.token, Decision.COMMIT, timeout=15)
                assert ended.state == "committed"
    assert await topic_ids(private_nc, "a") == ["x:0", "y:0"], "nothing lost, nothing twice"
    assert await topic_ids(private_nc, "b") == ["x:1", "y:1"]
    events = [e["event"] for e in logs]
    assert "topic_stream_redeclared" in events and "record_quarantined" not in events


async def test_a_batch_during_a_write_outage_tells_each_item_when_to_come_back(
    private_nc: Client,
) -> None:
    """Each admitted item is answered at once with the hint, as a lone prepare is; a bad item
    keeps its own refusal."""
    batches = RemoteActorRef(private_nc, layout.prepare_subject(0, "g"), PreparedBatch)
    items = [PrepareItem(txid=txid, messages=[message()]) for txid in ("o1", "a b", "o2")]
    batch = PrepareBatch(version=PROTOCOL_VERSION, group="g", producer="p1", items=items)
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)

        async def stuck() -> None:
            with contextlib.suppress(AskTimeout, CommandError):
                await client.prepare("stuck", message())

        with structlog.testing.capture_logs() as logs:
            async with (
                unavailable(private_nc, layout.half_stream(0), layout.half_subject(0)),
                anyio.create_task_group() as tasks,
            ):
                tasks.start_soon(stuck)

                async def troubled() -> bool:
                    return any(e["event"] == "appends_reissued" for e in logs)

                await eventually(troubled, what="the halves' writer in trouble")
                answer = await batches.ask(batch, timeout=10)
                tasks.cancel_scope.cancel()
    first, bad, last = answer.results
    assert isinstance(bad, Error) and bad.code == ErrorCode.BAD_REQUEST
    for refused in (first, last):
        assert isinstance(refused, Error) and refused.code == ErrorCode.INTERNAL
        assert "TXN_LOG_0" in refused.message
        assert refused.retry_after is not None and 0 < refused.retry_after < math.inf


async def test_a_prepare_during_a_write_outage_is_told_when_to_come_back(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        arrivals: list[float] = []

        async def arrived(_: Msg) -> None:
            arrivals.append(time.monotonic())

        await private_nc.subscribe(layout.prepare_subject(0, "shop"), cb=arrived)

        async def stuck() -> None:
            with contextlib.suppress(AskTimeout, CommandError):
                await client.prepare("stuck", message())

        with structlog.testing.capture_logs() as logs:
            async with (
                unavailable(private_nc, layout.half_stream(0), layout.half_subject(0)),
                anyio.create_task_group() as tasks,
            ):
                # The first prepare finds the outage (told at once to come back, see below).
                tasks.start_soon(stuck)

                async def troubled() -> bool:
                    return any(e["event"] == "appends_reissued" for e in logs)

                await eventually(troubled, what="the halves' writer in trouble")
                with pytest.raises(CommandError) as caught:
                    await client.prepare("refused", message())
                refused = caught.value
                assert refused.code == ErrorCode.INTERNAL and "TXN_LOG_0" in refused.message
                assert refused.retry_after is not None
                assert 0 < refused.retry_after < math.inf

                async def checker(view: CheckView) -> Decision:
                    return Decision.ROLLBACK

                async with TransactionProducer(
                    private_nc, "shop", checker, prepare_retries=2
                ) as producer:
                    before = len(arrivals)
                    with pytest.raises(PrepareFailed) as failed:
                        await producer.begin().send(TxMessage("orders", b"x"))
                assert failed.value.code == ErrorCode.INTERNAL
                assert failed.value.retry_after is not None and failed.value.retry_after > 0
                attempts = arrivals[before:]
                assert len(attempts) == 3, "the first try and two retries"
                gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
                hints = [e["retry_after"] for e in logs if e["event"] == "prepare_retry"]
                assert len(hints) == 2 and all(0 < hint < math.inf for hint in hints)
                for gap, hint in zip(gaps, hints, strict=True):
                    assert gap >= hint, "it waited the hint it was given"
                tasks.cancel_scope.cancel()
        with anyio.fail_after(15):  # the outage over, prepares are taken again
            while True:
                try:
                    receipt = await client.prepare("after", message())
                    break
                except CommandError as error:
                    assert error.retry_after is not None, "only refused for now"
                    await anyio.sleep(error.retry_after)  # as a producer does: the hint's pause
        assert (await client.end("after", receipt.token, Decision.COMMIT)).state == "committed"


async def test_the_producer_retries_a_prepare_after_the_hint_and_old_clients_see_no_field(
    private_nc: Client,
) -> None:
    arrivals: list[float] = []

    def refuse_for_now(prepare: Prepare) -> Error | None:  # refuses twice, then takes it
        arrivals.append(time.monotonic())
        if len(arrivals) <= 2:
            return Error(ErrorCode.INTERNAL, "cannot write now", retry_after=0.3)
        return None

    async def checker(view: CheckView) -> Decision:
        return Decision.ROLLBACK

    async with (
        serving_partitions(private_nc, refuse_prepare=refuse_for_now, seqs=itertools.count(7)),
        TransactionProducer(private_nc, "shop", checker, partitions=1) as producer,
    ):
        assert await producer.begin().send(TxMessage("orders", b"x")) == (7,)
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert len(gaps) == 2 and min(gaps) >= 0.3

    plain = msgspec.msgpack.decode(encode(Error(ErrorCode.NOT_FOUND, "no such thing")))
    assert plain == {"type": "Error", "code": "not_found", "message": "no such thing"}
    hinted = msgspec.msgpack.decode(encode(Error(ErrorCode.INTERNAL, "later", 1.5)))
    assert hinted["retry_after"] == 1.5


async def test_a_restarted_partition_ignores_what_its_previous_incarnation_completes(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc) as coordinator:
        ref = coordinator.owned[0].ref
        assert ref is not None
        cell = ref._cell
        old = cell._instance
        assert isinstance(old, PartitionCoordinator)
        client = CoordinatorClient(private_nc)
        await client.end("t0", (await client.prepare("t0", message())).token, Decision.COMMIT)
        subscriptions = len(private_nc._subs)  # every writer of the first incarnation in use
        with structlog.testing.capture_logs() as logs:
            await ref.tell("nonsense")  # fails the instance: the supervisor restarts it

            async def restarted() -> bool:
                return cell._instance is not old and cell._instance is not None

            await eventually(restarted, what="the restart")
            receipt = await client.prepare("t1", message())  # served by the new incarnation
            new = cell._instance
            # The previous incarnation's writers and tasks report late.
            stale = old.stale_completions  # t0's done record may have been one already
            await old._on_published(old._epoch, [Published(txid="gone", index=0)])
            await old._ops_appended(old._epoch, [1], 99)
            await cell.deliver(Request(TaskFailed(RuntimeError("late"), old)))
            assert old.stale_completions == stale + 2
            ended = await client.end("t1", receipt.token, Decision.COMMIT)
        assert ended.state == "committed"
        assert cell._instance is new and ref.is_alive
        assert len(private_nc._subs) <= subscriptions, "the old writers' ack inboxes are gone"
        assert [e["event"] for e in logs].count("actor_message_failed") == 1, "no crash loop"


async def test_a_first_prepare_waiting_for_its_halves_is_told_to_come_back_when_the_log_stalls(
    private_nc: Client,
) -> None:
    """A prepare already in the log's writer when the stream stops answering is answered
    at once with `timeout` (no retry-after: its halves may be stored), not left to the
    producer's timeout: its producer moves on to
    another partition. Its halves land once the stream is back, and the check-back rolls
    the transaction back (its producer never went on with it)."""
    config = CoordinatorConfig(transaction_timeout=0.5, check_interval=0.2)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        await client.prepare("warm-up", message())

        async def rollback(view: CheckView) -> Decision:
            return Decision.ROLLBACK

        async with TransactionProducer(private_nc, group="g", checker=rollback):
            async with unavailable(private_nc, layout.log_stream(0), layout.half_subject(0)):
                started = time.monotonic()
                with pytest.raises(CommandError) as caught:
                    await client.prepare("waiting", message())
                assert time.monotonic() - started < 4.0, "not the producer's timeout"
                assert caught.value.code == ErrorCode.TIMEOUT
                assert caught.value.retry_after is None, "not 'nothing stored, send it again'"

            async def where() -> str:
                try:
                    show = ShowTransaction(txid="waiting", version=PROTOCOL_VERSION)
                    shown = await client.admin(show)
                except CommandError as gone:
                    return gone.message
                return str(shown.state)

            await eventually(where, until=lambda s: "rolled_back" in s, what="halves rolled back")
        assert "waiting:0" not in await topic_ids(private_nc, "orders")
