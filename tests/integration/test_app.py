"""Typed handlers (`TxApp`): decoding by annotation, poison to the DLQ, idempotency, metrics.

The handler checks run without I/O; the rest runs an app's consumers on a real server and
publishes to its topic streams the way the coordinator does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiosqlite
import anyio
import msgspec
import pytest
import structlog
import structlog.testing
from nats.aio.client import Client

from tests.support.wait import eventually
from txactors import ConsumedMessage, PoisonMessage, TxApp
from txactors.consumer.message import ConsumedMessage as Message
from txactors.nats.topics import ensure_dlq_stream, ensure_topic_stream
from txactors.wire.layout import (
    CONTENT_TYPE_HEADER,
    ERROR_HEADER,
    MSG_ID_HEADER,
    dlq_stream,
    topic_subject,
)
from txactors.wire.protocol import Encoding


class OrderPaid(msgspec.Struct):
    order_id: int
    cents: int


def delivery(body: bytes, *, msg_id: str = "t1:0", json: bool = False) -> ConsumedMessage:
    headers = {MSG_ID_HEADER: msg_id}
    if json:
        headers[CONTENT_TYPE_HEADER] = Encoding.JSON.value
    return ConsumedMessage(
        topic="orders",
        tag=None,
        keys=(),
        txid="t1",
        msg_id=msg_id,
        body=body,
        headers=headers,
        deliveries=1,
        stream_seq=1,
        committed_at=None,
        subject="topic.orders._",
    )


# -- declaring handlers ---------------------------------------------------------------------


def test_the_body_parameter_type_decides_decoding_msgpack_or_json() -> None:
    app = TxApp("svc")
    seen: list[tuple[OrderPaid, str | None]] = []

    @app.consumer("orders")
    async def on_paid(order: OrderPaid, message: ConsumedMessage) -> None:
        seen.append((order, message.txid))

    [spec] = app.consumers
    assert (spec.topic, spec.group) == ("orders", "svc"), "the app's name is the default group"
    anyio.run(spec.handle, delivery(msgspec.msgpack.encode(OrderPaid(7, 100))))
    anyio.run(spec.handle, delivery(b'{"order_id": 8, "cents": 5}', json=True))
    assert seen == [(OrderPaid(7, 100), "t1"), (OrderPaid(8, 5), "t1")]


def test_a_body_that_does_not_decode_is_poison_with_the_decoders_words() -> None:
    app = TxApp("svc")

    @app.consumer("orders")
    async def on_paid(order: OrderPaid) -> None:
        raise AssertionError("never called")

    [spec] = app.consumers
    with pytest.raises(PoisonMessage) as poison:
        anyio.run(spec.handle, delivery(msgspec.msgpack.encode({"order_id": "seven"})))
    assert str(poison.value) == (
        "body does not decode as OrderPaid: Expected `int`, got `str` - at `$.order_id`"
    )


def test_bytes_takes_the_raw_body_and_a_message_only_handler_decodes_nothing() -> None:
    app = TxApp("svc")
    raw: list[object] = []

    @app.consumer("orders")
    async def on_raw(body: bytes) -> None:
        raw.append(body)

    @app.consumer("orders", group="audit")
    async def on_message(message: Message) -> None:
        raw.append(message.msg_id)

    for spec in app.consumers:
        anyio.run(spec.handle, delivery(b"\xc1 not msgpack"))
    assert raw == [b"\xc1 not msgpack", "t1:0"]


@pytest.mark.parametrize(
    ("source", "complaint"),
    [
        ("def h(order: OrderPaid): ...", "must be an `async def` function"),
        ("async def h(order): ...", "annotate 'order' with the body's type"),
        ("async def h(a: OrderPaid, b: OrderPaid): ...", "both 'a' and 'b' would be the body"),
        ("async def h(*orders: OrderPaid): ...", "*args/**kwargs cannot be filled"),
        ("async def h(order: object()): ...", "'order'"),  # msgspec cannot decode into it
        ("async def h(conn: OrderPaid, order: OrderPaid): ...", "would be the body"),
    ],
    ids=["not-async", "unannotated", "two-bodies", "varargs", "undecodable-type", "conn"],
)
def test_a_handler_that_cannot_be_called_is_refused_when_decorated(
    source: str, complaint: str
) -> None:
    namespace: dict[str, object] = {"OrderPaid": OrderPaid}
    exec(source, namespace)
    with pytest.raises(TypeError, match=complaint.replace("*", r"\*")):
        TxApp("svc").consumer("orders")(namespace["h"])  # type: ignore[type-var]


def test_two_handlers_for_one_topic_and_group_are_refused() -> None:
    app = TxApp("svc")

    @app.consumer("orders")
    async def first(order: OrderPaid) -> None: ...

    with pytest.raises(ValueError, match="already has a handler for topic 'orders'"):
        app.consumer("orders", group="svc")
    with pytest.raises(ValueError, match="group"):
        TxApp("bad name")


# -- idempotency ----------------------------------------------------------------------------


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[aiosqlite.Connection]:
    conn = await aiosqlite.connect(tmp_path / "svc.db")
    await conn.execute("CREATE TABLE shipped (order_id INTEGER)")
    await conn.commit()
    try:
        yield conn
    finally:
        await conn.close()


async def test_idempotent_handlers_apply_a_redelivery_once_in_the_same_transaction(
    db: aiosqlite.Connection,
) -> None:
    app = TxApp("svc")
    fail = [True]

    @app.consumer("orders", idempotent=lambda: db)
    async def ship(order: OrderPaid, conn: aiosqlite.Connection) -> None:
        await conn.execute("INSERT INTO shipped VALUES (?)", (order.order_id,))
        if fail[0]:
            raise RuntimeError("the database change and the apply record roll back together")

    [spec] = app.consumers
    paid = delivery(msgspec.msgpack.encode(OrderPaid(42, 1)))
    with pytest.raises(RuntimeError):
        await spec.handle(paid)
    fail[0] = False
    await spec.handle(paid)
    await spec.handle(paid)  # a redelivery
    async with db.execute("SELECT order_id FROM shipped") as rows:
        assert await rows.fetchall() == [(42,)]


async def test_an_idempotent_option_that_is_no_database_is_refused_at_start(
    private_nc: Client,
) -> None:
    app = TxApp("svc")

    @app.consumer("orders", idempotent="svc.db")
    async def ship(order: OrderPaid) -> None: ...

    with pytest.raises(TypeError, match="got str"):
        async with app.running(private_nc):
            raise AssertionError("must not start")


# -- on a real server -------------------------------------------------------------------------


async def publish(nc: Client, body: bytes, msg_id: str) -> None:
    js = nc.jetstream()
    await ensure_topic_stream(js, "orders")
    await js.publish(topic_subject("orders", None), body, headers={MSG_ID_HEADER: msg_id})


async def test_a_poison_message_is_dead_lettered_at_once_and_counted(private_nc: Client) -> None:
    app = TxApp("svc")
    handled: list[OrderPaid] = []
    hooks: list[str] = []

    @app.on_startup
    async def opened() -> None:
        hooks.append("startup")

    @app.on_shutdown
    async def closed() -> None:
        hooks.append("shutdown")

    @app.consumer("orders", max_reconsume=16)
    async def on_paid(order: OrderPaid) -> None:
        handled.append(order)

    registry = app.metrics.registry
    labels = {"topic": "orders", "group": "svc"}
    async with app.running(private_nc, pull_expires=0.1):
        assert hooks == ["startup"]
        for name in ("retries_total", "dead_letters_total", "lag_messages"):
            assert registry.get_sample_value(f"txactors_consumer_{name}", labels) == 0.0
        assert registry.get_sample_value("txactors_consumer_handler_seconds_count", labels) == 0
        await publish(private_nc, b"\xc1", "bad:0")
        await publish(private_nc, msgspec.msgpack.encode(OrderPaid(1, 2)), "good:0")
        js = private_nc.jetstream()

        async def handled_and_dead_lettered() -> bool:
            return bool(handled) and (await js.stream_info(dlq_stream("svc"))).state.messages >= 1

        await eventually(handled_and_dead_lettered)
    assert hooks == ["startup", "shutdown"]
    dead = await js.get_last_msg(dlq_stream("svc"), "dlq.svc.orders")
    assert (dead.headers or {})[ERROR_HEADER].startswith(
        "PoisonMessage: body does not decode as OrderPaid: MessagePack data is malformed"
    )
    assert handled == [OrderPaid(1, 2)]
    assert registry.get_sample_value("txactors_consumer_dead_letters_total", labels) == 1.0
    assert registry.get_sample_value("txactors_consumer_retries_total", labels) == 0.0, "no retry"
    assert registry.get_sample_value("txactors_consumer_handler_seconds_count", labels) == 2
    assert registry.get_sample_value("txactors_consumer_lag_messages", labels) == 0.0


async def test_retries_are_counted_and_lag_is_what_the_group_has_not_been_given(
    private_nc: Client,
) -> None:
    app = TxApp("svc")
    registry = app.metrics.registry
    labels = {"topic": "orders", "group": "svc"}
    for n in range(3):
        await publish(private_nc, msgspec.msgpack.encode(OrderPaid(n, 0)), f"t{n}:0")
    attempts: list[int] = []
    lags: list[float | None] = []

    @app.consumer("orders", concurrency=1, retry_delays=[0.05])
    async def on_paid(order: OrderPaid, message: ConsumedMessage) -> None:
        attempts.append(order.order_id)
        lags.append(registry.get_sample_value("txactors_consumer_lag_messages", labels))
        if message.deliveries == 1 and order.order_id == 0:
            raise RuntimeError("try again")

    async with app.running(private_nc, pull_expires=0.1):
        await eventually(
            lambda: sorted(set(attempts)) == [0, 1, 2] and attempts.count(0) >= 2,
            what="every order handled, the first twice",
        )
    assert lags[:2] == [2.0, 1.0], "one at a time: the others wait, then fewer do"
    assert registry.get_sample_value("txactors_consumer_retries_total", labels) == 1.0
    assert registry.get_sample_value("txactors_consumer_handler_seconds_count", labels) == 4
    assert registry.get_sample_value("txactors_consumer_lag_messages", labels) == 0.0
    assert registry.get_sample_value("txactors_build_info", {"version": _version()}) == 1.0


def _version() -> str:
    from txactors.observe.metrics import build_version

    return build_version()


def test_a_declared_consumer_exports_its_series_at_zero_before_it_runs() -> None:
    """A scrape right after `txactors run --metrics-port` starts must already show them."""
    from prometheus_client import generate_latest

    app = TxApp("svc")

    @app.consumer("jobs", group="workers")
    async def work(body: bytes) -> None:
        pass

    text = generate_latest(app.metrics.registry).decode()
    labels = 'group="workers",topic="jobs"'
    assert f"txactors_consumer_dead_letters_total{{{labels}}} 0.0" in text
    assert f"txactors_consumer_handler_seconds_count{{{labels}}} 0.0" in text


async def test_an_app_that_may_not_declare_waits_for_the_coordinators_streams(
    private_nc: Client,
) -> None:
    """`TxApp(..., declare_streams=False)`, as a confined deployment runs it: its consumers
    create no stream, and start once the streams exist."""
    app = TxApp("svc", declare_streams=False)
    handled: list[OrderPaid] = []

    @app.consumer("orders")
    async def on_paid(order: OrderPaid) -> None:
        handled.append(order)

    js = private_nc.jetstream()
    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                async with app.running(private_nc, pull_expires=0.1):
                    await eventually(lambda: handled, what="the order handled")

            tg.start_soon(run)
            await eventually(
                lambda: any(e["event"] == "stream_awaited" for e in logs), what="stream_awaited"
            )
            assert await js.streams_info() == []  # it waits; it made nothing
            await publish(private_nc, msgspec.msgpack.encode(OrderPaid(7, 1)), "w:0")
            await ensure_dlq_stream(js, "svc")
    assert handled == [OrderPaid(7, 1)]
