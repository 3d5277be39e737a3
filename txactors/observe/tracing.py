"""OpenTelemetry tracing, when the `otel` extra is installed and a tracer provider is set.

One trace follows a transaction across processes. The producer's `txactors.transaction`
span puts its W3C trace context (`traceparent`, `tracestate`) in every half message's
properties; the coordinator records its decision (`txactors.coordinator.commit`,
`.rollback`, `.discard`) and each publish (`txactors.coordinator.publish`) as children of
that context, and the published message carries the publish span's context, so the
consumer's `txactors.consume` span is a child of the publish.

Without opentelemetry installed, or with no tracer provider configured (the API's default
proxy), every helper returns at once and no header is added: the import is tried once, and
a call costs a provider look-up. The context always travels in W3C form, whatever
propagators the application configured, so the coordinator (which knows only these two
headers) can replace it. The coordinator only traces transactions that carry a context.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from functools import lru_cache
from typing import TYPE_CHECKING, Final, Protocol

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed: every helper below is a no-op
    _INSTALLED = False
else:
    _INSTALLED = True

if TYPE_CHECKING:
    from opentelemetry.util.types import AttributeValue

Attributes = Mapping[str, "AttributeValue"]

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
TRACE_HEADERS: Final = (TRACEPARENT, TRACESTATE)
"""The W3C trace context headers (also valid property names: not reserved)."""

TRANSACTION_SPAN: Final = "txactors.transaction"
PUBLISH_SPAN: Final = "txactors.coordinator.publish"
CONSUME_SPAN: Final = "txactors.consume"
DECISION_SPAN_PREFIX: Final = "txactors.coordinator."
"""Followed by the decision: `commit`, `rollback` or `discard`."""
TRACER_TTL: Final = 1.0
"""Seconds a `RecentTracer` uses a looked-up tracer (or its absence) before the next lookup."""
_DECISIONS: Final = frozenset({"commit", "rollback", "discard"})


class Decided(Protocol):
    """What a decision span records of an op record (the coordinator's `OpRecord`): observe/
    stands below the coordinator, so it names the fields it reads, not the record."""

    @property
    def txid(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def check_times(self) -> int: ...
    @property
    def by_operator(self) -> bool: ...
    @property
    def reason(self) -> Reason | None: ...


class Reason(Protocol):
    """Why a transaction was discarded (the coordinator's `DiscardReason`), by its value."""

    @property
    def value(self) -> str: ...


class Delivered(Protocol):
    """What a consume span records of a delivered message (the consumer's `ConsumedMessage`)."""

    @property
    def topic(self) -> str: ...
    @property
    def msg_id(self) -> str: ...
    @property
    def deliveries(self) -> int: ...
    @property
    def txid(self) -> str | None: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


def tracer() -> trace.Tracer | None:
    """txactors' tracer from the configured provider; None when tracing is off."""
    if not _INSTALLED:
        return None
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return _tracer_of(provider)


class RecentTracer:
    """`tracer()`, looked up at most once per `TRACER_TTL`: a lookup (the API reads the
    environment and raises `KeyError` inside) costs about 10,000 instructions, as much as a
    small message's handling. A provider set later is used within that time."""

    def __init__(self) -> None:
        self._found: trace.Tracer | None = None
        self._due = 0.0  # when to look it up again

    def __call__(self) -> trace.Tracer | None:
        now = time.monotonic()
        if now >= self._due:
            self._found, self._due = tracer(), now + TRACER_TTL
        return self._found


@lru_cache(maxsize=4)
def _tracer_of(provider: trace.TracerProvider) -> trace.Tracer:
    return provider.get_tracer("txactors")


# -- headers --------------------------------------------------------------------------------


def has_context(headers: Mapping[str, str]) -> bool:
    return any(name.lower() == TRACEPARENT for name in headers)


def extract(headers: Mapping[str, str]) -> Context:
    """The remote context in `headers`; an empty context (a new trace) when there is none.
    Names are matched in any case, as W3C says (NATS keeps them as the sender wrote them)."""
    carrier = {name.lower(): value for name, value in headers.items()}
    return TraceContextTextMapPropagator().extract(carrier, Context())


def inject(span: trace.Span, headers: MutableMapping[str, str]) -> None:
    """Put `span`'s context in `headers`, replacing any trace context they had."""
    for name in [n for n in headers if n.lower() in TRACE_HEADERS]:
        del headers[name]
    TraceContextTextMapPropagator().inject(headers, trace.set_span_in_context(span))


# -- spans ----------------------------------------------------------------------------------


def start_transaction(txid: str, group: str, found: trace.Tracer | None) -> trace.Span | None:
    """The producer's span for one transaction in `found` (`tracer()`, or a `RecentTracer`'s),
    a child of the caller's current span; None when tracing is off (`found` None). The caller
    ends it (`finish`)."""
    if found is None:
        return None
    attributes = {"txactors.txid": txid, "txactors.group": group}
    return found.start_span(TRANSACTION_SPAN, kind=trace.SpanKind.PRODUCER, attributes=attributes)


@contextmanager
def current(span: trace.Span | None) -> Iterator[None]:
    """Make `span` the current one for the block (so the caller's own spans nest in it)."""
    if span is None:
        yield
        return
    # Errors are the owner's to record (`fail`): the span may have ended inside the block.
    with trace.use_span(
        span, end_on_exit=False, record_exception=False, set_status_on_exception=False
    ):
        yield


def fail(span: trace.Span | None, error: BaseException | None) -> None:
    """Mark `span` as failed with `error` (if both are there)."""
    if span is None or error is None:
        return
    span.record_exception(error)
    span.set_status(trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")


def finish(span: trace.Span | None, attributes: Attributes) -> None:
    if span is not None:
        span.set_attributes(attributes)
        span.end()


def record_decisions(
    records: Iterable[Decided], headers_of: Callable[[str], Mapping[str, str]], partition: int
) -> None:
    """One short span per decision among `records`, a child of the transaction's context
    as its halves carry it (`headers_of(txid)`); transactions without one are not traced."""
    found = tracer()
    if found is None:
        return
    for record in records:
        if record.kind not in _DECISIONS:
            continue
        headers = headers_of(record.txid)
        if not has_context(headers):
            continue
        attributes: dict[str, AttributeValue] = {
            "txactors.txid": record.txid,
            "txactors.partition": partition,
            "txactors.check_times": record.check_times,
            "txactors.by_operator": record.by_operator,
        }
        if record.reason is not None:
            attributes["txactors.discard_reason"] = record.reason.value
        span = found.start_span(
            DECISION_SPAN_PREFIX + record.kind, context=extract(headers), attributes=attributes
        )
        span.end()


def record_publish(
    found: trace.Tracer | None,
    headers: MutableMapping[str, str],
    txid: str,
    msg_id: str,
    topic: str,
) -> None:
    """If tracing is on (`found`: `tracer()`, or a `RecentTracer`'s) and `headers` (a
    committed message's, built from its half) carry a trace context: record the publish in
    `found` as its child and make the message carry the publish span's context."""
    if found is None or not has_context(headers):
        return
    attributes = {"txactors.txid": txid, "txactors.msg_id": msg_id, "txactors.topic": topic}
    span = found.start_span(
        PUBLISH_SPAN, context=extract(headers), kind=trace.SpanKind.PRODUCER, attributes=attributes
    )
    inject(span, headers)
    span.end()


@contextmanager
def consuming(message: Delivered, group: str, found: trace.Tracer) -> Iterator[None]:
    """Run the block (`group`'s handler of `message`) in a `txactors.consume` span of `found`
    (`tracer()`, which a consumer looks up once per batch), a child of the message's context
    (a new trace without one); an exception escaping the block marks the span as an error."""
    attributes: dict[str, AttributeValue] = {
        "txactors.topic": message.topic,
        "txactors.group": group,
        "txactors.msg_id": message.msg_id,
        "txactors.deliveries": message.deliveries,
    }
    if message.txid is not None:
        attributes["txactors.txid"] = message.txid
    context = extract(message.headers)
    kind = trace.SpanKind.CONSUMER
    with found.start_as_current_span(CONSUME_SPAN, context, kind, attributes):
        yield
