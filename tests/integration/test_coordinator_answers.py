"""The partition's request path without a server: answers go out in order from whoever ran
the step, and the halves of a prepare are known from what was written, not parsed back."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
from hypothesis import given, settings
from nats.js.api import PubAck

from tests.unit.test_coordinator_validation import BOUNDARY, MAX_PAYLOAD, valid_prepares
from txactors.actors import Request
from txactors.coordinator.boundary import HEADER_RESERVE
from txactors.coordinator.core import tokens
from txactors.coordinator.core.effects import Acknowledge
from txactors.coordinator.core.states import TxnState
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.partition.answers import Answers
from txactors.coordinator.partition.packs import pack_appends, read_halves
from txactors.coordinator.partition.prepares import PreparesInFlight
from txactors.wire.protocol import Prepare
from txactors.wire.rules import CoordinatorConfig


class Sink:
    """A reply sink that records answers; the first one waits until `release` is set, as a
    publish waits when the connection's buffer is full."""

    def __init__(self, sent: list[Any], release: anyio.Event | None = None) -> None:
        self.sent = sent
        self.release = release

    async def resolve(self, value: Any) -> None:
        if self.release is not None:
            await self.release.wait()
        self.sent.append(value)

    async def fail(self, error: BaseException) -> None:
        self.sent.append(error)


async def test_answers_go_out_in_order_when_a_flush_is_already_under_way() -> None:
    answers = Answers(0, None)
    sent: list[Any] = []
    release = anyio.Event()
    first = answers.wait(Request("first", Sink(sent, release)), lambda state: ("first", state))
    answers.settle(Acknowledge(request_id=first, txid="t1", state=TxnState.PREPARED))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(answers.flush)  # blocked in the first answer's publish
        await anyio.wait_all_tasks_blocked()
        answers.send(Request("second", Sink(sent)), "second")
        await answers.flush()  # another step's flush: must not overtake the first
        assert sent == []
        release.set()
    assert sent == [("first", TxnState.PREPARED), "second"]


async def test_nothing_is_sent_before_a_flush() -> None:
    answers = Answers(0, None)
    sent: list[Any] = []
    answers.send(Request("one", Sink(sent)), "one")
    await anyio.lowlevel.checkpoint()
    assert sent == []
    await answers.flush()
    assert sent == ["one"]


@settings(max_examples=200, deadline=None)
@given(valid_prepares())
def test_stored_halves_equal_what_reading_them_back_gives(prepare: Prepare) -> None:
    if BOUNDARY.refusal(prepare, max_payload=MAX_PAYLOAD) is not None:
        return
    digest = tokens.digest(prepare.token or tokens.new_tokens(1)[0])
    prepares = PreparesInFlight()
    halves = prepares.start(TransactionTable(CoordinatorConfig()), prepare, digest, 1.5e9)
    packs = pack_appends(0, halves, MAX_PAYLOAD - HEADER_RESERVE)
    acks = [PubAck(stream="TXN_HALF", seq=100 + i) for i in range(len(packs))]
    per_half = [ack for ack, (_, count) in zip(acks, packs, strict=True) for _ in range(count)]
    stored, refused = prepares.finish(prepare, digest, halves, per_half)
    assert refused == []
    assert stored == [
        half
        for (pack, _), ack in zip(packs, acks, strict=True)
        for half in read_halves(ack.seq, pack.headers, pack.payload)
    ]
