"""No transient JetStream fault stops a coordinator: each of its loops outlives each of them.

A case makes the next calls of the JetStream method one loop of the coordinator uses fail with
one of the errors JetStream (or the connection) gives while a cluster elects a leader, a node
comes back or a write of ours is still in flight, and checks that the coordinator keeps
serving: the fault is met, a transaction commits afterwards, and the coordinator's block is
still running (it is left cleanly, no error). A chaos run found the rebalance's lease reads
ending every coordinator on a 503 (an error leaving a task group inside an `ExceptionGroup`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
import pytest
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tests.support.txn import FAST, topic_ids
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.partition.packs import read_halves
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.service import run_coordinator
from txactors.errors import PrepareFailed
from txactors.nats.acks import ack_fields
from txactors.nats.link import AckInbox
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.producer.transaction import TransactionResult
from txactors.wire import layout
from txactors.wire.rules import CoordinatorConfig

TIMES = 2
"""Calls that fail in a row: more than one, so that a retry meets the fault too."""
OPTIONS = CoordinatorOptions(lease_ttl=1.5, checkpoint_interval=0.1, tick_interval=0.02)
"""One partition; leases renewed (and the bucket viewed) every half second, a checkpoint
looked at every tenth of one, the end of TXN_HALF every fifth."""


def api_error(code: int, err_code: int, description: str) -> Exception:
    """The typed error nats-py raises for JetStream's answer."""
    try:
        nats.js.errors.APIError.from_error(
            {"code": code, "err_code": err_code, "description": description}
        )
    except nats.js.errors.APIError as error:
        return error
    raise AssertionError("from_error always raises")


ERRORS: dict[str, Callable[[], Exception]] = {
    "503-10008": lambda: api_error(503, 10008, "JetStream system temporarily unavailable"),
    "timeout": nats.errors.TimeoutError,
    "no-responders": nats.errors.NoRespondersError,
    "409-10158": lambda: api_error(409, 10158, "duplicate message id is in process"),
    "500-10009-not-leader": lambda: api_error(500, 10009, "JetStream cluster not leader"),
}


def _bucket(name: str) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], bool]:
    return lambda kv, args, kwargs: kv._name == name


def _stream(name: str) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], bool]:
    return lambda js, args, kwargs: (args[0] if args else kwargs.get("stream_name")) == name


def _subject(prefix: str) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], bool]:
    return lambda inbox, args, kwargs: str(args[0]).startswith(prefix)


@dataclass(frozen=True)
class Loop:
    """Where a loop of the coordinator meets JetStream: `owner.method` called as `hits` says."""

    owner: type
    method: str
    hits: Callable[[Any, tuple[Any, ...], dict[str, Any]], bool]
    before_start: bool = False
    """Armed before the coordinator starts (its loop runs only then, or at once)."""
    answered: bool = False
    """A write's: it is sent, and the error is what answers it (its ack lost or refused for
    now) instead of JetStream's answer: it may have landed all the same."""
    checked_back: bool = False
    """Met by the check-back of a transaction whose end said UNKNOWN."""


LOOPS = {
    "leases-renew": Loop(KeyValue, "update", _bucket(layout.LEASE_BUCKET)),
    "leases-watch": Loop(KeyValue, "watchall", _bucket(layout.LEASE_BUCKET), before_start=True),
    "rebalance-view": Loop(KeyValue, "get", _bucket(layout.LEASE_BUCKET)),
    "join-view": Loop(KeyValue, "get", _bucket(layout.LEASE_BUCKET), before_start=True),
    "join-announce": Loop(KeyValue, "put", _bucket(layout.LEASE_BUCKET), before_start=True),
    "partition-start": Loop(Client, "flush", lambda nc, args, kwargs: True, before_start=True),
    "recovery": Loop(
        JetStreamContext,
        "pull_subscribe",
        lambda js, args, kwargs: (
            kwargs.get("stream") in (layout.half_stream(0), layout.op_stream(0))
        ),
        before_start=True,
    ),
    "recovery-checkpoint": Loop(
        KeyValue, "get", _bucket(layout.CHECKPOINT_BUCKET), before_start=True
    ),
    "checkpoints": Loop(KeyValue, "put", _bucket(layout.CHECKPOINT_BUCKET)),
    "halves-writer": Loop(AckInbox, "publish", _subject("txn.half."), answered=True),
    "op-writer": Loop(AckInbox, "publish", _subject("txn.op."), answered=True),
    "topic-writer": Loop(AckInbox, "publish", _subject("topic."), answered=True),
    "late-halves-end": Loop(JetStreamContext, "stream_info", _stream(layout.half_stream(0))),
    "late-halves-read": Loop(
        JetStreamContext.PullSubscription,
        "fetch",
        lambda sub, args, kwargs: sub._stream == layout.half_stream(0),
    ),
    "checker": Loop(JetStreamContext, "get_msg", _stream(layout.half_stream(0)), checked_back=True),
}


class Fault:
    """The next `times` calls `loop` makes fail with `error()`, each a fresh error."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.left = 0
        self.met = 0

    def arm(self, loop: Loop, error: Callable[[], Exception], times: int) -> None:
        self.left = times
        original = getattr(loop.owner, loop.method)

        async def failing(target: Any, *args: Any, **kwargs: Any) -> Any:
            if self.left > 0 and loop.hits(target, args, kwargs):
                self.left -= 1
                self.met += 1
                if not loop.answered:
                    raise error()
                await original(target, *args, **kwargs)  # its true answer goes unread
                answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                answer.set_exception(error())
                return answer
            return await original(target, *args, **kwargs)

        self._monkeypatch.setattr(loop.owner, loop.method, failing)


async def commit(producer: TransactionProducer) -> TransactionResult:
    """One transaction committed, its prepare tried again while it is refused for now."""

    async def send() -> TransactionResult:
        return await producer.send_in_transaction(
            TxMessage("orders", b"x"), lambda m, a: Decision.COMMIT
        )

    return await eventually(send, what="a commit", ignoring=(PrepareFailed,), timeout=20)


@pytest.mark.parametrize("error", list(ERRORS), ids=list(ERRORS))
@pytest.mark.parametrize("loop", list(LOOPS), ids=list(LOOPS))
async def test_the_coordinator_outlives_a_transient_fault_in_each_of_its_loops(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch, loop: str, error: str
) -> None:
    where, fault = LOOPS[loop], Fault(monkeypatch)
    if where.before_start:
        fault.arm(where, ERRORS[error], TIMES)
    config = CoordinatorConfig(**FAST)
    async with (
        run_coordinator(private_nc, config=config, options=OPTIONS) as running,
        TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT) as producer,
    ):
        await eventually(lambda: running.partitions == [0], what="partition 0 served")
        if not where.before_start:
            fault.arm(where, ERRORS[error], TIMES)
        if where.checked_back:  # its end says UNKNOWN: the check-back commits it
            unknown = await producer.send_in_transaction(
                TxMessage("orders", b"checked"), lambda m, a: Decision.UNKNOWN
            )
            await eventually(
                lambda: topic_ids(private_nc, "orders"),
                until=lambda ids: f"{unknown.txid}:0" in ids,
                what="the checked-back transaction committed",
            )

        async def met_while_committing() -> int:
            await commit(producer)  # what a write or read of the loop waits for
            return fault.met

        await eventually(met_while_committing, until=lambda met: met == TIMES, what="the fault")
        assert (await commit(producer)).state == "committed"
        assert running.partitions == [0], "still serving"
    discards = await private_nc.jetstream().stream_info(layout.DISCARD_STREAM)
    assert discards.state.messages == 0, "nothing quarantined: a retry of ours is no refusal"


async def test_a_half_write_answered_in_process_is_asked_again_and_never_quarantined(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """409/10158 answers a write whose `Nats-Msg-Id` is still being stored: a retry of our
    own write. Here the write landed and only its answer said so; asked again, it is the
    duplicate it is. The transaction commits, its halves are stored once, nothing put aside."""
    fault = Fault(monkeypatch)
    async with (
        run_coordinator(private_nc, options=OPTIONS),
        TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT) as producer,
    ):
        fault.arm(LOOPS["halves-writer"], ERRORS["409-10158"], 1)
        with structlog.testing.capture_logs() as logs:
            result = await producer.send_in_transaction(
                TxMessage("orders", b"x"), lambda m, a: Decision.COMMIT
            )
        assert (result.state, fault.met) == ("committed", 1)
    js = private_nc.jetstream()
    stored = [
        half.txid
        async for msg in read_subject(js, layout.half_stream(0), layout.half_subject(0), 1)
        for half in read_halves(ack_fields(msg).seq, msg.headers or {}, msg.data)
    ]
    assert stored == [result.txid], "stored once"
    assert "record_quarantined" not in [e["event"] for e in logs]
