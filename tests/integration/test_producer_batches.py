"""Many transactions per request: the producer's batched links (producer/link.py) on a real
nats-server, against the stand-in partition of tests/support/partition.py.

What goes on the wire is watched by a subscription of its own (`Wire`), so a request counts
the moment it is sent, whatever the stand-in does with it; the stand-in's `gate` holds its
answers, so calls pile up behind a request in flight exactly when a test wants them to.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.support.partition import serving_partitions
from tests.support.wait import eventually
from txactors.errors import PrepareFailed, TransactionStateError
from txactors.nats.partition_count import PartitionCount
from txactors.producer import TransactionProducer, TxMessage
from txactors.producer.client import CoordinatorClient
from txactors.producer.dialect import RELEARN_AFTER
from txactors.producer.failed_sends import FailedSends
from txactors.producer.inflight import InFlight
from txactors.producer.link import REQUEST_HEADROOM
from txactors.producer.outcomes import UnconfirmedOutcomes
from txactors.wire.protocol import (
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    CoordinatorCommand,
    Decision,
    EndBatch,
    Error,
    ErrorCode,
    OutgoingMessage,
    Prepare,
    PrepareBatch,
    Prepared,
)


@dataclass
class Sent:
    kind: str
    items: int
    version: int
    size: int
    reply: str


@dataclass
class Wire:
    """Every command a group's producer sent, in the order the server relayed them."""

    sent: list[Sent] = field(default_factory=list)

    async def heard(self, msg: Msg) -> None:
        command = msgspec.msgpack.decode(msg.data, type=CoordinatorCommand)
        items = len(command.items) if isinstance(command, PrepareBatch | EndBatch) else 1
        self.sent.append(
            Sent(type(command).__name__, items, command.version, len(msg.data), msg.reply)
        )

    def kinds(self) -> list[tuple[str, int]]:
        return [(s.kind, s.items) for s in self.sent]


@asynccontextmanager
async def watching(nc: Client, group: str) -> AsyncIterator[Wire]:
    wire = Wire()
    subscription = await nc.subscribe(f"txn.coord.*.*.{group}", cb=wire.heard)
    await nc.flush()
    try:
        yield wire
    finally:
        await subscription.unsubscribe()


@asynccontextmanager
async def client_for(nc: Client, group: str, **kwargs: Any) -> AsyncIterator[CoordinatorClient]:
    """A producer's client alone (what `TransactionProducer` sends through)."""
    client = CoordinatorClient(
        nc,
        group=group,
        instance="p1",
        partitions=PartitionCount(nc, None, 2.0),
        request_timeout=kwargs.pop("request_timeout", 5.0),
        outcomes=UnconfirmedOutcomes(),
        in_flight=InFlight(),
        failed_sends=FailedSends(),
        **kwargs,
    )
    try:
        yield client
    finally:
        await client.close()


def queued(client: CoordinatorClient, verb: str = "prepare") -> int:
    """Calls waiting in the (only) partition's link for the round in flight."""
    return len(getattr(client._links[0], verb)._coalescer)


def new_group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


def halves(body: bytes = b"hello") -> list[OutgoingMessage]:
    return [OutgoingMessage(topic="orders", body=body)]


async def commit(msg: Any, arg: Any) -> Decision:
    return Decision.COMMIT


async def gathered(*calls: Any) -> list[Any]:
    """Each call's result, or the exception it raised."""
    return list(await asyncio.gather(*calls, return_exceptions=True))


async def pile_up(
    client: CoordinatorClient, wire: Wire, gate: anyio.Event, calls: list[Any], verb: str
) -> list[Any]:
    """Start `calls`, the first alone and the rest while it is held in flight, then open the
    gate; what each ended with."""
    first = asyncio.ensure_future(calls[0])
    await eventually(lambda: len(wire.sent) == 1, what="the first call on the wire")
    rest = [asyncio.ensure_future(call) for call in calls[1:]]
    await eventually(lambda: queued(client, verb) == len(rest), what="the rest queued")
    gate.set()
    return await gathered(first, *rest)


# -- a lone call pays nothing -------------------------------------------------------------------


async def test_a_lone_transaction_goes_at_once_as_the_single_verbs(nc: Client) -> None:
    group = new_group()
    async with (
        serving_partitions(nc) as coord,
        watching(nc, group) as wire,
        TransactionProducer(nc, group, lambda view: Decision.COMMIT) as p,
    ):
        first = await p.send_in_transaction(TxMessage("orders", b"1"), commit)
        second = await p.send_in_transaction(TxMessage("orders", b"2"), commit)
        await eventually(lambda: len(wire.sent) == 4, what="four commands seen")
    assert wire.kinds() == [("Prepare", 1), ("EndTransaction", 1)] * 2
    assert all(s.version == PROTOCOL_VERSION for s in wire.sent)
    assert (first.state, second.state) == ("committed", "committed")
    assert coord.requests == wire.kinds()


# -- coalescing ---------------------------------------------------------------------------------


async def test_calls_made_while_one_is_in_flight_go_as_one_batch_each_answered_its_own(
    nc: Client,
) -> None:
    group, gate = new_group(), anyio.Event()
    txids = [uuid.uuid4().hex for _ in range(64)]
    async with (
        serving_partitions(nc, gate=gate) as coord,
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        prepares = [client.prepare(txid, halves(), None) for txid in txids]
        prepared = await pile_up(client, wire, gate, prepares, "prepare")
        assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 63)]
        assert [r.txid for r in prepared] == txids  # each caller its own answer
        assert len({r.seqs[0] for r in prepared}) == 64

        coord.gate = gate = anyio.Event()
        wire.sent.clear()
        ends = [client.end(r.txid, r.token, Decision.COMMIT) for r in prepared]
        ended = await pile_up(client, wire, gate, ends, "end")
        assert wire.kinds() == [("EndTransaction", 1), ("EndBatch", 63)]
    assert [e.txid for e in ended] == txids
    assert {e.state for e in ended} == {"committed"}
    assert all(s.version == PROTOCOL_VERSION and s.reply for s in wire.sent)


async def test_calls_made_in_one_loop_turn_go_as_one_request(nc: Client) -> None:
    """A burst (the callers of one answer moving on together) goes as one round, not as its
    first call alone and the rest a round trip later."""
    group = new_group()
    async with (
        serving_partitions(nc),
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        prepared = await gathered(
            *(client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(10))
        )
        await gathered(*(client.end(r.txid, r.token, Decision.COMMIT) for r in prepared))
    assert wire.kinds() == [("PrepareBatch", 10), ("EndBatch", 10)]


async def test_a_caller_its_answer_woke_joins_the_round_that_answer_opened(nc: Client) -> None:
    group, gate = new_group(), anyio.Event()
    async with (
        serving_partitions(nc, gate=gate),
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):

        async def prepare_twice() -> Prepared:
            await client.prepare(uuid.uuid4().hex, halves(), None)
            return await client.prepare(uuid.uuid4().hex, halves(), None)  # at once

        others = [client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(2)]
        results = await pile_up(client, wire, gate, [prepare_twice(), *others], "prepare")
    assert all(isinstance(r, Prepared) for r in results)
    assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 3)]


async def test_many_transactions_at_once_take_a_handful_of_requests(nc: Client) -> None:
    group = new_group()
    async with (
        serving_partitions(nc) as coord,
        watching(nc, group) as wire,
        TransactionProducer(nc, group, lambda view: Decision.COMMIT) as p,
    ):
        results = await gathered(
            *(p.send_in_transaction(TxMessage("orders", b"x"), commit) for _ in range(64))
        )
        await eventually(lambda: len(coord.ends) == 64, what="every end executed")
    assert {r.state for r in results} == {"committed"}
    prepares = [s for s in wire.sent if s.kind.startswith("Prepare")]
    assert sum(s.items for s in prepares) == 64
    assert len(prepares) <= 8, wire.kinds()  # one request each would be 64
    assert len(wire.sent) - len(prepares) <= 8, wire.kinds()


# -- what each caller gets ----------------------------------------------------------------------


def refuse_bad(prepare: Prepare) -> Error | None:
    if prepare.messages[0].body == b"bad":
        return Error(ErrorCode.BAD_REQUEST, "a bad half")
    return None


async def test_an_item_refused_fails_alone_and_the_rest_of_its_batch_is_stored(
    nc: Client,
) -> None:
    group, gate = new_group(), anyio.Event()
    bodies = [b"ok", b"ok", b"bad", b"ok", b"bad", b"ok"]
    async with (
        serving_partitions(nc, gate=gate, refuse_prepare=refuse_bad),
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        calls = [client.prepare(uuid.uuid4().hex, halves(b), None) for b in bodies]
        outcomes = await pile_up(client, wire, gate, calls, "prepare")
    assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 5)]
    for body, outcome in zip(bodies, outcomes, strict=True):
        if body == b"bad":
            assert isinstance(outcome, PrepareFailed)
            assert (outcome.code, outcome.retry_after) == (ErrorCode.BAD_REQUEST, None)
        else:
            assert isinstance(outcome, Prepared)


async def test_an_item_refused_for_now_is_retried_alone(nc: Client) -> None:
    group, gate = new_group(), anyio.Event()
    refused_once: set[str] = set()

    def busy_once(prepare: Prepare) -> Error | None:
        if prepare.messages[0].body == b"busy" and prepare.txid not in refused_once:
            refused_once.add(prepare.txid)
            return Error(ErrorCode.INTERNAL, "cannot write now", retry_after=0.01)
        return None

    async with (
        serving_partitions(nc, gate=gate, refuse_prepare=busy_once) as coord,
        watching(nc, group) as wire,
        client_for(nc, group, prepare_retries=1) as client,
    ):
        bodies = [b"ok", b"busy", b"ok", b"ok"]
        calls = [client.prepare(uuid.uuid4().hex, halves(b), None) for b in bodies]
        outcomes = await pile_up(client, wire, gate, calls, "prepare")
    assert all(isinstance(o, Prepared) for o in outcomes), outcomes
    sent = [p.txid for _, p in coord.prepares]
    assert sorted(sent.count(o.txid) for o in outcomes) == [1, 1, 1, 2]
    assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 3), ("Prepare", 1)]


async def test_no_answer_fails_every_caller_each_after_its_own_timeout(nc: Client) -> None:
    group, gate = new_group(), anyio.Event()
    timeout = 0.5
    failures: list[tuple[float, BaseException]] = []

    async def timed(txid: str) -> None:
        started = anyio.current_time()
        try:
            await client.prepare(txid, halves(), None)
        except PrepareFailed as error:
            failures.append((anyio.current_time() - started, error))

    async with (
        serving_partitions(nc, gate=gate),
        watching(nc, group) as wire,
        client_for(nc, group, request_timeout=timeout) as client,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(timed, uuid.uuid4().hex)
            await eventually(lambda: len(wire.sent) == 1, what="the first prepare sent")
            for _ in range(9):
                tg.start_soon(timed, uuid.uuid4().hex)
        assert len(failures) == 10
        assert all(elapsed >= timeout for elapsed, _ in failures)
        assert all(e.code is None and "did not confirm" in str(e) for _, e in failures)
        # The window is free again: a new call goes out at once and is answered.
        gate.set()
        assert isinstance(await client.prepare(uuid.uuid4().hex, halves(), None), Prepared)


async def test_nobody_serving_reaches_every_caller_of_a_batch(nc: Client) -> None:
    group = new_group()
    async with serving_partitions(nc, serve_end=False), client_for(nc, group) as client:
        prepared = await gathered(
            *(client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(5))
        )
        ends = await gathered(*(client.end(r.txid, r.token, Decision.COMMIT) for r in prepared))
    assert ends == [None] * 5  # unconfirmed: remembered for the check-back
    assert all(client.outcomes.get(r.txid) is Decision.COMMIT for r in prepared)


# -- splitting ----------------------------------------------------------------------------------


async def test_a_round_is_split_at_the_item_cap(nc: Client) -> None:
    group, gate = new_group(), anyio.Event()
    async with (
        serving_partitions(nc, gate=gate),
        watching(nc, group) as wire,
        client_for(nc, group, max_items=8) as client,
    ):
        calls = [client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(21)]
        outcomes = await pile_up(client, wire, gate, calls, "prepare")
    assert all(isinstance(o, Prepared) for o in outcomes)
    batches = [("PrepareBatch", 8), ("PrepareBatch", 8), ("PrepareBatch", 4)]
    assert wire.kinds() == [("Prepare", 1), *batches]


async def test_a_round_is_split_to_fit_the_servers_max_payload(nc: Client) -> None:
    group, gate = new_group(), anyio.Event()
    body = b"x" * (nc.max_payload // 3)
    async with (
        serving_partitions(nc, gate=gate),
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        calls = [client.prepare(uuid.uuid4().hex, halves(body), None) for _ in range(6)]
        outcomes = await pile_up(client, wire, gate, calls, "prepare")
    assert all(isinstance(o, Prepared) for o in outcomes)
    assert sum(s.items for s in wire.sent) == 6
    assert len(wire.sent) >= 4  # the lone first, then the other five in at least three
    assert all(s.size <= nc.max_payload - REQUEST_HEADROOM for s in wire.sent)


# -- older coordinators -------------------------------------------------------------------------


async def test_a_coordinator_without_batches_gets_the_refused_items_again_as_singles(
    nc: Client,
) -> None:
    group, gate = new_group(), anyio.Event()
    async with (
        serving_partitions(nc, gate=gate, batches=False) as coord,
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        calls = [client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(5)]
        prepared = await pile_up(client, wire, gate, calls, "prepare")
        assert all(isinstance(o, Prepared) for o in prepared)
        assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 4)] + [("Prepare", 1)] * 4
        assert len(coord.prepares) == 5  # the refused batch executed nothing

        # From now on this partition gets single verbs only, at once, for every verb.
        coord.gate = gate = anyio.Event()
        wire.sent.clear()
        ends = [client.end(r.txid, r.token, Decision.COMMIT) for r in prepared]
        waiting = asyncio.ensure_future(gathered(*ends))
        await eventually(lambda: len(wire.sent) == 5, what="five ends sent without waiting")
        gate.set()
        assert {e.state for e in await waiting} == {"committed"}
        await gathered(*(client.end_oneway(r.txid, r.token, Decision.COMMIT) for r in prepared))
        await eventually(lambda: len(wire.sent) == 10, what="five one-way ends")
    assert set(wire.kinds()) == {("EndTransaction", 1)}
    assert all(s.version == PROTOCOL_VERSION for s in wire.sent)


async def test_a_version_2_coordinator_gets_version_2_single_verbs(nc: Client) -> None:
    group = new_group()
    async with (
        serving_partitions(nc, speaks=OLDEST_VERSION) as coord,
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        prepared = await client.prepare(uuid.uuid4().hex, halves(), None)
        ended = await client.end(prepared.txid, prepared.token, Decision.COMMIT)
        await eventually(lambda: len(wire.sent) == 3, what="three commands seen")
    assert ended is not None and ended.state == "committed"
    assert [(s.kind, s.version) for s in wire.sent] == [
        ("Prepare", PROTOCOL_VERSION),  # refused: nothing executed
        ("Prepare", OLDEST_VERSION),
        ("EndTransaction", OLDEST_VERSION),  # learnt by the partition's every link
    ]
    assert [p.version for _, p in coord.prepares] == [OLDEST_VERSION]


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_coordinator_upgraded_in_place_gets_batches_again_after_the_interval(
    nc: Client,
) -> None:
    """A rolling upgrade: the old coordinator made the producer fall back, the new one that
    replaced it is spoken to in version 3, batches included, once the interval is over."""
    group, clock = new_group(), Clock()
    async with (
        serving_partitions(nc, speaks=OLDEST_VERSION) as coord,
        watching(nc, group) as wire,
        client_for(nc, group, clock=clock) as client,
    ):
        first = await client.prepare(uuid.uuid4().hex, halves(), None)
        coord.speaks = PROTOCOL_VERSION  # upgraded: the producer does not know yet
        clock.now += RELEARN_AFTER - 1.0
        second = await client.prepare(uuid.uuid4().hex, halves(), None)
        await eventually(lambda: len(wire.sent) == 3, what="three prepares seen")
        assert [(s.kind, s.version) for s in wire.sent] == [
            ("Prepare", PROTOCOL_VERSION),  # refused by the old coordinator
            ("Prepare", OLDEST_VERSION),
            ("Prepare", OLDEST_VERSION),  # still within the interval
        ]

        clock.now += 1.0
        wire.sent.clear()
        await client.prepare(uuid.uuid4().hex, halves(), None)  # the probe, answered
        await eventually(lambda: len(wire.sent) == 1, what="the probe seen")
        assert [(s.kind, s.version) for s in wire.sent] == [("Prepare", PROTOCOL_VERSION)]
        wire.sent.clear()
        coord.gate = gate = anyio.Event()
        calls = [client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(3)]
        prepared = await pile_up(client, wire, gate, calls, "prepare")
        assert all(isinstance(p, Prepared) for p in prepared)
        # One-way ends are batched again: a batch was answered since the downgrade.
        await gathered(
            *(client.end_oneway(r.txid, r.token, Decision.COMMIT) for r in [first, second])
        )
        await eventually(lambda: len(wire.sent) == 3, what="the one-way ends")
    assert [(s.kind, s.items, s.version) for s in wire.sent] == [
        ("Prepare", 1, PROTOCOL_VERSION),
        ("PrepareBatch", 2, PROTOCOL_VERSION),
        ("EndBatch", 2, PROTOCOL_VERSION),
    ]


async def test_a_batch_refused_whole_goes_again_alone_each_item_answered_its_own(
    nc: Client,
) -> None:
    """A coordinator that takes fewer items per batch (its `max_batch_items`) executed
    nothing of a larger one: alone, each item gets its own answer, and batches go on."""
    group, gate = new_group(), anyio.Event()
    bodies = [b"ok", b"ok", b"bad", b"ok", b"ok"]
    async with (
        serving_partitions(nc, gate=gate, max_batch_items=2, refuse_prepare=refuse_bad) as coord,
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        calls = [client.prepare(uuid.uuid4().hex, halves(b), None) for b in bodies]
        outcomes = await pile_up(client, wire, gate, calls, "prepare")
        assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 4)] + [("Prepare", 1)] * 4
        assert [isinstance(o, Prepared) for o in outcomes] == [b == b"ok" for b in bodies]
        assert isinstance(outcomes[2], PrepareFailed)
        assert outcomes[2].code == ErrorCode.BAD_REQUEST
        assert len(coord.prepares) == 5  # the refused batch executed nothing

        coord.gate = gate = anyio.Event()
        wire.sent.clear()
        calls = [client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(3)]
        assert all(
            isinstance(o, Prepared) for o in await pile_up(client, wire, gate, calls, "prepare")
        )
    assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 2)]  # within its limit


# -- callers who give up ------------------------------------------------------------------------


async def test_a_send_cancelled_while_queued_is_never_sent_and_can_only_roll_back(
    nc: Client,
) -> None:
    group, gate = new_group(), anyio.Event()
    async with (
        serving_partitions(nc, gate=gate) as coord,
        watching(nc, group) as wire,
        TransactionProducer(nc, group, lambda view: Decision.COMMIT) as p,
    ):
        first, second = p.begin(), p.begin()
        sending = asyncio.ensure_future(first.send(TxMessage("orders", b"1")))
        await eventually(lambda: len(wire.sent) == 1, what="the first prepare sent")
        cancelled = asyncio.ensure_future(second.send(TxMessage("orders", b"2")))
        await eventually(lambda: queued(p._client) == 1, what="the second queued")
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        gate.set()
        assert await sending == (1,)
        assert [prepare.txid for _, prepare in coord.prepares] == [first.txid]
        assert wire.kinds() == [("Prepare", 1)]
        # As for any send cut off: not in flight, and only a rollback is possible.
        assert second.txid not in p._client.in_flight
        assert p._client.failed_sends.reason(second.txid) == "interrupted by CancelledError"
        with pytest.raises(TransactionStateError, match="interrupted by CancelledError"):
            await second.commit()
        await first.commit()


async def test_a_request_whose_callers_all_gave_up_frees_the_window(nc: Client) -> None:
    group, gate = new_group(), anyio.Event()
    async with (
        serving_partitions(nc, gate=gate),
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        abandoned = asyncio.ensure_future(client.prepare(uuid.uuid4().hex, halves(), None))
        await eventually(lambda: len(wire.sent) == 1, what="the first prepare sent")
        abandoned.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await abandoned
        later = asyncio.ensure_future(client.prepare(uuid.uuid4().hex, halves(), None))
        await eventually(lambda: len(wire.sent) == 2, what="the next sent at once")
        gate.set()  # the abandoned one's answer comes too, to nobody
        assert isinstance(await later, Prepared)
    assert wire.kinds() == [("Prepare", 1), ("Prepare", 1)]


# -- one-way ends -------------------------------------------------------------------------------


async def test_one_way_ends_go_alone_until_the_coordinator_answered_a_batch(nc: Client) -> None:
    """An older coordinator would drop a one-way batch unseen: nothing answers a publish."""
    group, gate = new_group(), anyio.Event()
    async with (
        serving_partitions(nc, gate=gate) as coord,
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        calls = [client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(2)]
        prepared = await pile_up(client, wire, gate, calls, "prepare")
        assert wire.kinds() == [("Prepare", 1), ("Prepare", 1)]  # a round of one is no batch
        await gathered(*(client.end_oneway(r.txid, r.token, Decision.COMMIT) for r in prepared))
        await eventually(lambda: len(wire.sent) == 4, what="two one-way ends")
        assert wire.kinds()[2:] == [("EndTransaction", 1), ("EndTransaction", 1)]

        coord.gate = gate = anyio.Event()
        wire.sent.clear()
        calls = [client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(3)]
        prepared = await pile_up(client, wire, gate, calls, "prepare")
        await gathered(*(client.end_oneway(r.txid, r.token, Decision.COMMIT) for r in prepared))
        await eventually(lambda: len(coord.ends) == 5, what="every end executed")
    assert wire.kinds() == [("Prepare", 1), ("PrepareBatch", 2), ("EndBatch", 3)]


async def test_one_way_ends_of_one_loop_turn_go_as_one_publish(nc: Client) -> None:
    group = new_group()
    async with (
        serving_partitions(nc) as coord,
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        prepared = await gathered(
            *(client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(10))
        )
        wire.sent.clear()
        await gathered(*(client.end_oneway(r.txid, r.token, Decision.COMMIT) for r in prepared))
        await client.end_oneway(prepared[0].txid, prepared[0].token, Decision.COMMIT)
        await eventually(lambda: len(coord.ends) == 11, what="every end executed")
    assert [(s.kind, s.items, s.reply) for s in wire.sent] == [
        ("EndBatch", 10, ""),
        ("EndTransaction", 1, ""),  # alone in its turn: the plain verb
    ]
    assert [e.txid for e in coord.ends[:10]] == [r.txid for r in prepared]
    assert all(client.outcomes.get(r.txid) is Decision.COMMIT for r in prepared)


async def test_a_one_way_end_cancelled_before_its_turn_ends_is_not_sent(nc: Client) -> None:
    group = new_group()
    async with (
        serving_partitions(nc) as coord,
        watching(nc, group) as wire,
        client_for(nc, group) as client,
    ):
        kept, dropped = await gathered(
            *(client.prepare(uuid.uuid4().hex, halves(), None) for _ in range(2))
        )
        wire.sent.clear()
        ending = asyncio.ensure_future(client.end_oneway(kept.txid, kept.token, Decision.COMMIT))
        cancelled = asyncio.ensure_future(
            client.end_oneway(dropped.txid, dropped.token, Decision.COMMIT)
        )
        await asyncio.sleep(0)  # the scenario: both queued in this turn, then one cut off
        cancelled.cancel()
        await ending
        await eventually(lambda: len(coord.ends) == 1, what="the kept end executed")
    assert wire.kinds() == [("EndTransaction", 1)]
    assert [e.txid for e in coord.ends] == [kept.txid]
