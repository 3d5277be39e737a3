"""Upgrading from 0.2's one-stream layout: every open transaction it left is resolved once.

The deployment is built as 0.2 left it, by writing its streams directly with the project's
own encoders (halves stored alone and in packs in TXN_HALF, op records in TXN_OP, a
checkpoint pointing into them), then the coordinators of today start on it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.js.errors
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.kv import KeyValue

from tests.support.txn import FAST, CoordinatorClient, message, topic_messages
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorConfig, CoordinatorOptions
from txactors.coordinator.core import tokens
from txactors.coordinator.core.records import DiscardReason, Half, OpKind, OpRecord
from txactors.coordinator.core.transactions import Checkpoint, ParkedTxn
from txactors.coordinator.partition import upgrade
from txactors.coordinator.partition.checkpoints import encode_ops, load_checkpoint, save_checkpoint
from txactors.coordinator.partition.halves import StoredHalf, half_headers, stored_half
from txactors.coordinator.partition.packs import pack_appends
from txactors.coordinator.partition.streams import DEDUPE_WINDOW, ensure_streams, log_retention
from txactors.coordinator.partition.upgrade import RETIRED_SUBJECTS, LegacyLog, upgraded_key
from txactors.coordinator.service import run_coordinator
from txactors.wire import layout
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    CheckResult,
    CheckTransaction,
    Decision,
    ListTransactions,
    TransactionInfo,
    encode,
)

PARTITIONS = 2
CONFIG = CoordinatorConfig(**FAST)
OPTIONS = CoordinatorOptions(
    partitions=PARTITIONS, tick_interval=0.02, checkpoint_interval=0.1, lease_ttl=2.0
)
TOPIC = "orders"
IMMUNE = 300.0
"""Check immunity of the transactions their producer ends: no check-back races the end."""


@contextmanager
def capture_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every log event, INFO included, whatever level the tests run at."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(**saved)


def events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    return [e for e in logs if e["event"] == name]


def txid_in(partition: int, name: str) -> str:
    """A txid starting with `name` that hashes to `partition`."""
    for n in itertools.count():
        txid = f"{name}-{n}"
        if layout.partition_of(txid, PARTITIONS) == partition:
            return txid
    raise AssertionError("unreachable")


async def declare_legacy_streams(js: JetStreamContext) -> KeyValue:
    """TXN_HALF and TXN_OP exactly as 0.2's `ensure_streams` declared them (one stream each for
    every partition), with the discard stream and checkpoint bucket it shared with today."""
    retention = log_retention(CoordinatorConfig().half_retention)
    await js.add_stream(
        StreamConfig(
            name=layout.LEGACY_HALF_STREAM,
            subjects=[layout.legacy_half_filter()],
            max_age=retention,
            duplicate_window=DEDUPE_WINDOW,
            allow_direct=True,
            allow_atomic=True,
            storage=StorageType.FILE,
            num_replicas=1,
        )
    )
    await js.add_stream(
        StreamConfig(
            name=layout.LEGACY_OP_STREAM,
            subjects=[layout.legacy_op_filter()],
            max_age=retention,
            duplicate_window=DEDUPE_WINDOW,
            allow_atomic=True,
            storage=StorageType.FILE,
            num_replicas=1,
        )
    )
    return await ensure_streams(js)


@dataclass
class Legacy:
    """A 0.2 log being written: what each transaction is, and what tells it apart."""

    js: JetStreamContext
    tokens: dict[str, str] = field(default_factory=dict)
    seqs: dict[str, list[int]] = field(default_factory=dict)
    bodies: dict[str, list[bytes]] = field(default_factory=dict)
    born: dict[str, float] = field(default_factory=dict)

    def halves(
        self, partition: int, name: str, count: int = 1, *, immunity: float | None = None
    ) -> list[StoredHalf]:
        txid = txid_in(partition, name)
        [token] = tokens.new_tokens(1)
        self.tokens[txid] = token
        self.bodies[txid] = [f"{txid}/{i}".encode() for i in range(count)]
        self.born[txid] = born = time.time() - 1.0
        return [
            stored_half(
                txid=txid,
                token_digest=tokens.digest(token),
                group="g",
                producer="p1",
                begins=True,
                index=i,
                born=born,
                message=message(TOPIC, body, check_immunity=immunity),
            )
            for i, body in enumerate(self.bodies[txid])
        ]

    async def alone(self, partition: int, halves: list[StoredHalf]) -> list[int]:
        """Halves stored one message each, as before packs."""
        seqs = []
        for stored in halves:
            ack = await self.js.publish(
                layout.half_subject(partition), stored.message.body, headers=half_headers(stored)
            )
            self.seqs.setdefault(stored.txid, []).append(ack.seq)
            seqs.append(ack.seq)
        return seqs

    async def packed(self, partition: int, halves: list[StoredHalf]) -> int:
        """Halves (of any transactions) in one pack, on the old stream's subject."""
        [(append, count)] = pack_appends(partition, halves, 512 * 1024)
        assert count == len(halves)
        ack = await self.js.publish(
            layout.half_subject(partition), append.payload, headers=append.headers
        )
        for stored in halves:
            self.seqs.setdefault(stored.txid, []).append(ack.seq)
        return ack.seq

    async def ops(self, partition: int, *records: OpRecord) -> int:
        ack = await self.js.publish(layout.op_subject(partition), encode_ops(list(records)))
        return ack.seq


@dataclass
class Left:
    """What 0.2 left, by txid."""

    legacy: Legacy
    ended_by_producer: dict[str, Decision]
    checked_back: list[str]
    committing: list[str]
    partly: list[str]
    """Committed with only its first half: the second came after the decision."""
    never_published: list[str]
    discarded: dict[str, tuple[int, DiscardReason]]
    """txid: (check count, reason)."""
    parked: str
    """Discarded before partition 0's checkpoint: known only from the checkpoint."""
    history: str
    """Committed and done before partition 0's checkpoint: never read again."""


async def leave_as_0_2_did(js: JetStreamContext) -> Left:
    """Open transactions of every state on both partitions, and a checkpoint of partition 0
    that starts its replay past a finished transaction and parks a discarded one."""
    kv = await declare_legacy_streams(js)
    log = Legacy(js)
    # Partition 0's history before its checkpoint.
    history = log.halves(0, "history")
    await log.alone(0, history)
    await log.ops(
        0,
        OpRecord(
            txid=history[0].txid, kind=OpKind.COMMIT, half_seqs=tuple(log.seqs[history[0].txid])
        ),
    )
    done_seq = await log.ops(0, OpRecord(txid=history[0].txid, kind=OpKind.DONE))
    # What lies before a checkpoint is never read again, so it need not be whole: here the
    # `done` is gone, and a replay from the start would publish `history` again.
    await js.delete_msg(layout.LEGACY_OP_STREAM, done_seq)
    parked = log.halves(0, "parked")
    [parked_seq] = await log.alone(0, parked)
    await log.ops(
        0,
        OpRecord(
            txid=parked[0].txid, kind=OpKind.DISCARD, check_times=4, reason=DiscardReason.CHECK_MAX
        ),
    )
    # Partition 1 writes meanwhile: the streams are shared, so its sequences interleave.
    other = log.halves(1, "before-checkpoint", immunity=IMMUNE)
    await log.alone(1, other)
    half_info = await js.stream_info(layout.LEGACY_HALF_STREAM)
    op_info = await js.stream_info(layout.LEGACY_OP_STREAM)
    parked_txn = ParkedTxn(
        txid=parked[0].txid,
        token=parked[0].token,
        group="g",
        producer="p1",
        halves=(Half(index=0, topic=TOPIC, seq=parked_seq, born=parked[0].half.born),),
        check_times=4,
        reason=DiscardReason.CHECK_MAX,
    )
    checkpoint = Checkpoint(
        half_info.state.last_seq + 1, op_info.state.last_seq + 1, discarded=(parked_txn,)
    )
    await save_checkpoint(kv, 0, checkpoint, legacy=True)

    ended: dict[str, Decision] = {other[0].txid: Decision.COMMIT}
    checked: list[str] = []
    committing: list[str] = []
    partly: list[str] = []
    never: list[str] = [history[0].txid]
    discarded: dict[str, tuple[int, DiscardReason]] = {}
    for p in range(PARTITIONS):
        prepared = log.halves(p, "prepared", immunity=IMMUNE)  # no op record
        to_roll_back = log.halves(p, "to-roll-back", immunity=IMMUNE)
        commit_me = log.halves(p, "committing", 2)  # COMMIT without DONE
        await log.alone(p, prepared)
        await log.packed(p, [*to_roll_back, *commit_me])
        with_checks = log.halves(p, "checked")  # two inconclusive checks so far
        await log.packed(p, with_checks)
        done = log.halves(p, "done", 2)
        rolled_back = log.halves(p, "rolled-back")
        thrown = log.halves(p, "discarded")
        await log.packed(p, [*done, *rolled_back])
        await log.alone(p, thrown)
        part = log.halves(p, "partly", 2)
        first_seq, _ = await log.alone(p, part)
        records = [
            OpRecord(txid=with_checks[0].txid, kind=OpKind.CHECKED, check_times=1),
            OpRecord(
                txid=commit_me[0].txid,
                kind=OpKind.COMMIT,
                half_seqs=tuple(log.seqs[commit_me[0].txid]),
            ),
            OpRecord(
                txid=done[0].txid, kind=OpKind.COMMIT, half_seqs=tuple(log.seqs[done[0].txid])
            ),
            OpRecord(txid=rolled_back[0].txid, kind=OpKind.ROLLBACK),
            OpRecord(txid=part[0].txid, kind=OpKind.COMMIT, half_seqs=(first_seq,)),
        ]
        await log.ops(p, *records)
        await log.ops(
            p,
            OpRecord(txid=with_checks[0].txid, kind=OpKind.CHECKED, check_times=2),
            OpRecord(txid=done[0].txid, kind=OpKind.DONE),
            OpRecord(
                txid=thrown[0].txid,
                kind=OpKind.DISCARD,
                check_times=3,
                reason=DiscardReason.RETENTION,
            ),
        )
        ended[prepared[0].txid] = Decision.COMMIT
        ended[to_roll_back[0].txid] = Decision.ROLLBACK
        checked.append(with_checks[0].txid)
        committing.append(commit_me[0].txid)
        partly.append(part[0].txid)
        never += [done[0].txid, rolled_back[0].txid, thrown[0].txid, to_roll_back[0].txid]
        discarded[thrown[0].txid] = (3, DiscardReason.RETENTION)
    discarded[parked[0].txid] = (4, DiscardReason.CHECK_MAX)
    return Left(
        log, ended, checked, committing, partly, never, discarded, parked[0].txid, history[0].txid
    )


class Killed(BaseException):
    """The coordinator process dying mid-carry-over."""


@dataclass
class CheckResponder:
    """The producer instance `p1` answering check-backs: commits what it is asked about."""

    asked: list[CheckTransaction] = field(default_factory=list)

    async def answer(self, msg: Msg) -> None:
        check = msgspec.msgpack.decode(msg.data, type=CheckTransaction)
        self.asked.append(check)
        answer = CheckResult(txid=check.txid, check_id=check.check_id, resolution=Decision.COMMIT)
        await msg.respond(encode(answer))


async def listed(nc: Client, partition: int, *states: str) -> list[TransactionInfo]:
    answer = await CoordinatorClient(nc, partition).admin(
        ListTransactions(states=list(states), version=PROTOCOL_VERSION)
    )
    return list(answer.transactions)


async def legacy_last_seqs(js: JetStreamContext) -> tuple[int, int]:
    half = await js.stream_info(layout.LEGACY_HALF_STREAM)
    op = await js.stream_info(layout.LEGACY_OP_STREAM)
    return half.state.last_seq, op.state.last_seq


async def published(nc: Client) -> dict[str, list[bytes]]:
    """Each `Nats-Msg-Id` on the topic with every body published under it."""
    found: dict[str, list[bytes]] = {}
    for m in await topic_messages(nc, TOPIC):
        found.setdefault((m.headers or {})[layout.MSG_ID_HEADER], []).append(m.data)
    return found


async def resolve_everything(nc: Client, left: Left, responder: CheckResponder) -> None:
    """End what a producer would, let the checker ask about the rest, and wait for all of it."""
    for txid, decision in left.ended_by_producer.items():
        partition = layout.partition_of(txid, PARTITIONS)
        ended = await CoordinatorClient(nc, partition).end(txid, left.legacy.tokens[txid], decision)
        assert ended.state == ("committed" if decision is Decision.COMMIT else "rolled_back")
    await eventually(
        lambda: published(nc),
        until=lambda ids: {layout.message_id(t, 0) for t in left.checked_back} <= set(ids),
        what="the checked-back transactions committed by their producer",
    )
    assert {c.txid for c in responder.asked} == set(left.checked_back)


def expected_ids(left: Left) -> dict[str, list[bytes]]:
    """Every message that must be on the topic, each once, with its body."""
    committed = [
        *(t for t, d in left.ended_by_producer.items() if d is Decision.COMMIT),
        *left.checked_back,
        *left.committing,
    ]
    expected = {
        layout.message_id(txid, i): [body]
        for txid in committed
        for i, body in enumerate(left.legacy.bodies[txid])
    }
    for txid in left.partly:
        expected[layout.message_id(txid, 0)] = left.legacy.bodies[txid][:1]
    return expected


async def assert_resolved(nc: Client, left: Left) -> None:
    """Every transaction as it should be: the committed on the topic once, the others not,
    the discarded listed, nothing left open."""
    expected = expected_ids(left)
    await eventually(
        lambda: published(nc),
        until=lambda ids: set(expected) <= set(ids),
        what="every committed transaction published",
    )
    found = await published(nc)
    assert not {layout.message_id(t, 0) for t in left.never_published} & set(found)
    assert found == expected, "each once, the rolled back and discarded never"
    discarded = {}
    for p in range(PARTITIONS):
        for info in await listed(nc, p, "discarded"):
            discarded[info.txid] = (info.check_times, DiscardReason(info.discard_reason))
        assert await listed(nc, p, "prepared", "checking") == []
    assert discarded == left.discarded


async def test_every_open_transaction_of_the_one_stream_layout_is_resolved_once(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    left = await leave_as_0_2_did(js)
    before = await legacy_last_seqs(js)
    responder = CheckResponder()
    await private_nc.subscribe(layout.check_instance_subject("g", "p1"), cb=responder.answer)
    await private_nc.flush()

    with capture_logs() as logs:
        async with run_coordinator(private_nc, config=CONFIG, options=OPTIONS) as coordinator:
            assert sorted(coordinator.partitions) == [0, 1]
            await reopened_then_resolved(private_nc, left, responder)
    retired = events(logs, "legacy_stream_retired")
    assert sorted(e["stream"] for e in retired) == ["TXN_HALF", "TXN_OP"]
    finished = {e["partition"]: e["transactions"] for e in events(logs, "legacy_log_finished")}
    # Each: prepared, to-roll-back, committing, partly, checked, discarded; p0 the parked one too,
    # p1 the one prepared before p0's checkpoint.
    assert finished == {0: 7, 1: 7}
    assert not events(logs, "legacy_transaction_unreadable")
    assert not events(logs, "record_quarantined")
    first_checks: dict[str, int] = {}
    for check in responder.asked:
        first_checks.setdefault(check.txid, check.check_times)
    assert first_checks == dict.fromkeys(left.checked_back, 2), "the check count carried over"

    # Nothing was written to the old streams, which no longer hold the partitions' subjects.
    assert await legacy_last_seqs(js) == before
    for stream, subject in RETIRED_SUBJECTS.items():
        assert (await js.stream_info(stream)).config.subjects == [subject]
    kv = await js.key_value(layout.CHECKPOINT_BUCKET)
    for p in range(PARTITIONS):
        assert (await kv.get(upgraded_key(p))).value == b"1"

    # A restart carries nothing over again: the same outcome, nothing published twice.
    with capture_logs() as logs:
        async with run_coordinator(private_nc, config=CONFIG, options=OPTIONS):
            await assert_resolved(private_nc, left)
    assert not events(logs, "legacy_log_finished")
    assert not events(logs, "legacy_stream_retired")
    assert await legacy_last_seqs(js) == before


async def reopened_then_resolved(nc: Client, left: Left, responder: CheckResponder) -> None:
    """What was open is open again, as it was (born when it was, no check yet), then each is
    resolved."""
    for p in range(PARTITIONS):
        prepared = {t.txid: t for t in await listed(nc, p, "prepared", "checking")}
        ended_here = {t for t in left.ended_by_producer if layout.partition_of(t, PARTITIONS) == p}
        assert ended_here <= set(prepared)
        for txid in ended_here:
            info = prepared[txid]
            assert info.born == pytest.approx(left.legacy.born[txid], abs=0.001), "born kept"
            assert info.check_times == 0
    await resolve_everything(nc, left, responder)
    await assert_resolved(nc, left)


async def test_a_carry_over_cut_short_is_done_again_whole_on_restart(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    js = private_nc.jetstream()
    left = await leave_as_0_2_did(js)
    real_encode = upgrade.encode_ops

    def crash(records: list[OpRecord]) -> bytes:
        [record] = records
        if record.kind is OpKind.COMMIT and record.txid == left.committing[0]:  # partition 0
            raise Killed
        return real_encode(records)

    # Partition 0 has written a commit's halves to its new stream, and some transactions
    # before it, not the commit: the process dies there (a BaseException: no supervisor
    # restarts the partition, the whole coordinator ends, partition 1 wherever it was).
    monkeypatch.setattr(upgrade, "encode_ops", crash)
    with pytest.raises(Killed):
        async with run_coordinator(private_nc, config=CONFIG, options=OPTIONS):
            pass
    assert (await js.stream_info(layout.half_stream(0))).state.messages > 1
    kv = await js.key_value(layout.CHECKPOINT_BUCKET)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(upgraded_key(0))
    monkeypatch.setattr(upgrade, "encode_ops", real_encode)

    responder = CheckResponder()
    await private_nc.subscribe(layout.check_instance_subject("g", "p1"), cb=responder.answer)
    await private_nc.flush()
    with capture_logs() as logs:
        async with run_coordinator(private_nc, config=CONFIG, options=OPTIONS) as coordinator:
            await eventually(  # the dead process's leases lapse first
                lambda: sorted(coordinator.partitions),
                until=lambda owned: owned == [0, 1],
                what="both partitions taken again",
            )
            await resolve_everything(private_nc, left, responder)
            await assert_resolved(private_nc, left)
    assert {e["partition"] for e in events(logs, "legacy_log_finished")} >= {0}
    assert not events(logs, "record_quarantined")


async def test_a_deployment_without_the_old_streams_has_nothing_to_carry_over(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    checkpoints = await ensure_streams(js)
    assert await LegacyLog.find(js, checkpoints, CONFIG) is None
    with capture_logs() as logs:
        async with run_coordinator(private_nc, config=CONFIG, options=OPTIONS):
            pass
    assert not events(logs, "legacy_log_finished")
    for stream in (layout.LEGACY_HALF_STREAM, layout.LEGACY_OP_STREAM):
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.stream_info(stream)
    for p in range(PARTITIONS):
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await checkpoints.get(upgraded_key(p))
        assert await load_checkpoint(checkpoints, p) is not None
