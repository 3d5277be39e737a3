"""Recovery costs what is open, not what happened, and survives garbage in its own streams."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.integration.test_coordinator_batches import prepare_batch
from tests.support.txn import FAST, CoordinatorClient, message, topic_ids, topic_messages
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorConfig, CoordinatorOptions
from txactors.coordinator.core import tokens
from txactors.coordinator.core.records import OpKind, OpRecord
from txactors.coordinator.core.transactions import Checkpoint
from txactors.coordinator.partition import actor as partition_module
from txactors.coordinator.partition.checkpoints import encode_ops, load_checkpoint, save_checkpoint
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError
from txactors.wire import layout
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    CommitTransaction,
    Decision,
    ListTransactions,
    Prepared,
    PrepareItem,
    ShowTransaction,
)

OPTIONS = CoordinatorOptions(tick_interval=0.02, checkpoint_interval=0.1)


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


def recovered(logs: list[MutableMapping[str, Any]]) -> MutableMapping[str, Any]:
    [event] = [e for e in logs if e["event"] == "coordinator_recovered"]
    return event


async def test_a_discarded_transaction_does_not_make_recovery_reread_history(
    private_nc: Client,
) -> None:
    committed = 200
    config = CoordinatorConfig(check_max=1, **FAST)
    async with run_coordinator(private_nc, config=config, options=OPTIONS):
        client = CoordinatorClient(private_nc)
        await client.prepare("lost", message(), group="nobody-answers")
        await eventually(
            lambda: client.admin(ShowTransaction(txid="lost", version=PROTOCOL_VERSION)),
            until=lambda info: info.state == "discarded",
            what="lost discarded",
        )
        for n in range(committed):
            receipt = await client.prepare(f"t{n}", message())
            await client.end(f"t{n}", receipt.token, Decision.COMMIT)
        js = private_nc.jetstream()
        kv = await js.key_value(layout.CHECKPOINT_BUCKET)
        last_half = (await js.get_last_msg(layout.log_stream(0), layout.half_subject(0))).seq
        await eventually(
            lambda: load_checkpoint(kv, 0),
            until=lambda checkpoint: checkpoint.half_seq > last_half,
            what="a checkpoint past every committed half saved",
        )
        assert [p.txid for p in (await load_checkpoint(kv, 0)).discarded] == ["lost"]

    with capture_logs() as logs:
        async with run_coordinator(private_nc, config=config, options=OPTIONS):
            client = CoordinatorClient(private_nc)
            listed = await client.admin(
                ListTransactions(states=["discarded"], version=PROTOCOL_VERSION)
            )
            assert [t.txid for t in listed.transactions] == ["lost"], "still there to resolve"
            # An operator can still resolve it by hand after the restart: its body is read
            # back from TXN_HALF by the sequence the checkpoint kept.
            forced = await client.admin(CommitTransaction(txid="lost", version=PROTOCOL_VERSION))
            assert forced.state == "committed"
            assert "lost:0" in await topic_ids(private_nc, "orders")
    assert recovered(logs)["halves_read"] < 5, "not the 200 committed since the discard"


async def test_garbage_in_the_coordinators_own_streams_is_quarantined_not_fatal(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc, options=OPTIONS):
        pass  # the streams exist
    js = private_nc.jetstream()
    await js.publish(layout.half_subject(0), b"no headers at all")
    await js.publish(layout.half_subject(0), b"x", headers={layout.TXID_HEADER: "only-a-txid"})
    await js.publish(layout.half_subject(0), b"\xc1 not msgpack", headers={layout.PACK_HEADER: "1"})
    await private_nc.publish(layout.op_subject(0), b"\xc1 not msgpack")
    await private_nc.flush()

    with capture_logs() as logs:
        async with run_coordinator(private_nc, options=OPTIONS) as coordinator:
            assert coordinator.partitions == [0]
            client = CoordinatorClient(private_nc)
            receipt = await client.prepare("after-garbage", message())
            ended = await client.end("after-garbage", receipt.token, Decision.COMMIT)
            assert ended.state == "committed"
    assert recovered(logs)["halves_read"] == 3
    quarantined = [e for e in logs if e["event"] == "record_quarantined"]
    assert sorted(e["stream"] for e in quarantined) == ["TXN_LOG_0"] * 4
    copies = [
        m async for m in read_subject(js, layout.DISCARD_STREAM, layout.quarantine_subject(), 1)
    ]
    assert len(copies) == 4
    assert [c.data for c in copies if layout.PACK_HEADER in (c.headers or {})] == [
        b"\xc1 not msgpack"
    ], "a pack is quarantined whole"
    for copy in copies:
        headers = copy.headers or {}
        assert headers[layout.QUARANTINE_REASON_HEADER].startswith("unreadable in recovery")
        assert headers[layout.ORIGIN_STREAM_HEADER] == "TXN_LOG_0"

    # A second restart copies nothing twice (the copies are deduplicated by stream and seq).
    async with run_coordinator(private_nc, options=OPTIONS):
        pass
    again = [
        m async for m in read_subject(js, layout.DISCARD_STREAM, layout.quarantine_subject(), 1)
    ]
    assert len(again) == 4


async def test_transactions_stored_in_one_pack_are_rebuilt_after_a_restart(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc, options=OPTIONS):
        client = CoordinatorClient(private_nc)
        warm_up = await client.prepare("warm-up", message())  # TXN_OP is not empty
        await client.end("warm-up", warm_up.token, Decision.COMMIT)
        answer = await prepare_batch(
            private_nc,
            [
                PrepareItem(txid="pk-a", messages=[message(body=b"a0"), message(body=b"a1")]),
                PrepareItem(txid="pk-done", messages=[message(body=b"done")]),
                PrepareItem(txid="pk-b", messages=[message(body=b"b0")]),
            ],
        )
        receipts = {r.txid: r for r in answer.results if isinstance(r, Prepared)}
        [seq] = {s for r in receipts.values() for s in r.seqs}  # one pack
        done = receipts["pk-done"]
        assert (await client.end("pk-done", done.token, Decision.COMMIT)).state == "committed"
        kv = await private_nc.jetstream().key_value(layout.CHECKPOINT_BUCKET)
        await eventually(
            lambda: load_checkpoint(kv, 0),
            until=lambda checkpoint: checkpoint.half_seq == seq and checkpoint.op_seq > 1,
            what="a checkpoint at the pack that does not read TXN_OP from its start",
        )

    with capture_logs() as logs:
        async with run_coordinator(private_nc, options=OPTIONS):
            client = CoordinatorClient(private_nc)
            listed = await client.admin(ListTransactions(version=PROTOCOL_VERSION))
            assert [(t.txid, t.state, t.half_seqs) for t in listed.transactions] == [
                ("pk-a", "prepared", [seq, seq]),
                ("pk-b", "prepared", [seq]),
            ], "the pack's open transactions, in its order; the finished one stays finished"
            for txid in ("pk-a", "pk-b"):
                ended = await client.end(txid, receipts[txid].token, Decision.COMMIT)
                assert ended.state == "committed"
            await eventually(
                lambda: topic_ids(private_nc, "orders"),
                until=lambda ids: {"pk-a:0", "pk-a:1", "pk-b:0"} <= set(ids),
                what="the recovered transactions published from the pack",
            )
    assert recovered(logs)["halves_read"] == 1, "one TXN_HALF message"
    assert not [e for e in logs if e["event"] == "record_quarantined"]
    published = {
        (m.headers or {})[layout.MSG_ID_HEADER]: m.data
        for m in await topic_messages(private_nc, "orders")
    }
    assert [published[i] for i in ("pk-a:0", "pk-a:1", "pk-done:0", "pk-b:0")] == [
        b"a0",
        b"a1",
        b"done",
        b"b0",
    ]


def old_half_headers(txid: str, index: int, token: str, *, begins: bool) -> dict[str, str]:
    """A half's headers as an earlier 0.x wrote them: the txid and
    index in headers of their own, the whole SHA-256 of the token, `Txn-Begins` always."""
    return {
        layout.MSG_ID_HEADER: f"{txid}:{index}:half",
        layout.TXID_HEADER: txid,
        layout.TOKEN_HEADER: "sha256:" + hashlib.sha256(token.encode()).hexdigest(),
        layout.GROUP_HEADER: "g",
        layout.PRODUCER_HEADER: "p-1",
        layout.BEGINS_HEADER: "1" if begins else "0",
        layout.INDEX_HEADER: str(index),
        layout.TOPIC_HEADER: "orders",
        layout.BORN_HEADER: repr(time.time()),
        layout.KEYS_HEADER: "k1,k2",
        "Region": "eu",
    }


async def test_records_written_before_the_header_diet_are_recovered_after_an_upgrade(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc, options=OPTIONS):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("new", message())  # declares the topic's stream
        await client.end("new", receipt.token, Decision.COMMIT)
    js = private_nc.jetstream()
    token = tokens.new_tokens(1)[0]
    for index in (0, 1):  # open: its end comes after the upgrade, with its token
        headers = old_half_headers("old-open", index, token, begins=index == 0)
        await js.publish(layout.half_subject(0), f"open {index}".encode(), headers=headers)
    committed = await js.publish(
        layout.half_subject(0),
        b"committed",
        headers=old_half_headers("old-committed", 0, tokens.new_tokens(1)[0], begins=True),
    )
    old_commit = {  # an op record as msgspec wrote it before `omit_defaults`: every field
        "txid": "old-committed",
        "kind": "commit",
        "half_seqs": [committed.seq],
        "check_times": 0,
        "by_operator": False,
        "reason": None,
    }
    await js.publish(layout.op_subject(0), msgspec.msgpack.encode([old_commit]))

    with capture_logs() as logs:
        async with run_coordinator(private_nc, options=OPTIONS):
            client = CoordinatorClient(private_nc)
            await eventually(
                lambda: topic_ids(private_nc, "orders"),
                until=lambda ids: "old-committed:0" in ids,
                what="the old commit published by recovery",
            )
            info = await client.admin(ShowTransaction(txid="old-open", version=PROTOCOL_VERSION))
            assert (info.state, info.group, info.producer) == ("prepared", "g", "p-1")
            assert info.half_seqs == [committed.seq - 2, committed.seq - 1]
            ended = await client.end("old-open", token, Decision.COMMIT)
            assert ended.state == "committed", "the old digest matches its token"
    assert not [e for e in logs if e["event"] == "record_quarantined"]
    published = {
        (m.headers or {})[layout.MSG_ID_HEADER]: m
        for m in await topic_messages(private_nc, "orders")
    }
    assert {i: published[i].data for i in ("old-open:0", "old-open:1", "old-committed:0")} == {
        "old-open:0": b"open 0",
        "old-open:1": b"open 1",
        "old-committed:0": b"committed",
    }
    for msg_id in ("old-open:1", "old-committed:0"):
        headers = published[msg_id].headers or {}
        txid, index = msg_id.split(":")
        assert (headers[layout.TXID_HEADER], headers[layout.INDEX_HEADER]) == (txid, index)
        assert (headers[layout.KEYS_HEADER], headers["Region"]) == ("k1,k2", "eu")


async def test_a_decision_that_lands_after_recoverys_read_is_applied_before_serving(
    private_nc: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A predecessor's last op write (a graceful leaver's, whose ack was still on its way when
    it gave the lease back) lands after recovery read TXN_OP but before the new owner takes
    its fence: the new owner must apply it (commit and publish), not serve on without it
    (checking back a committed transaction) behind a fence past it."""
    config = CoordinatorConfig(**FAST)
    async with run_coordinator(private_nc, config=config, options=OPTIONS):
        client = CoordinatorClient(private_nc)
        warm_up = await client.prepare("warm-up", message())  # TXN_OP is not empty
        await client.end("warm-up", warm_up.token, Decision.COMMIT)
        receipt = await client.prepare("late-commit", message(body=b"late"))
    js = private_nc.jetstream()
    commit = OpRecord(txid="late-commit", kind=OpKind.COMMIT, half_seqs=tuple(receipt.seqs))
    real_recover = partition_module.recover
    landed: list[int] = []

    async def recover_then_predecessor_writes(*args: Any, **kwargs: Any) -> Any:
        recovered = await real_recover(*args, **kwargs)
        if not landed:  # the predecessor's write lands right after recovery's read
            ack = await js.publish(layout.op_subject(0), encode_ops([commit]))
            landed.append(ack.seq)
        return recovered

    monkeypatch.setattr(partition_module, "recover", recover_then_predecessor_writes)
    checks: list[Msg] = []

    async def checked(msg: Msg) -> None:
        checks.append(msg)

    subscription = await private_nc.subscribe("txn.check.>", cb=checked)
    try:
        async with run_coordinator(private_nc, config=config, options=OPTIONS):
            client = CoordinatorClient(private_nc)
            await eventually(
                lambda: topic_ids(private_nc, "orders"),
                until=lambda ids: "late-commit:0" in ids,
                timeout=5,
                what="the commit that landed after recovery's read published",
            )

            # Its `done` is the new owner's first write: the fence is past the record.
            async def state() -> str:
                try:
                    info = await client.admin(
                        ShowTransaction(txid="late-commit", version=PROTOCOL_VERSION)
                    )
                except CommandError as error:  # finished: no longer open
                    return str(error)
                return info.state

            await eventually(
                state,
                until=lambda seen: "it is committed" in seen,
                timeout=5,
                what="late-commit finished by the new owner's own write",
            )
            after = await client.prepare("after", message())
            ended = await client.end("after", after.token, Decision.COMMIT)
            assert ended.state == "committed"
    finally:
        await subscription.unsubscribe()
    assert landed, "the predecessor's record was written in the window"
    assert checks == [], "a committed transaction is never checked back"


async def test_a_checkpoint_under_the_shared_layouts_key_never_steers_the_logs_recovery(
    private_nc: Client,
) -> None:
    """A 0.2 coordinator left running writes its checkpoint under key `<p>`, in positions of
    TXN_HALF and TXN_OP: the partition's own log is read from its own checkpoint (`log.<p>`),
    so an open transaction is never skipped for it."""
    async with run_coordinator(private_nc, options=OPTIONS):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("open", message())
    kv = await private_nc.jetstream().key_value(layout.CHECKPOINT_BUCKET)
    await save_checkpoint(kv, 0, Checkpoint(half_seq=1000, op_seq=1000), legacy=True)
    async with run_coordinator(private_nc, options=OPTIONS):
        client = CoordinatorClient(private_nc)
        ended = await client.end("open", receipt.token, Decision.COMMIT)
        assert ended.state == "committed"
