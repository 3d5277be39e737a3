"""What JetStream refuses costs one record, not a partition; replicas reach every stream."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import anyio
import nats.js.errors
import pytest
import structlog
from nats.aio.client import Client
from nats.js.api import StreamConfig
from prometheus_client import CollectorRegistry

from tests.integration.test_coordinator_batches import item, prepare_batch
from tests.support.txn import CoordinatorClient, message, topic_ids
from tests.support.wait import eventually
from txactors.consumer import Consumer
from txactors.coordinator import CoordinatorOptions
from txactors.coordinator.core.events import CheckFailed, CheckFailure
from txactors.coordinator.partition.checker import Checked, Due
from txactors.coordinator.partition.packs import read_halves
from txactors.coordinator.partition.recovery import read_subject
from txactors.coordinator.service import run_coordinator
from txactors.errors import CommandError, ConfigError
from txactors.nats.link import AckInbox
from txactors.nats.retry import FIRST_ATTEMPT, retry_transient
from txactors.observe.metrics import CoordinatorMetrics
from txactors.wire import layout
from txactors.wire.protocol import PROTOCOL_VERSION, Decision, Error, ShowTransaction


async def test_a_message_its_topic_refuses_for_good_is_quarantined_and_the_partition_goes_on(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    # An operator's misconfiguration: the topic stream takes no message over 512 bytes.
    await js.add_stream(
        StreamConfig(name="TOPIC_orders", subjects=["topic.orders.>"], max_msg_size=512)
    )
    registry = CollectorRegistry()
    async with run_coordinator(private_nc, metrics=CoordinatorMetrics(registry)):
        client = CoordinatorClient(private_nc)
        big = await client.prepare("big", message(body=b"x" * 1000))
        with structlog.testing.capture_logs() as logs, anyio.fail_after(20):
            ended = await client.end("big", big.token, Decision.COMMIT, timeout=15)
        assert ended.state == "committed", "decided, and not retried forever"
        small = await client.prepare("small", message(body=b"fits"))
        assert (await client.end("small", small.token, Decision.COMMIT)).state == "committed"
        assert await topic_ids(private_nc, "orders") == ["small:0"]
    [event] = [e for e in logs if e["event"] == "record_quarantined"]
    assert event["subject"] == "topic.orders._" and "10054" in event["reason"]
    assert registry.get_sample_value("txactors_quarantined_total", {"partition": "0"}) == 1
    [copy] = [
        m async for m in read_subject(js, layout.DISCARD_STREAM, layout.quarantine_subject(), 1)
    ]
    headers = copy.headers or {}
    assert (headers[layout.TXID_HEADER], copy.data) == ("big", b"x" * 1000)
    assert headers[layout.ORIGIN_SUBJECT_HEADER] == "topic.orders._"
    assert "maximum" in headers[layout.QUARANTINE_REASON_HEADER]


async def test_a_pack_txn_half_refuses_for_good_fails_its_prepares_and_is_quarantined_whole(
    private_nc: Client,
) -> None:
    js = private_nc.jetstream()
    # An operator's misconfiguration: TXN_HALF takes no message over 1 KiB.
    await js.add_stream(
        StreamConfig(
            name=layout.half_stream(0), subjects=[layout.half_subject(0)], max_msg_size=1024
        )
    )
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        await client.prepare("warm-up", message())  # the topic stream exists
        with structlog.testing.capture_logs() as logs:
            answer = await prepare_batch(private_nc, [item("small"), item("big", b"x" * 2000)])
        for result, txid in zip(answer.results, ("small", "big"), strict=True):
            assert isinstance(result, Error) and result.code == "internal", result
            assert f"JetStream refused message 0 of transaction {txid}" in result.message
        for txid in ("small", "big"):
            show = ShowTransaction(txid=txid, version=PROTOCOL_VERSION)
            with pytest.raises(CommandError, match="not open here"):
                await client.admin(show)
        after = await client.prepare("after", message())
        assert (await client.end("after", after.token, Decision.COMMIT)).state == "committed"
    [event] = [e for e in logs if e["event"] == "record_quarantined"]
    assert event["subject"] == layout.half_subject(0)
    [copy] = [
        m async for m in read_subject(js, layout.DISCARD_STREAM, layout.quarantine_subject(), 1)
    ]
    stored = read_halves(1, copy.headers or {}, copy.data)
    assert [h.txid for h in stored] == ["small", "big"], "the pack copied whole"


async def test_halves_refused_for_good_roll_back_what_landed_of_their_transaction(
    private_nc: Client,
) -> None:
    """A later prepare whose halves TXN_HALF refuses for good fails, and the halves of the
    earlier one are rolled back: nothing of the transaction may ever be delivered."""
    js = private_nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=layout.half_stream(0), subjects=[layout.half_subject(0)], max_msg_size=1024
        )
    )
    async with run_coordinator(private_nc):
        client = CoordinatorClient(private_nc)
        first = await client.prepare("t", message())
        answer = await prepare_batch(private_nc, [item("t", b"x" * 2000, token=first.token)])
        [result] = answer.results
        assert isinstance(result, Error), result
        assert "the transaction is rolled back" in result.message
        with pytest.raises(CommandError, match=r"is roll(ing|ed)_back; it cannot commit"):
            await client.end("t", first.token, Decision.COMMIT)


async def test_a_restarted_partition_ignores_its_previous_checkers_messages(
    private_nc: Client,
) -> None:
    async with run_coordinator(private_nc) as coordinator:
        ref = coordinator.owned[0].ref
        assert ref is not None
        with structlog.testing.capture_logs() as logs:
            # As if the checker of an instance that has since been restarted reported late:
            # its check means nothing to the fresh table.
            failed = CheckFailed(txid="t0", check_id=12345, reason=CheckFailure.TIMEOUT)
            await ref.tell(Checked(0, failed))
            await ref.tell(Due(0))
            client = CoordinatorClient(private_nc)
            receipt = await client.prepare("t1", message())
            assert (await client.end("t1", receipt.token, Decision.COMMIT)).state == "committed"
        events = [e["event"] for e in logs]
        assert "actor_message_failed" not in events and "actor_restarting" not in events
        assert ref.is_alive


async def test_replicas_reach_every_stream_the_coordinator_and_consumer_declare(
    private_nc: Client,
) -> None:
    """A single server holds one replica only, so what it can show is the plumbing: a
    request for three is refused with an error naming the setting, on every stream."""
    options = CoordinatorOptions(replicas=3)
    assert options.replicas == 3
    with pytest.raises(ConfigError, match="replicas") as refused:
        async with run_coordinator(private_nc, options=options):
            pass
    assert "--replicas" in str(refused.value)

    async def handler(_: object) -> None:
        pass

    with pytest.raises(ConfigError, match="TOPIC_orders needs 3 replicas"):
        async with Consumer(private_nc, "orders", "audit", handler, replicas=3):
            pass

    # With 1, what was declared is there with 1 replica, the topic stream included.
    async with run_coordinator(private_nc, options=CoordinatorOptions(replicas=1)):
        client = CoordinatorClient(private_nc)
        receipt = await client.prepare("t1", message())
        await client.end("t1", receipt.token, Decision.COMMIT)
    js = private_nc.jetstream()
    for stream in ("TXN_LOG_0", "TXN_DISCARD", "KV_TXN_CHECKPOINT", "KV_TXN_LEASE"):
        assert (await js.stream_info(stream)).config.num_replicas == 1
    assert (await js.stream_info("TOPIC_orders")).config.num_replicas == 1
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.stream_info("DLQ_audit")  # the refused consumer declared nothing after it


async def test_an_answer_to_a_write_given_up_on_is_not_an_unretrieved_error(nc: Client) -> None:
    """A refusal that arrives after its batch was abandoned (the writer reissued it) is
    retrieved by the inbox itself: no "Future exception was never retrieved" on stderr."""
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))
    try:
        inbox = AckInbox(nc)
        future = await inbox.publish("no.stream.takes.this", b"x", {})
        await eventually(future.done, timeout=5, what="the publish refused")
        del future
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    assert unretrieved == []


async def test_a_read_sent_to_a_leader_that_died_is_sent_again_within_the_first_attempt() -> None:
    """The first request goes unanswered (sent while the stream had no leader); the next one,
    after the election, is answered. Waiting out the JetStream timeout (5 s) would hold a
    recovery or a commit that long."""
    calls = 0

    async def read() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await anyio.sleep_forever()
        return "answered"

    with anyio.fail_after(FIRST_ATTEMPT + 1):
        assert await retry_transient(read) == "answered"
    assert calls == 2
