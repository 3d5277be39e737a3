"""Every path that reads halves back from TXN_HALF by sequence, for halves stored in a pack
(the halves of several transactions in one stream message, all at its sequence) and for
halves stored alone (one message each, their fields as headers, as before packs).

The halves are written straight into TXN_HALF, and each reader is run on its own against a
real server: the check-back's messages (`checker.ask_producer`), a discard's copies
(`discard.discard`) and a committed half's read-back after a restart
(`Publisher.publish_from_stream`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from tests.support.logstreams import ensure_log_streams
from tests.support.txn import topic_messages
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.core import tokens
from txactors.coordinator.core.effects import CheckTarget, Discard, Publish, SendCheck
from txactors.coordinator.core.events import Published
from txactors.coordinator.core.records import DiscardReason, Half
from txactors.coordinator.options import DiscardedTransaction
from txactors.coordinator.partition.checker import ask_producer
from txactors.coordinator.partition.discard import discard
from txactors.coordinator.partition.halves import StoredHalf, half_headers, stored_half
from txactors.coordinator.partition.packs import pack_appends, read_raw_halves
from txactors.coordinator.partition.publisher import Publisher
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.writers import declare_topic, shared_writers
from txactors.nats.writer import Append, PartitionWriter
from txactors.wire import layout
from txactors.wire.protocol import (
    CheckedMessage,
    CheckResult,
    CheckTransaction,
    Decision,
    OutgoingMessage,
    encode,
)

Form = Literal["pack", "alone"]
FORMS: list[Form] = ["pack", "alone"]
BORN = 1732377600.25
TOKEN = tokens.digest(tokens.new_tokens(1)[0])
OPTIONS = CoordinatorOptions()


def half(txid: str, index: int, message: OutgoingMessage, *, begins: bool = True) -> StoredHalf:
    return stored_half(
        txid=txid,
        token_digest=TOKEN,
        group="g",
        producer="p1",
        begins=begins,
        index=index,
        born=BORN,
        message=message,
    )


def three_transactions() -> list[StoredHalf]:
    """Halves of t1, t2 and t3, interleaved as one round of prepares stores them."""
    return [
        half(
            "t1",
            0,
            OutgoingMessage(
                topic="orders",
                body=b"t1 zero",
                keys=["k1", "k2"],
                tag="paid",
                properties={"Region": "eu", "Lang": "café"},
                check_immunity=30.0,
            ),
        ),
        half("t2", 0, OutgoingMessage(topic="orders", body=b"t2 zero", properties={"A": "b"})),
        half("t1", 1, OutgoingMessage(topic="invoices", body=b"t1 one")),
        half("t3", 0, OutgoingMessage(topic="orders", body=b"t3 zero", tag="x")),
        half(
            "t2",
            1,
            OutgoingMessage(topic="invoices", body=b"t2 one", keys=["only"]),
            begins=False,
        ),
    ]


async def store(js: JetStreamContext, halves: list[StoredHalf], form: Form) -> list[Half]:
    """Write `halves` into TXN_HALF of partition 0 in `form`; their `Half`s, seqs set."""
    await ensure_log_streams(js, half_retention=3600)
    seqs: list[int] = []
    if form == "pack":
        for append, count in pack_appends(0, halves, 1 << 20):
            ack = await js.publish(append.subject, append.payload, headers=append.headers)
            seqs += [ack.seq] * count
    else:
        for stored in halves:
            headers = half_headers(stored)
            ack = await js.publish(layout.half_subject(0), stored.message.body, headers=headers)
            seqs.append(ack.seq)
    return [msgspec.structs.replace(s.half, seq=seq) for s, seq in zip(halves, seqs, strict=True)]


def of(txid: str, halves: list[StoredHalf], stored: list[Half]) -> tuple[Half, ...]:
    return tuple(h for s, h in zip(halves, stored, strict=True) if s.txid == txid)


def counting_reads(js: JetStreamContext) -> list[int]:
    """Record the sequence of every TXN_HALF message `js.get_msg` reads from now on."""
    reads: list[int] = []
    get_msg = js.get_msg

    async def counted(stream_name: str, seq: int | None = None, **kwargs: Any) -> RawStreamMsg:
        if stream_name == layout.half_stream(0) and seq is not None:
            reads.append(seq)
        return await get_msg(stream_name, seq, **kwargs)

    js.get_msg = counted  # type: ignore[method-assign]
    return reads


def test_a_pack_holds_every_half_at_one_sequence() -> None:
    appends = pack_appends(0, three_transactions(), 1 << 20)
    assert [count for _, count in appends] == [5], "the fixtures below rely on one pack"


# -- check-backs ----------------------------------------------------------------------------


async def serve_checks(nc: Client) -> list[CheckTransaction]:
    """Answer commit to every check-back of producer p1 of group g; the checks received."""
    seen: list[CheckTransaction] = []

    async def on_check(msg: Msg) -> None:
        check = msgspec.msgpack.decode(msg.data, type=CheckTransaction)
        seen.append(check)
        answer = CheckResult(txid=check.txid, check_id=check.check_id, resolution=Decision.COMMIT)
        await msg.respond(encode(answer))

    await nc.subscribe(layout.check_instance_subject("g", "p1"), cb=on_check)
    return seen


def send_check(txid: str, halves: tuple[Half, ...]) -> SendCheck:
    return SendCheck(
        txid=txid,
        check_id=7,
        target=CheckTarget.INSTANCE,
        group="g",
        producer="p1",
        check_times=2,
        halves=halves,
        timeout=5.0,
    )


@pytest.mark.parametrize("form", FORMS)
async def test_a_check_back_carries_exactly_its_transactions_messages(
    private_nc: Client, form: Form
) -> None:
    js = private_nc.jetstream()
    halves = three_transactions()
    stored = await store(js, halves, form)
    checks = await serve_checks(private_nc)
    reads = counting_reads(js)

    resolution, failure = await ask_producer(
        private_nc, js, send_check("t2", of("t2", halves, stored)), layout.half_stream(0)
    )

    assert (resolution, failure) == (Decision.COMMIT, None)
    [check] = checks
    assert (check.txid, check.group, check.check_id, check.check_times) == ("t2", "g", 7, 2)
    assert check.messages == [
        CheckedMessage(
            index=0, topic="orders", body=b"t2 zero", keys=[], tag=None, properties={"A": "b"}
        ),
        CheckedMessage(
            index=1, topic="invoices", body=b"t2 one", keys=["only"], tag=None, properties={}
        ),
    ]
    wanted = sorted({h.seq for h in of("t2", halves, stored)})
    assert sorted(reads) == wanted, "each TXN_HALF message read once"
    assert len(wanted) == (1 if form == "pack" else 2)


async def test_a_check_back_of_a_half_its_pack_does_not_hold_cannot_be_made(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    halves = three_transactions()
    stored = await store(js, halves, "pack")
    checks = await serve_checks(private_nc)
    t3 = of("t3", halves, stored)[0]
    wrong = (msgspec.structs.replace(t3, index=5),)  # t3 has no half 5 in that pack

    with pytest.raises(KeyError, match="half 5 of t3"):
        await ask_producer(private_nc, js, send_check("t3", wrong), layout.half_stream(0))
    assert checks == [], "nothing is asked of the producer"


# -- discards -------------------------------------------------------------------------------


@asynccontextmanager
async def discard_writer(nc: Client) -> AsyncIterator[PartitionWriter]:
    async def quarantine(append: Append, reason: str) -> None:
        raise AssertionError(f"nothing should be quarantined: {reason}")

    def failed(error: Exception) -> None:
        raise error

    async with shared_writers(nc, nc.jetstream(), OPTIONS) as writers:
        yield PartitionWriter(writers.discards, quarantine, failed)


async def discarded_copies(js: JetStreamContext) -> list[Msg]:
    return [
        m async for m in read_subject(js, layout.DISCARD_STREAM, layout.discard_subject("g"), 1)
    ]


def discarded_headers(index: int) -> dict[str, str]:
    """The headers documented for a discarded half of t1 (docs/protocol.md)."""
    common = {
        layout.MSG_ID_HEADER: f"t1:{index}:discard",
        layout.TXID_HEADER: "t1",
        layout.INDEX_HEADER: str(index),
        layout.TOKEN_HEADER: TOKEN,
        layout.GROUP_HEADER: "g",
        layout.PRODUCER_HEADER: "p1",
        layout.BORN_HEADER: "1732377600.25",
        layout.BEGINS_HEADER: "1",
        layout.DISCARD_REASON_HEADER: "check_max",
        layout.CHECK_TIMES_HEADER: "15",
    }
    if index == 0:
        return {
            **common,
            "Region": "eu",
            "Lang": "café",
            layout.TOPIC_HEADER: "orders",
            layout.TAG_HEADER: "paid",
            layout.KEYS_HEADER: "k1,k2",
            layout.IMMUNITY_HEADER: "30.0",
        }
    return {**common, layout.TOPIC_HEADER: "invoices"}


@pytest.mark.parametrize("form", FORMS)
async def test_a_discard_copies_exactly_its_halves_with_the_documented_headers(
    private_nc: Client, form: Form
) -> None:
    js = private_nc.jetstream()
    halves = three_transactions()
    stored = await store(js, halves, form)
    before = [
        await js.get_msg(layout.half_stream(0), seq) for seq in sorted({h.seq for h in stored})
    ]
    hooked: list[DiscardedTransaction] = []

    async def on_discard(discarded: DiscardedTransaction) -> None:
        hooked.append(discarded)

    action = Discard(
        txid="t1",
        group="g",
        producer="p1",
        halves=of("t1", halves, stored),
        reason=DiscardReason.CHECK_MAX,
        check_times=15,
    )
    reads = counting_reads(js)
    async with discard_writer(private_nc) as writer:
        with anyio.fail_after(10):
            await discard(js, writer, action, on_discard, layout.half_stream(0))

    copies = await discarded_copies(js)
    assert [m.data for m in copies] == [b"t1 zero", b"t1 one"]
    for index, copy in enumerate(copies):
        assert copy.headers == discarded_headers(index)
    assert sorted(reads) == sorted({h.seq for h in action.halves}), "each message read once"
    [discarded] = hooked
    assert (discarded.txid, discarded.reason, discarded.check_times) == ("t1", "check_max", 15)
    assert discarded.messages == [s.message for s in halves if s.txid == "t1"]
    after = [await js.get_msg(layout.half_stream(0), m.seq) for m in before]
    assert [(m.seq, m.data, m.hdrs) for m in after] == [(m.seq, m.data, m.hdrs) for m in before]
    left = [s for m in after for s in read_raw_halves(m) if s.txid != "t1"]
    assert sorted((s.txid, s.half.index) for s in left) == [("t2", 0), ("t2", 1), ("t3", 0)]

    async with discard_writer(private_nc) as writer:  # again, as after a crash: nothing doubles
        with anyio.fail_after(10):
            await discard(js, writer, action, None, layout.half_stream(0))
    assert len(await discarded_copies(js)) == 2


async def test_a_discard_copies_nothing_of_a_pack_that_does_not_hold_the_half(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    halves = three_transactions()
    stored = await store(js, halves, "pack")
    t1 = of("t1", halves, stored)
    hooked: list[DiscardedTransaction] = []

    async def on_discard(discarded: DiscardedTransaction) -> None:
        hooked.append(discarded)

    action = Discard(
        txid="t1",
        group="g",
        producer="p1",
        halves=(t1[0], msgspec.structs.replace(t1[1], index=9)),
        reason=DiscardReason.RETENTION,
        check_times=0,
    )
    async with discard_writer(private_nc) as writer:
        with anyio.fail_after(10):
            await discard(js, writer, action, on_discard, layout.half_stream(0))
    assert [(m.headers or {})[layout.MSG_ID_HEADER] for m in await discarded_copies(js)] == [
        "t1:0:discard"
    ]
    assert [m.body for m in hooked[0].messages] == [b"t1 zero"]


# -- publishing a committed half read back --------------------------------------------------


class Publishing:
    """What a `Publisher` reported published and quarantined."""

    def __init__(self) -> None:
        self.published: set[tuple[str, int]] = set()
        self.quarantined: list[str] = []

    async def on_published(self, done: list[Published]) -> None:
        self.published |= {(p.txid, p.index) for p in done}

    async def quarantine(self, append: Append, reason: str) -> None:
        self.quarantined.append(reason)


@asynccontextmanager
async def publishing(nc: Client, js: JetStreamContext, run: Publishing) -> AsyncIterator[Publisher]:
    """A `Publisher` of partition 0 with no kept bodies, as after a restart."""
    for topic in ("orders", "invoices"):
        await declare_topic(js, OPTIONS, topic)

    def failed(error: Exception) -> None:
        raise error

    async with shared_writers(nc, js, OPTIONS) as writers:

        def writer_of(topic: str) -> PartitionWriter:
            return PartitionWriter(writers.topic(topic), run.quarantine, failed)

        clock = lambda: BORN + 10  # noqa: E731
        yield Publisher(nc, js, writer_of, 0, OPTIONS, clock, run.quarantine, run.on_published)


def publishes(txid: str, halves: list[StoredHalf], stored: list[Half]) -> list[Publish]:
    return [
        Publish(txid=txid, index=h.index, topic=h.topic, half_seq=h.seq)
        for h in of(txid, halves, stored)
    ]


async def published_on(nc: Client, topic: str) -> dict[str, Msg]:
    return {(m.headers or {})[layout.MSG_ID_HEADER]: m for m in await topic_messages(nc, topic)}


@pytest.mark.parametrize("form", FORMS)
async def test_committed_halves_read_back_are_published_with_their_ids(
    private_nc: Client, form: Form
) -> None:
    js = private_nc.jetstream()
    halves = three_transactions()
    stored = await store(js, halves, form)
    actions = publishes("t1", halves, stored) + publishes("t3", halves, stored)
    run = Publishing()
    async with publishing(private_nc, js, run) as publisher:
        reads = counting_reads(js)
        groups = publisher.publish(actions)
        assert [a for g in groups for a in g] == actions, "none was kept"
        assert [len(g) for g in groups] == ([3] if form == "pack" else [1, 1, 1])
        for group in groups:
            await publisher.publish_from_stream(group)
        await eventually(
            lambda: run.published,
            until=lambda done: done == {(a.txid, a.index) for a in actions},
            what="every committed half published",
        )
        assert sorted(reads) == sorted({a.half_seq for a in actions}), "each message read once"
        assert run.quarantined == []

    orders, invoices = (
        await published_on(private_nc, "orders"),
        await published_on(private_nc, "invoices"),
    )
    assert sorted(orders) == ["t1:0", "t3:0"], "t2 was not committed"
    assert sorted(invoices) == ["t1:1"]
    first, second, third = orders["t1:0"], invoices["t1:1"], orders["t3:0"]
    assert (first.data, second.data, third.data) == (b"t1 zero", b"t1 one", b"t3 zero")
    assert first.subject == "topic.orders.paid"
    headers = first.headers or {}
    assert {k: headers[k] for k in ("Region", "Lang")} == {"Region": "eu", "Lang": "café"}
    assert (headers[layout.TXID_HEADER], headers[layout.INDEX_HEADER]) == ("t1", "0")
    assert (headers[layout.GROUP_HEADER], headers[layout.KEYS_HEADER]) == ("g", "k1,k2")
    assert headers[layout.TAG_HEADER] == "paid"
    assert (third.headers or {})[layout.TAG_HEADER] == "x"


async def test_a_committed_half_its_pack_does_not_hold_is_quarantined_and_the_rest_published(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    halves = three_transactions()
    stored = await store(js, halves, "pack")
    [t3] = publishes("t3", halves, stored)
    stray = msgspec.structs.replace(t3, txid="t9")  # recorded at the pack's seq, not in it
    run = Publishing()
    async with publishing(private_nc, js, run) as publisher:
        [group] = publisher.publish([t3, stray])
        await publisher.publish_from_stream(group)
        await eventually(
            lambda: run.published,
            until=lambda done: done == {("t3", 0), ("t9", 0)},
            what="both reported published, one quarantined",
        )
        [reason] = run.quarantined
        assert "half 0 of t9" in reason and "cannot be read" in reason
    assert sorted(await published_on(private_nc, "orders")) == ["t3:0"]
