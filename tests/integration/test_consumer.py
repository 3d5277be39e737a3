"""The consumer against a real nats-server: acks, retries, the DLQ, concurrency, stopping.

Messages are published the way the coordinator publishes a commit (topic subject, message id,
txid, keys, commit time), so these tests need nothing but the consumer. Retry delays are
scaled down to tenths of a second; the server does the waiting, as in production.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import msgspec
import nats
import pytest
import structlog
from nats.aio.client import Client
from nats.js.api import ConsumerInfo

from tests.support.servers import MakeNatsServer
from tests.support.wait import eventually
from txactors.consumer import ConsumedMessage, Consumer, apply_once_sqlite
from txactors.nats.topics import ensure_topic_stream
from txactors.wire.layout import (
    COMMITTED_AT_HEADER,
    DELIVERIES_HEADER,
    DLQ_OMITTED_HEADER,
    ERROR_HEADER,
    KEYS_HEADER,
    MSG_ID_HEADER,
    ORIGIN_SEQ_HEADER,
    ORIGIN_STREAM_HEADER,
    TOPIC_HEADER,
    TXID_HEADER,
    dlq_filter,
    dlq_stream,
    topic_stream,
    topic_subject,
)


class Payment(msgspec.Struct):
    order: str
    cents: int


@asynccontextmanager
async def names(nc: Client) -> AsyncIterator[tuple[str, str]]:
    """A fresh (topic, group) whose streams are deleted afterwards."""
    suffix = uuid.uuid4().hex[:10]
    topic, group = f"t{suffix}", f"g{suffix}"
    await ensure_topic_stream(nc.jetstream(), topic)
    try:
        yield topic, group
    finally:
        js = nc.jetstream()
        for stream in (topic_stream(topic), dlq_stream(group)):
            with suppress(Exception):
                await js.delete_stream(stream)


async def publish(
    nc: Client,
    topic: str,
    index: int,
    body: bytes = b"",
    *,
    tag: str | None = None,
    txid: str = "tx1",
    **properties: str,
) -> None:
    headers = {
        MSG_ID_HEADER: f"{txid}:{index}",
        TXID_HEADER: txid,
        KEYS_HEADER: f"k{index},order-{index}",
        COMMITTED_AT_HEADER: "1700000000.5",
        **properties,
    }
    await nc.jetstream().publish(topic_subject(topic, tag), body, headers=headers)


@contextmanager
def capture_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every log event with its bound context, whatever level another test configured."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as logs:
            yield logs
    finally:
        structlog.configure(**saved)


async def info(nc: Client, topic: str, group: str) -> ConsumerInfo:
    return await nc.jetstream().consumer_info(topic_stream(topic), group)


async def test_handler_success_acks_each_message_once(nc: Client) -> None:
    seen: list[ConsumedMessage] = []

    async def handler(msg: ConsumedMessage) -> None:
        seen.append(msg)

    async with names(nc) as (topic, group):
        body = msgspec.msgpack.encode(Payment("o-1", 250))
        await publish(nc, topic, 0, body, tag="paid", Region="eu")
        await publish(nc, topic, 1, b"two")
        await publish(nc, topic, 2, b"three", tag="paid")
        async with Consumer(nc, topic, group, handler, pull_expires=0.2):
            await eventually(lambda: len(seen) == 3)
        first = seen[0]
        assert (first.topic, first.tag, first.txid, first.msg_id) == (topic, "paid", "tx1", "tx1:0")
        assert first.keys == ("k0", "order-0")
        assert first.decode(Payment) == Payment("o-1", 250)
        assert first.properties == {"Region": "eu"}
        assert (first.deliveries, first.reconsume_times, first.stream_seq) == (1, 0, 1)
        assert first.committed_at == 1700000000.5
        assert seen[1].tag is None and seen[1].body == b"two"
        state = await info(nc, topic, group)
        assert state.num_ack_pending == 0 and state.num_pending == 0
        assert state.num_redelivered == 0
        assert state.ack_floor.stream_seq == 3 and state.delivered.consumer_seq == 3


async def test_tags_narrow_the_subscription(nc: Client) -> None:
    seen: list[str | None] = []

    async def handler(msg: ConsumedMessage) -> None:
        seen.append(msg.tag)

    async with names(nc) as (topic, group):
        for i, tag in enumerate(["a", "b", None, "a", "c"]):
            await publish(nc, topic, i, tag=tag)
        async with Consumer(nc, topic, group, handler, tags=["a", "c"], pull_expires=0.2):
            await eventually(lambda: len(seen) == 3)
            await anyio.sleep(0.1)  # the scenario: room for a message that should not come
        assert seen == ["a", "a", "c"]


async def test_retry_delays_grow_then_dlq_with_last_error(nc: Client) -> None:
    delays = (0.15, 0.4, 0.8)
    arrivals: list[float] = []

    async def handler(msg: ConsumedMessage) -> None:
        arrivals.append(time.monotonic())
        raise RuntimeError(f"boom on delivery {msg.deliveries}\nsecond line")

    async with names(nc) as (topic, group):
        await publish(nc, topic, 0, b"poison", Region="eu")
        with capture_logs() as logs:
            async with Consumer(
                nc, topic, group, handler, max_reconsume=3, retry_delays=delays, pull_expires=0.2
            ):
                await eventually(lambda: len(arrivals) == 4)
                dlq = await nc.jetstream().pull_subscribe(
                    dlq_filter(group), stream=dlq_stream(group)
                )
                [dead] = await dlq.fetch(1, timeout=3)
                # the scenario: the original is acked, no 5th attempt after the longest delay
                await anyio.sleep(delays[-1] + 0.3)
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert len(arrivals) == 4
        for gap, delay in zip(gaps, delays, strict=True):
            assert delay * 0.9 <= gap < delay + 0.5, (gaps, delays)
        assert gaps[0] < gaps[1] < gaps[2]

        assert dead.data == b"poison"
        assert dead.headers is not None
        assert dead.headers[ERROR_HEADER] == "RuntimeError: boom on delivery 4 second line"
        assert dead.headers[DELIVERIES_HEADER] == "4"
        assert dead.headers[TOPIC_HEADER] == topic
        assert dead.headers[MSG_ID_HEADER] == "tx1:0"
        assert dead.headers["Region"] == "eu"
        assert dead.headers[ORIGIN_STREAM_HEADER] == topic_stream(topic)
        assert dead.headers[ORIGIN_SEQ_HEADER] == "1"
        assert DLQ_OMITTED_HEADER not in dead.headers
        assert dead.subject == f"dlq.{group}.{topic}"
        await dead.ack()

        state = await info(nc, topic, group)
        assert state.num_ack_pending == 0 and state.ack_floor.stream_seq == 1

    failures = [e for e in logs if e["event"] == "consume_failed"]
    assert [e["retry_in"] for e in failures] == list(delays)
    assert failures[0]["msg_id"] == "tx1:0" and failures[0]["txid"] == "tx1"
    assert failures[0]["topic"] == topic and failures[0]["group"] == group
    [dead_log] = [e for e in logs if e["event"] == "dead_lettered"]
    assert dead_log["deliveries"] == 4


async def test_failing_message_does_not_block_the_others(nc: Client) -> None:
    ok: list[int] = []

    async def handler(msg: ConsumedMessage) -> None:
        if msg.body == b"bad":
            raise ValueError("bad message")
        ok.append(msg.stream_seq)

    async with names(nc) as (topic, group):
        await publish(nc, topic, 0, b"bad")
        for i in range(1, 6):
            await publish(nc, topic, i, b"good")
        async with Consumer(
            nc, topic, group, handler, concurrency=1, retry_delays=[30.0], pull_expires=0.2
        ):
            await eventually(lambda: len(ok) == 5)
        assert ok == [2, 3, 4, 5, 6]


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_concurrency_bounds_parallel_handlers(nc: Client, concurrency: int) -> None:
    running = 0
    peak = 0
    spans: list[tuple[float, float]] = []

    async def handler(msg: ConsumedMessage) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        start = time.monotonic()
        await anyio.sleep(0.1)  # the scenario: handling takes a while
        running -= 1
        spans.append((start, time.monotonic()))

    async with names(nc) as (topic, group):
        for i in range(8):
            await publish(nc, topic, i)
        async with Consumer(nc, topic, group, handler, concurrency=concurrency, pull_expires=0.2):
            await eventually(lambda: len(spans) == 8)
        elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
        assert peak == concurrency
        assert elapsed >= 0.1 * 8 / concurrency
        if concurrency > 1:
            assert elapsed < 0.1 * 8 / 2  # clearly parallel


async def test_graceful_stop_finishes_in_flight_handler_and_acks(nc: Client) -> None:
    entered = anyio.Event()
    release = anyio.Event()
    finished: list[int] = []

    async def slow(msg: ConsumedMessage) -> None:
        entered.set()
        await release.wait()
        finished.append(msg.stream_seq)

    async with names(nc) as (topic, group):
        await publish(nc, topic, 0)
        consumer = Consumer(nc, topic, group, slow, pull_expires=0.2)
        stopped = anyio.Event()
        async with anyio.create_task_group() as tg:
            await tg.start(consumer.run)
            with anyio.fail_after(5):
                await entered.wait()

            async def stop() -> None:
                await consumer.stop()
                stopped.set()

            tg.start_soon(stop)
            await anyio.sleep(0.4)  # longer than a pull: fetching has stopped, handler not
            assert not stopped.is_set()
            release.set()
            with anyio.fail_after(5):
                await stopped.wait()
        assert finished == [1]
        state = await info(nc, topic, group)
        assert state.num_ack_pending == 0 and state.ack_floor.stream_seq == 1

        # A new instance of the group gets what came later, and never the acked one again.
        await publish(nc, topic, 1)
        seen: list[int] = []

        async def record(msg: ConsumedMessage) -> None:
            seen.append(msg.stream_seq)

        async with Consumer(nc, topic, group, record, pull_expires=0.2):
            await eventually(lambda: bool(seen))
            await anyio.sleep(0.2)  # the scenario: room for a message that should not come
        assert seen == [2]


async def test_handler_cancelled_at_stop_timeout_is_redelivered_at_once(nc: Client) -> None:
    entered = anyio.Event()

    async def stuck(msg: ConsumedMessage) -> None:
        entered.set()
        await anyio.sleep_forever()

    async with names(nc) as (topic, group):
        await publish(nc, topic, 0)
        # ack_wait is long: only the nak sent on cancellation can bring the message back soon.
        async with Consumer(
            nc, topic, group, stuck, ack_wait=60.0, stop_timeout=0.1, pull_expires=0.2
        ):
            with anyio.fail_after(5):
                await entered.wait()
        seen: list[ConsumedMessage] = []

        async def record(msg: ConsumedMessage) -> None:
            seen.append(msg)

        async with Consumer(nc, topic, group, record, pull_expires=0.2):
            await eventually(lambda: bool(seen), timeout=3)
        assert seen[0].deliveries == 2


async def test_slow_handler_is_kept_alive_past_ack_wait(nc: Client) -> None:
    calls = 0

    async def slow(msg: ConsumedMessage) -> None:
        nonlocal calls
        calls += 1
        await anyio.sleep(1.2)  # the scenario: a handler slower than the ack wait

    async with names(nc) as (topic, group):
        await publish(nc, topic, 0)
        async with Consumer(nc, topic, group, slow, ack_wait=0.5, pull_expires=0.2):
            await eventually(lambda: calls == 1)
            await anyio.sleep(1.4)  # the scenario: past the ack wait, no redelivery may come
        assert calls == 1
        state = await info(nc, topic, group)
        assert state.num_redelivered == 0 and state.num_ack_pending == 0


async def test_consumer_runs_once(nc: Client) -> None:
    async def handler(msg: ConsumedMessage) -> None:
        pass

    async with names(nc) as (topic, group):
        consumer = Consumer(nc, topic, group, handler, pull_expires=0.2)
        async with consumer:
            pass
        with pytest.raises(RuntimeError, match="runs once"):
            await consumer.run()


def test_bad_names_and_settings_are_refused() -> None:
    async def handler(msg: ConsumedMessage) -> None:
        pass

    nc = Client()
    with pytest.raises(ValueError, match="topic"):
        Consumer(nc, "a.b", "g", handler)
    with pytest.raises(ValueError, match="group"):
        Consumer(nc, "t", "g*", handler)
    with pytest.raises(ValueError, match="concurrency"):
        Consumer(nc, "t", "g", handler, concurrency=0)


async def test_group_members_share_the_messages(nc: Client) -> None:
    handled: dict[str, list[str]] = {"a": [], "b": []}

    def member(name: str) -> Callable[[ConsumedMessage], Awaitable[None]]:
        async def handler(msg: ConsumedMessage) -> None:
            handled[name].append(msg.msg_id)
            await anyio.sleep(0.01)  # the scenario: handling takes a moment

        return handler

    async with names(nc) as (topic, group):
        for i in range(40):
            await publish(nc, topic, i)
        async with (
            Consumer(nc, topic, group, member("a"), concurrency=2, pull_expires=0.2),
            Consumer(nc, topic, group, member("b"), concurrency=2, pull_expires=0.2),
        ):
            await eventually(lambda: len(handled["a"]) + len(handled["b"]) >= 40)
            await anyio.sleep(0.1)  # the scenario: room for a duplicate that should not come
        everything = handled["a"] + handled["b"]
        assert sorted(everything) == sorted(f"tx1:{i}" for i in range(40))  # each once
        assert handled["a"] and handled["b"]


async def test_idempotent_handler_ignores_a_redelivery(nc: Client, tmp_path: Path) -> None:
    """The ack is lost after the database commit (the handler fails late): the redelivery
    finds the message applied and changes nothing."""
    calls = 0

    async with aiosqlite.connect(tmp_path / "points.db") as db, names(nc) as (topic, group):
        await db.execute("CREATE TABLE points (user TEXT PRIMARY KEY, total INTEGER)")
        await db.execute("INSERT INTO points VALUES ('u1', 0)")
        await db.commit()

        async def handler(msg: ConsumedMessage) -> None:
            nonlocal calls
            calls += 1

            async def add_points(conn: aiosqlite.Connection) -> None:
                await conn.execute("UPDATE points SET total = total + 10 WHERE user = 'u1'")

            await apply_once_sqlite(db, group, msg.msg_id, add_points)
            if msg.deliveries == 1:
                raise ConnectionError("crashed before the ack")

        await publish(nc, topic, 0)
        async with Consumer(nc, topic, group, handler, retry_delays=[0.05], pull_expires=0.2):
            await eventually(lambda: calls == 2)
            await anyio.sleep(0.1)  # the scenario: room for a third call that should not come
        async with db.execute("SELECT total FROM points") as cursor:
            assert await cursor.fetchone() == (10,)
        assert (await info(nc, topic, group)).num_ack_pending == 0


async def test_consumer_survives_a_server_crash(make_nats_server: MakeNatsServer) -> None:
    server = await make_nats_server()
    client = await nats.connect(server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    seen: list[int] = []

    async def handler(msg: ConsumedMessage) -> None:
        seen.append(msg.stream_seq)

    try:
        async with (
            names(client) as (topic, group),
            Consumer(client, topic, group, handler, pull_expires=0.3),
        ):
            await publish(client, topic, 0)
            await eventually(lambda: seen == [1])
            await server.kill()
            await anyio.sleep(0.2)  # the scenario: the server stays down a moment
            await server.start()  # same port and store dir
            await eventually(lambda: client.is_connected)
            await publish(client, topic, 1)
            await eventually(lambda: 2 in seen, timeout=10)
        # An ack the crash kept from disk may bring seq 1 back: at least once, never lost.
        assert set(seen) == {1, 2}
    finally:
        await client.close()


async def test_a_dead_letter_too_big_to_copy_goes_to_the_dlq_by_reference(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    max_payload = 64 * 1024
    conf = tmp_path / "small.conf"
    conf.write_text(f"max_payload: {max_payload}\n")
    server = await make_nats_server(extra_args=["-c", str(conf)])
    client = await nats.connect(server.url, reconnect_time_wait=0.1)
    seen: list[int] = []
    reason = "the ledger refused it: " + "x" * 900  # the DLQ copy adds this as a header

    async def handler(msg: ConsumedMessage) -> None:
        seen.append(msg.stream_seq)
        if msg.stream_seq == 1:
            raise ValueError(reason)

    try:
        async with names(client) as (topic, group):
            assert client.max_payload == max_payload
            big = bytes(range(256)) * ((max_payload - 600) // 256)
            await publish(client, topic, 0, big, Region="eu")
            async with Consumer(
                client,
                topic,
                group,
                handler,
                max_reconsume=1,
                retry_delays=[0.05],
                pull_expires=0.2,
            ):
                await eventually(lambda: seen == [1, 1])
                await publish(client, topic, 1, b"next")
                await eventually(lambda: 2 in seen)
                dlq = await client.jetstream().pull_subscribe(
                    dlq_filter(group), stream=dlq_stream(group)
                )
                [dead] = await dlq.fetch(1, timeout=3)
            assert client.is_connected
            assert dead.data == b""
            headers = dead.headers or {}
            assert headers[DLQ_OMITTED_HEADER] == "body"
            assert (headers[ORIGIN_STREAM_HEADER], headers[ORIGIN_SEQ_HEADER]) == (
                topic_stream(topic),
                "1",
            )
            assert headers[ERROR_HEADER] == f"ValueError: {reason}"
            assert (headers[MSG_ID_HEADER], headers["Region"]) == ("tx1:0", "eu")
            assert headers[DELIVERIES_HEADER] == "2"
            # The body is where the reference points.
            original = await client.jetstream().get_msg(topic_stream(topic), 1)
            assert original.data == big
            assert seen == [1, 1, 2]
    finally:
        await client.close()


async def test_acks_share_socket_writes_and_all_leave_before_stop_returns(nc: Client) -> None:
    count = 300
    handled = 0

    async def handler(msg: ConsumedMessage) -> None:
        nonlocal handled
        handled += 1

    async with names(nc) as (topic, group):
        for i in range(count):
            await publish(nc, topic, i)
        consumer_nc = await nats.connect(nc.connected_url.geturl())  # type: ignore[union-attr]
        ack_writes = 0
        transport = consumer_nc._transport  # a spy on the real socket: counts writes with acks
        writelines = transport.writelines  # type: ignore[union-attr]

        def counted(payload: list[bytes]) -> None:
            nonlocal ack_writes
            ack_writes += any(b"$JS.ACK." in part for part in payload)
            writelines(payload)

        transport.writelines = counted  # type: ignore[union-attr,method-assign]
        try:
            async with Consumer(consumer_nc, topic, group, handler, concurrency=64):
                await eventually(lambda: handled == count)
        finally:
            await consumer_nc.close()
        state = await info(nc, topic, group)
        assert state.num_ack_pending == 0 and state.ack_floor.stream_seq == count
        assert state.num_redelivered == 0
        assert ack_writes <= count / 10, f"{ack_writes} socket writes carried {count} acks"


async def test_a_consumer_that_may_not_declare_waits_for_its_streams(nc: Client) -> None:
    """`declare_streams=False`: it creates nothing (the coordinator does), says it waits,
    and consumes once both its topic and dead-letter streams exist."""
    seen: list[ConsumedMessage] = []

    async def handler(msg: ConsumedMessage) -> None:
        seen.append(msg)

    suffix = uuid.uuid4().hex[:10]
    topic, group = f"t{suffix}", f"g{suffix}"
    js = nc.jetstream()
    consumer = Consumer(nc, topic, group, handler, pull_expires=0.2, declare_streams=False)
    try:
        with capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer.run)
                await eventually(lambda: any(e["event"] == "stream_awaited" for e in logs))
                await ensure_topic_stream(js, topic)
                await publish(nc, topic, 0, b"one")
                await eventually(
                    lambda: sum(e["event"] == "stream_awaited" for e in logs) == 2, timeout=10
                )
                assert seen == []  # the DLQ stream is still missing
                await js.add_stream(name=dlq_stream(group), subjects=[dlq_filter(group)])
                await eventually(lambda: len(seen) == 1, timeout=10)
                await consumer.stop()
        awaited = [e["stream"] for e in logs if e["event"] == "stream_awaited"]
        assert awaited == [topic_stream(topic), dlq_stream(group)]
    finally:
        for stream in (topic_stream(topic), dlq_stream(group)):
            with suppress(Exception):
                await js.delete_stream(stream)
