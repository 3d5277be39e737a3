"""The coordinator against a real nats-server, spoken to in raw protocol.

Each test runs on a server of its own, so the TXN_* streams start empty. The producer and
consumer libraries are tested elsewhere; here every request is what a client in any
language would send.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import msgspec
import nats
import pytest
import structlog
from nats.aio.client import Client

from tests.support.table import astray
from tests.support.txn import FAST, CoordinatorClient, message, topic_ids, topic_messages
from tests.support.wait import eventually
from txactors.coordinator import CoordinatorConfig, TxnState
from txactors.coordinator.options import CoordinatorOptions, DiscardedTransaction
from txactors.coordinator.service import run_coordinator
from txactors.errors import AskTimeout, CommandError
from txactors.faults import CRASH_EXIT_CODE, FAULT_ENV, FaultPoint
from txactors.wire import layout
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    Decision,
    ListTransactions,
    ResumeTransaction,
    ShowTransaction,
    encode,
)

ROOT = Path(__file__).resolve().parents[2]
COMMIT, ROLLBACK, UNKNOWN = Decision.COMMIT, Decision.ROLLBACK, Decision.UNKNOWN


async def test_commit_publishes_each_message_once_with_its_ids(private_nc: Client) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("t1", message(keys=["order-7"], tag="paid"))
        assert receipt.seqs and len(receipt.token) == 32
        assert await topic_ids(private_nc, "orders") == [], "a half message is invisible"
        ended = await client.end("t1", receipt.token, COMMIT)
        assert ended.state == "committed"
        [published] = await topic_messages(private_nc, "orders")
        assert published.subject == "topic.orders.paid"
        assert published.data == b"payload"
        headers = published.headers or {}
        assert headers[layout.MSG_ID_HEADER] == "t1:0"
        assert headers[layout.TXID_HEADER] == "t1"
        assert headers[layout.KEYS_HEADER] == "order-7"


async def test_ends_are_idempotent_and_a_conflicting_end_is_refused(private_nc: Client) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("t1", message())
        assert (await client.end("t1", receipt.token, COMMIT)).state == "committed"
        assert (await client.end("t1", receipt.token, COMMIT)).state == "committed"
        with pytest.raises(CommandError) as conflict:
            await client.end("t1", receipt.token, ROLLBACK)
        assert conflict.value.code == "conflict"
        assert await topic_ids(private_nc, "orders") == ["t1:0"]

        rolled = await client.prepare("t2", message())
        assert (await client.end("t2", rolled.token, ROLLBACK)).state == "rolled_back"
        with pytest.raises(CommandError) as late_commit:
            await client.end("t2", rolled.token, COMMIT)
        assert late_commit.value.code == "conflict"
        assert await topic_ids(private_nc, "orders") == ["t1:0"], "rolled back: never visible"


async def test_a_multi_topic_transaction_is_delivered_entirely_or_not_at_all(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        first = await client.prepare("both", message("orders", b"o"))
        await client.prepare("both", message("points", b"p"), token=first.token)
        await client.end("both", first.token, COMMIT)
        none = await client.prepare("neither", message("orders", b"o"), message("points", b"p"))
        await client.end("neither", none.token, ROLLBACK)
        assert await topic_ids(private_nc, "orders") == ["both:0"]
        assert await topic_ids(private_nc, "points") == ["both:1"]


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"\xc1not msgpack", "bad_request"),
        (
            encode({"type": "Prepare", "version": 2, "txid": 5, "group": "g", "producer": "p"}),
            "bad_request",
        ),
        (encode({"type": "Explode", "txid": "x"}), "unknown_command"),
    ],
    ids=["malformed", "wrong-type", "unknown-command"],
)
async def test_malformed_prepares_get_error_codes_and_the_coordinator_keeps_serving(
    private_nc: Client, payload: bytes, code: str
) -> None:
    async with run_coordinator(private_nc):
        reply = await private_nc.request(layout.prepare_subject(0, "g"), payload, timeout=5)
        error = msgspec.msgpack.decode(reply.data)
        assert error["type"] == "Error" and error["code"] == code
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("after", message())
        assert (await client.end("after", receipt.token, COMMIT)).state == "committed"


async def test_invalid_requests_are_refused_and_change_nothing(private_nc: Client) -> None:
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("t1", message())
        # Fits in one NATS message, but leaves no room for the half's headers.
        oversized = b"x" * (private_nc.max_payload - 500)
        cases = [
            (lambda: client.prepare("t2"), "bad_request"),  # no messages
            (lambda: client.prepare("t2", message("bad topic")), "bad_request"),
            (lambda: client.prepare("t2", message(body=oversized)), "bad_request"),
            (lambda: client.prepare("t2", message(properties={"Txn-Id": "x"})), "bad_request"),
            (lambda: client.end("t1", "0" * 32, COMMIT), "forbidden"),
            (lambda: client.end("nope", receipt.token, COMMIT), "not_found"),
            (lambda: client.prepare("t1", message(), token="f" * 32), "forbidden"),
        ]
        for request, code in cases:
            with pytest.raises(CommandError) as refused:
                await request()
            assert refused.value.code == code, refused.value
        [info] = (await client.admin(ListTransactions(version=PROTOCOL_VERSION))).transactions
        assert (info.txid, info.state, info.half_seqs) == ("t1", "prepared", receipt.seqs)
        assert (await client.end("t1", receipt.token, COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["t1:0"]


async def test_an_event_the_table_refuses_is_answered_and_the_partition_keeps_serving(
    private_nc: Client,
) -> None:
    """A bug in a move (here: commit goes straight to `committed`) fails that one request
    with an internal error; the transaction is as it was, and the partition serves on."""
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("t1", message())
        with (
            structlog.testing.capture_logs() as logs,
            astray("t1", TxnState.COMMITTED),
            pytest.raises(CommandError) as refused,
        ):
            await client.end("t1", receipt.token, COMMIT)
        assert refused.value.code == "internal"
        [logged] = [e for e in logs if e["event"] == "coordinator_event_refused"]
        assert (logged["refused"], logged["log_level"]) == ("End", "error")
        events = [e["event"] for e in logs]
        assert "actor_message_failed" not in events and "actor_restarting" not in events
        assert "can't move t1 from prepared to committed on end_commit" in str(refused.value)
        shown = await client.admin(ShowTransaction(txid="t1", version=PROTOCOL_VERSION))
        assert (shown.state, shown.half_seqs) == ("prepared", receipt.seqs)
        assert (await client.end("t1", receipt.token, ROLLBACK)).state == "rolled_back"
        other = await client.prepare("t2", message())
        assert (await client.end("t2", other.token, COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["t2:0"]


async def test_a_due_transaction_the_table_cannot_move_is_logged_and_left_as_it_was(
    private_nc: Client,
) -> None:
    """A bug in the move of a deadline: that transaction stays as it was (without a
    deadline, so the bug does not spin the timer), and the partition serves on."""
    config = CoordinatorConfig(**FAST)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("stuck", message())
        with structlog.testing.capture_logs() as logs, astray("stuck", TxnState.COMMITTED):
            await eventually(
                lambda: any(e["event"] == "coordinator_event_refused" for e in logs),
                what="the refused deadline logged",
            )
        [logged] = [e for e in logs if e["event"] == "coordinator_event_refused"]
        assert logged["refused"] == "due"
        assert "can't move stuck from prepared to committed on due" in logged["error"]
        events = [e["event"] for e in logs]
        assert "actor_message_failed" not in events and "actor_restarting" not in events
        shown = await client.admin(ShowTransaction(txid="stuck", version=PROTOCOL_VERSION))
        assert (shown.state, shown.check_times) == ("prepared", 0)
        assert (await client.end("stuck", receipt.token, COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["stuck:0"]


async def test_unknown_end_then_nobody_answers_checks_discards_after_check_max(
    private_nc: Client,
) -> None:
    config = CoordinatorConfig(check_max=3, **FAST)
    hooked: list[DiscardedTransaction] = []

    async def on_discard(discarded: DiscardedTransaction) -> None:
        hooked.append(discarded)

    async with run_coordinator(private_nc, config=config, on_discard=on_discard):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("lost", message(keys=["k1"]))
        assert (await client.end("lost", receipt.token, UNKNOWN)).state == "prepared"
        info = await eventually(
            lambda: client.admin(ShowTransaction(txid="lost", version=PROTOCOL_VERSION)),
            until=lambda info: info.state == "discarded",
            what="lost discarded",
        )
        assert info.check_times == 3 and info.discard_reason == "check_max"
        await eventually(lambda: hooked, what="the discard hook called")
        [discarded] = hooked
        assert (discarded.txid, discarded.group, discarded.reason) == ("lost", "g", "check_max")
        assert [(m.topic, m.body, m.keys) for m in discarded.messages] == [
            ("orders", b"payload", ["k1"])
        ]
        js = private_nc.jetstream()
        copy = await js.get_last_msg(layout.DISCARD_STREAM, layout.discard_subject("g"))
        assert (copy.headers or {})[layout.TXID_HEADER] == "lost"
        assert await topic_ids(private_nc, "orders") == []

        # An operator resumes it; a late commit by the producer is then accepted.
        resumed = await client.admin(ResumeTransaction(txid="lost", version=PROTOCOL_VERSION))
        assert resumed.state == "prepared"
        assert (await client.end("lost", receipt.token, COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["lost:0"]


async def test_restart_rebuilds_open_transactions_from_the_streams(private_nc: Client) -> None:
    config = CoordinatorConfig(transaction_timeout=60)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        receipts = {txid: await client.prepare(txid, message()) for txid in ("a", "b", "c")}
        await client.end("a", receipts["a"].token, ROLLBACK)
    async with run_coordinator(private_nc, config=config):
        client = CoordinatorClient(private_nc)
        listed = await client.admin(ListTransactions(version=PROTOCOL_VERSION))
        assert sorted(t.txid for t in listed.transactions) == ["b", "c"]
        with pytest.raises(CommandError):
            await client.end("a", receipts["a"].token, COMMIT)
        assert (await client.end("b", receipts["b"].token, COMMIT)).state == "committed"
        assert (await client.end("c", receipts["c"].token, ROLLBACK)).state == "rolled_back"
        assert await topic_ids(private_nc, "orders") == ["b:0"]


async def test_coordinator_killed_between_decision_and_publish_publishes_after_restart(
    make_nats_server: object,
) -> None:
    server = await make_nats_server()  # type: ignore[operator]
    env = {**os.environ, "NATS_URL": server.url, FAULT_ENV: FaultPoint.AFTER_COMMIT_RECORD}
    env["PYTHONPATH"] = str(ROOT)
    doomed = await anyio.open_process(
        [sys.executable, "-m", "txactors.cli", "coordinator", "--lease-ttl", "1"], cwd=ROOT, env=env
    )
    nc = await nats.connect(server.url)
    try:
        client = CoordinatorClient(nc)
        receipt = await client.prepare_once_up("t1", message(), message("points"))
        with pytest.raises(AskTimeout):
            await client.end("t1", receipt.token, COMMIT, timeout=3)
        with anyio.fail_after(10):
            assert await doomed.wait() == CRASH_EXIT_CODE
        assert await topic_ids(nc, "orders") == [], "it died before publishing"

        # It still holds its lease: the successor takes over once that expires.
        async with run_coordinator(nc, options=CoordinatorOptions(lease_ttl=1)):
            await eventually(lambda: topic_ids(nc, "points"), what="a message on points")
            # The producer's retried end now gets the final answer.
            assert (await client.end("t1", receipt.token, COMMIT)).state == "committed"
        assert await topic_ids(nc, "orders") == ["t1:0"]
        assert await topic_ids(nc, "points") == ["t1:1"]
    finally:
        await nc.close()
        if doomed.returncode is None:
            doomed.kill()
        await doomed.aclose()


async def test_coordinator_command_serves_prometheus_metrics(make_nats_server: object) -> None:
    import socket
    import urllib.request

    server = await make_nats_server()  # type: ignore[operator]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "NATS_URL": server.url, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "txactors.cli", "coordinator", "--metrics-port", str(port)]
    process = await anyio.open_process(command, cwd=ROOT, env=env)
    nc = await nats.connect(server.url)
    try:
        client = CoordinatorClient(nc)
        receipt = await client.prepare_once_up("m1", message())
        await client.end("m1", receipt.token, COMMIT)

        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                return str(reply.read().decode())

        # counted once `done` is written, which may follow the producer's answer
        text = await eventually(
            lambda: anyio.to_thread.run_sync(scrape),
            until=lambda text: 'txactors_commits_total{partition="0"} 1.0' in text,
            what="one commit counted",
        )
        assert 'txactors_pending_transactions{partition="0"} 0.0' in text
        assert "txactors_commit_latency_seconds_bucket" in text
        assert 'txactors_commit_latency_seconds_count{partition="0"} 1.0' in text
    finally:
        await nc.close()
        process.terminate()
        await process.wait()
        await process.aclose()
