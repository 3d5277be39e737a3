"""Tracing: one trace from the producer's transaction through the coordinator to the consumer.

A real nats-server with an in-process coordinator, producer and consumer; the spans are
collected by the OpenTelemetry SDK's in-memory exporter. The parent links asserted are the
W3C context carried in the halves' and the topic messages' headers, so they hold across
processes just the same.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.client import Client
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.support.txn import FAST, topic_messages
from tests.support.wait import eventually
from txactors import ConsumedMessage, TxApp
from txactors.consumer import Consumer
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.service import run_coordinator
from txactors.observe import tracing
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]


class Paid(msgspec.Struct):
    order: int


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """A tracer provider for this test only. The API lets a process set its provider once,
    so the test swaps the API's global instead: the rest of the suite stays untraced."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str, txid: str) -> ReadableSpan:
    [span] = [s for s in named(exporter, name) if (s.attributes or {}).get("txactors.txid") == txid]
    return span


async def until_span(exporter: InMemorySpanExporter, name: str, txid: str) -> ReadableSpan:
    def found() -> list[ReadableSpan]:
        return [
            s for s in named(exporter, name) if (s.attributes or {}).get("txactors.txid") == txid
        ]

    [span, *_] = await eventually(found, timeout=20, what=f"a {name} span of {txid}")
    return span


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.span_id


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return span.context.trace_id


async def never_asked(view: CheckView) -> Decision:
    raise AssertionError(f"no check-back expected for {view.txid}")


async def test_one_trace_from_the_producer_through_the_coordinator_to_the_handler(
    private_nc: Client, spans: InMemorySpanExporter
) -> None:
    app = TxApp("shipping")
    inside: list[trace.SpanContext] = []

    @app.consumer("paid-traced", retry_delays=(0.05,))
    async def on_paid(paid: Paid, message: ConsumedMessage) -> None:
        inside.append(trace.get_current_span().get_span_context())

    tracer = trace.get_tracer("the-shop")

    def debit(message: TxMessage, arg: object) -> Decision:
        with tracer.start_as_current_span("debit"):
            return Decision.COMMIT

    async with (
        run_coordinator(private_nc),
        app.running(private_nc, pull_expires=0.2),
        TransactionProducer(private_nc, "shop", never_asked) as producer,
    ):
        with tracer.start_as_current_span("checkout"):
            message = TxMessage("paid-traced", Paid(order=7), properties={"origin": "web"})
            result = await producer.send_in_transaction(message, debit)
        consume = await until_span(spans, tracing.CONSUME_SPAN, result.txid)

    checkout = named(spans, "checkout")[0]
    transaction = one(spans, tracing.TRANSACTION_SPAN, result.txid)
    commit = one(spans, "txactors.coordinator.commit", result.txid)
    publish = one(spans, tracing.PUBLISH_SPAN, result.txid)
    [debit_span] = named(spans, "debit")
    everything = [checkout, transaction, debit_span, commit, publish, consume]
    assert {trace_id(s) for s in everything} == {trace_id(checkout)}, "one trace"
    assert parent_of(transaction) == span_id(checkout), "the caller's span is the parent"
    assert parent_of(debit_span) == span_id(transaction), "the local transaction nests in it"
    assert parent_of(commit) == span_id(transaction)
    assert parent_of(publish) == span_id(transaction)
    assert parent_of(consume) == span_id(publish), "the handler follows the publish"
    assert [c.span_id for c in inside] == [span_id(consume)], "the handler runs in its span"

    assert transaction.kind is SpanKind.PRODUCER
    assert dict(transaction.attributes or {}) == {
        "txactors.txid": result.txid,
        "txactors.group": "shop",
        "txactors.topics": ("paid-traced",),
        "txactors.decision": "commit",
        "txactors.messages": 1,
        "txactors.state": "committed",
    }
    assert (commit.attributes or {})["txactors.partition"] == 0
    assert consume.kind is SpanKind.CONSUMER
    assert dict(consume.attributes or {}) == {
        "txactors.topic": "paid-traced",
        "txactors.group": "shipping",
        "txactors.msg_id": f"{result.txid}:0",
        "txactors.deliveries": 1,
        "txactors.txid": result.txid,
    }
    assert consume.status.status_code is StatusCode.UNSET
    [stored] = await topic_messages(private_nc, "paid-traced")
    headers = stored.headers or {}
    assert headers["origin"] == "web", "the user's properties are kept beside the context"
    assert headers[tracing.TRACEPARENT].split("-")[2] == f"{span_id(publish):016x}"


async def test_a_rolled_back_transaction_is_decided_in_its_trace_and_never_consumed(
    private_nc: Client, spans: InMemorySpanExporter
) -> None:
    handled: list[str] = []

    async def handle(message: ConsumedMessage) -> None:
        handled.append(message.msg_id)

    async with (
        run_coordinator(private_nc),
        Consumer(private_nc, "refunds", "audit", handle, pull_expires=0.2),
        TransactionProducer(private_nc, "shop", never_asked) as producer,
    ):
        async with producer.begin() as rolled_back:
            await rolled_back.send(TxMessage("refunds", b"no"))
            await rolled_back.rollback()
        async with producer.begin() as committed:  # comes after: a marker to wait for
            await committed.send(TxMessage("refunds", b"yes"))
        await until_span(spans, tracing.CONSUME_SPAN, committed.txid)

    assert handled == [f"{committed.txid}:0"]
    rollback = one(spans, "txactors.coordinator.rollback", rolled_back.txid)
    transaction = one(spans, tracing.TRANSACTION_SPAN, rolled_back.txid)
    assert parent_of(rollback) == span_id(transaction)
    assert trace_id(rollback) == trace_id(transaction)
    assert (transaction.attributes or {})["txactors.state"] == "rolled_back"
    traced = [(s.attributes or {}).get("txactors.txid") for s in spans.get_finished_spans()]
    assert traced.count(rolled_back.txid) == 2, "its transaction and rollback spans, no more"
    assert trace_id(one(spans, tracing.TRANSACTION_SPAN, committed.txid)) != trace_id(transaction)


async def test_a_transaction_block_that_raises_rolls_back_in_an_error_span(
    private_nc: Client, spans: InMemorySpanExporter
) -> None:
    async with (
        run_coordinator(private_nc),
        TransactionProducer(private_nc, "shop", never_asked) as producer,
    ):
        with pytest.raises(ValueError, match="card declined"):
            async with producer.begin() as txn:
                await txn.send(TxMessage("declined", b"x"))
                raise ValueError("card declined")
        await until_span(spans, "txactors.coordinator.rollback", txn.txid)

    transaction = one(spans, tracing.TRANSACTION_SPAN, txn.txid)
    assert transaction.status.status_code is StatusCode.ERROR
    assert transaction.status.description == "ValueError: card declined"
    assert (transaction.attributes or {})["txactors.state"] == "rolled_back"
    assert trace.get_current_span() is trace.INVALID_SPAN, "the block's span is not left current"


async def test_the_check_back_decision_and_a_discard_join_the_producers_trace(
    private_nc: Client, spans: InMemorySpanExporter
) -> None:
    answers: dict[str, Decision] = {}

    async def checker(view: CheckView) -> Decision:
        return answers[view.txid]

    async with (
        run_coordinator(private_nc, config=CoordinatorConfig(check_max=1, **FAST)),
        TransactionProducer(private_nc, "shop", checker) as producer,
    ):
        later, never = producer.begin(), producer.begin()
        answers.update({later.txid: Decision.COMMIT, never.txid: Decision.UNKNOWN})
        for txn in (later, never):
            await txn.send(TxMessage("checked-traced", b"x"))
            await txn.leave_unknown()
        commit = await until_span(spans, "txactors.coordinator.commit", later.txid)
        discard = await until_span(spans, "txactors.coordinator.discard", never.txid)

    for decided, txn in ((commit, later), (discard, never)):
        transaction = one(spans, tracing.TRANSACTION_SPAN, txn.txid)
        assert parent_of(decided) == span_id(transaction), "taken from the kept halves"
        assert (transaction.attributes or {})["txactors.state"] == "prepared"
    assert (discard.attributes or {})["txactors.discard_reason"] == "check_max"
    assert (discard.attributes or {})["txactors.check_times"] == 1


async def test_a_failing_handler_marks_its_span_and_the_retry_is_a_second_span(
    private_nc: Client, spans: InMemorySpanExporter
) -> None:
    app = TxApp("billing")
    attempts: list[int] = []

    @app.consumer("invoices-traced", retry_delays=(0.05,))
    async def on_invoice(message: ConsumedMessage) -> None:
        attempts.append(message.deliveries)
        if message.deliveries == 1:
            raise RuntimeError("the ledger is busy")

    async with (
        run_coordinator(private_nc),
        app.running(private_nc, pull_expires=0.2),
        TransactionProducer(private_nc, "shop", never_asked) as producer,
    ):
        async with producer.begin() as txn:
            await txn.send(TxMessage("invoices-traced", b"x"))
        await eventually(
            lambda: named(spans, tracing.CONSUME_SPAN),
            until=lambda consumed: len(consumed) >= 2,
            timeout=20,
            what="two consume spans",
        )

    first, second = sorted(
        named(spans, tracing.CONSUME_SPAN),
        key=lambda s: (s.attributes or {})["txactors.deliveries"],
    )
    assert first.status.status_code is StatusCode.ERROR
    assert first.status.description == "RuntimeError: the ledger is busy"
    assert [e.name for e in first.events] == ["exception"]
    assert second.status.status_code is StatusCode.UNSET
    publish = one(spans, tracing.PUBLISH_SPAN, txn.txid)
    assert parent_of(first) == parent_of(second) == span_id(publish)


async def test_a_message_without_a_context_starts_a_trace_of_its_own(
    private_nc: Client, spans: InMemorySpanExporter
) -> None:
    """Published outside a transaction (or by an untraced producer): nothing to follow."""
    handled = anyio.Event()

    async def handle(message: ConsumedMessage) -> None:
        handled.set()

    async with Consumer(private_nc, "plain-traced", "audit", handle, pull_expires=0.2):
        await private_nc.jetstream().publish(layout.topic_subject("plain-traced"), b"x")
        with anyio.fail_after(20):
            await handled.wait()
    await eventually(lambda: named(spans, tracing.CONSUME_SPAN), timeout=20, what="a consume span")
    [consume] = named(spans, tracing.CONSUME_SPAN)
    assert consume.parent is None


async def test_without_a_tracer_provider_nothing_is_traced_or_added(private_nc: Client) -> None:
    assert tracing.tracer() is None
    got: list[ConsumedMessage] = []

    async def handle(message: ConsumedMessage) -> None:
        got.append(message)

    async with (
        run_coordinator(private_nc),
        Consumer(private_nc, "untraced", "audit", handle, pull_expires=0.2),
        TransactionProducer(private_nc, "shop", never_asked) as producer,
    ):
        async with producer.begin() as txn:
            await txn.send(TxMessage("untraced", b"x", properties={"origin": "web"}))
        await eventually(lambda: got, timeout=20, what="the message handled")
    assert got[0].properties == {"origin": "web"}, "no trace headers on the message"


def test_trace_headers_are_read_in_any_case_and_replaced_whole(
    spans: InMemorySpanExporter,
) -> None:
    """A client in another language may send `TraceParent`; W3C names are case-insensitive."""
    tracer = tracing.tracer()
    assert tracer is not None
    parent = tracer.start_span("elsewhere")
    headers: dict[str, str] = {}
    tracing.inject(parent, headers)
    assert set(headers) == {tracing.TRACEPARENT}, "no tracestate when there is none"
    foreign = {"TraceParent": headers[tracing.TRACEPARENT], "TraceState": "a=1", "x": "y"}
    child = tracer.start_span("here", context=tracing.extract(foreign))
    assert child.parent is not None and child.parent.span_id == parent.get_span_context().span_id
    tracing.inject(child, foreign)
    assert foreign == {
        "x": "y",
        tracing.TRACEPARENT: foreign[tracing.TRACEPARENT],
        tracing.TRACESTATE: "a=1",
    }
    assert f"{child.get_span_context().span_id:016x}" in foreign[tracing.TRACEPARENT]


def test_without_opentelemetry_installed_every_helper_is_a_no_op(tmp_path: Path) -> None:
    """The `otel` extra is optional: block the package and use the helpers as txactors does."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
from txactors.observe import tracing
from txactors.producer import TransactionProducer  # the hooked modules import fine
from txactors.consumer import Consumer
from txactors.coordinator.partition.actor import PartitionCoordinator
assert tracing.tracer() is None and tracing.RecentTracer()() is None
assert tracing.start_transaction("t", "g", None) is None
headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
tracing.record_publish(tracing.tracer(), headers, "t", "t:0", "orders")
assert headers == {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
with tracing.current(None):
    pass
print("no-op")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.stdout == "no-op\n", done.stderr
