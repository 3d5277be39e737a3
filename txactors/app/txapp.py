"""Typed handlers: a service's consumers declared as decorated async functions.

    app = TxApp("orders-svc")

    @app.consumer("orders", group="logistics", idempotent=lambda: db)
    async def on_paid(order: OrderPaid, message: ConsumedMessage) -> None: ...

The body parameter's annotation decides decoding: a msgspec Struct (or any type msgspec
decodes; `bytes` takes the raw body), msgpack or JSON as the producer marked it. A body that
does not decode is a `PoisonMessage`: dead-lettered at once with the decoder's error, never
retried. A parameter annotated `ConsumedMessage` gets the delivery itself (keys, txid,
headers). With `idempotent=`, the handler runs inside `apply_once_sqlite` /
`apply_once_postgres` on that database, and a parameter named `conn` gets the connection of
that transaction, so the business change and the message-apply record commit together.

A handler that sends (`sends=producer`, with `idempotent=` the producer's `TxLog`) gets a
parameter annotated `Outbox`; what it sends through it is one transaction, prepared before
and committed after the local transaction that holds the input's apply record, its log row
and the change (`chain.py`):

    @app.consumer("orders", group="logistics", idempotent=txlog, sends=producer)
    async def on_paid(order: OrderPaid, conn: aiosqlite.Connection, out: Outbox) -> None:
        await out.send(TxMessage("shipments", ShipmentBooked(order.order_id)))

Underneath, each handler is one `Consumer`; `TxApp.running` starts them all and stops them
gracefully (in-flight handlers finish and ack). `txactors run module:app` runs an app as a
worker process.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, get_origin, get_type_hints

import aiosqlite
import msgspec
from nats.aio.client import Client

from txactors.app.chain import Outbox, apply_and_send, check_sends
from txactors.consumer.consumer import Consumer, Handler
from txactors.consumer.idempotent import PgConnection, apply_once_postgres, apply_once_sqlite
from txactors.consumer.message import ConsumedMessage
from txactors.consumer.retry import DEFAULT_MAX_RECONSUME, DEFAULT_RETRY_DELAYS
from txactors.errors import ConfigError, ConfigTypeError, PoisonMessage
from txactors.observe.logs import get_logger
from txactors.observe.metrics import ConsumerMetrics
from txactors.producer.producer import TransactionProducer
from txactors.producer.txlog.log import TxLog
from txactors.wire.layout import validate_name

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[None]])
Hook = Callable[[], Awaitable[None]]
Database = Any
"""An aiosqlite connection, or an asyncpg connection or pool (asyncpg is optional)."""
Idempotent = Database | Callable[[], Database]
"""The database itself, or a function returning it (for one opened in an `on_startup` hook)."""
Sends = TxLog[Any] | TransactionProducer | Callable[[], TxLog[Any] | TransactionProducer]
"""A `TxLog` (the app starts its group's producer, answering check-backs from it), or a
`TransactionProducer` of that group with the log as `idempotent=`; or a function returning
one (for one opened in an `on_startup` hook)."""

CONNECTION_PARAMETER = "conn"
OnHandled = Callable[["ConsumerSpec", ConsumedMessage], None]


@dataclass(frozen=True, slots=True)
class _Signature:
    """Which of a handler's parameters gets what: decided once, at decoration."""

    body: str | None
    body_type: Any
    message: str | None
    connection: bool
    outbox: str | None = None


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """One decorated handler and how its Consumer is to run."""

    topic: str
    group: str
    handler: Callable[..., Awaitable[None]]
    signature: _Signature
    idempotent: Idempotent | None
    options: dict[str, Any]
    sends: Sends | None = None

    async def handle(self, message: ConsumedMessage) -> None:
        """Decode, then call the handler (inside the apply-once transaction if asked)."""
        kwargs: dict[str, Any] = {}
        if self.signature.body is not None:
            kwargs[self.signature.body] = _decode(message, self.signature.body_type)
        if self.signature.message is not None:
            kwargs[self.signature.message] = message
        if self.idempotent is None:
            await self.handler(**kwargs)
            return

        async def work(conn: Any) -> None:
            if self.signature.connection:
                kwargs[CONNECTION_PARAMETER] = conn
            await self.handler(**kwargs)

        db = _database(self.idempotent)
        if isinstance(db, aiosqlite.Connection):
            applied = await apply_once_sqlite(db, self.group, message.msg_id, work)
        else:
            applied = await apply_once_postgres(db, self.group, message.msg_id, work)
        if not applied:
            log.info("already_applied", topic=self.topic, group=self.group, msg_id=message.msg_id)

    def chained(self, txlog: TxLog[Any], producer: TransactionProducer) -> Handler:
        """The handler of a consumer that sends (`sends=`): decode, then call the handler
        inside `apply_and_send`'s local transaction."""

        async def handle(message: ConsumedMessage) -> None:
            kwargs: dict[str, Any] = {}
            if self.signature.body is not None:
                kwargs[self.signature.body] = _decode(message, self.signature.body_type)
            if self.signature.message is not None:
                kwargs[self.signature.message] = message

            async def work(conn: Any, outbox: Outbox[Any]) -> None:
                if self.signature.connection:
                    kwargs[CONNECTION_PARAMETER] = conn
                if self.signature.outbox is not None:
                    kwargs[self.signature.outbox] = outbox
                await self.handler(**kwargs)

            await apply_and_send(txlog, producer, self.group, message, work)

        return handle


class TxApp:
    """A service's consumers, declared with `@app.consumer(...)` and run together.

    `name` is the default consumer group. Run it with `txactors run module:app`, or in your
    own program with `async with app.running(nc): ...`. Its consumers' metrics are in
    `app.metrics` (`txactors run --metrics-port` serves them). `declare_streams=False`: its
    consumers create no stream and wait for the coordinator's (`Consumer`'s parameter; a
    deployment under least privilege, docs/operations.md "Tenants kept apart").
    """

    def __init__(self, name: str, *, declare_streams: bool = True) -> None:
        self.name = validate_name("group", name)
        self.declare_streams = declare_streams
        self.consumers: list[ConsumerSpec] = []
        self.metrics = ConsumerMetrics()
        self._startup: list[Hook] = []
        self._producers: dict[int, TransactionProducer] = {}
        """The producers the app started for its `sends=txlog` handlers, by log."""
        self._shutdown: list[Hook] = []

    def __repr__(self) -> str:
        return f"<TxApp {self.name}: {len(self.consumers)} consumers>"

    def consumer(
        self,
        topic: str,
        *,
        group: str | None = None,
        idempotent: Idempotent | None = None,
        sends: Sends | None = None,
        tags: Sequence[str] = (),
        concurrency: int = 16,
        max_reconsume: int = DEFAULT_MAX_RECONSUME,
        retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
        stop_timeout: float = 30.0,
    ) -> Callable[[F], F]:
        """Register the decorated async function as the handler of `topic` for `group`
        (default: the app's name). Returning acks; raising retries with backoff, then
        dead-letters. The function is returned unchanged, so it can be called in unit tests.

        `sends=txlog` makes it a handler that sends: a parameter annotated `Outbox` sends
        messages that are published if and only if the handler's change (on `conn`, the
        log's database) commits, each input applied once (`chain.py`). The app starts the
        log's group's producer, answering check-backs from the log, and creates the log's
        tables; `sends=producer` (with `idempotent=txlog`) uses a producer of your own.
        """
        group = validate_name("group", group or self.name)
        validate_name("topic", topic)
        if isinstance(sends, TransactionProducer) and idempotent is None:
            raise ConfigError(
                f"{self.name}: sends=producer needs idempotent= (the producer's TxLog): the "
                "apply record and the outgoing transaction's log row commit with the change"
            )
        if any((c.topic, c.group) == (topic, group) for c in self.consumers):
            raise ConfigError(
                f"{self.name}: group {group!r} already has a handler for topic {topic!r}; "
                "two handlers would split its messages between them"
            )

        def register(handler: F) -> F:
            self.consumers.append(
                ConsumerSpec(
                    topic=topic,
                    group=group,
                    handler=handler,
                    signature=_inspect(
                        handler,
                        idempotent=idempotent is not None or sends is not None,
                        sends=sends is not None,
                    ),
                    idempotent=idempotent,
                    sends=sends,
                    options={
                        "tags": tuple(tags),
                        "concurrency": concurrency,
                        "max_reconsume": max_reconsume,
                        "retry_delays": tuple(retry_delays),
                        "stop_timeout": stop_timeout,
                    },
                )
            )
            self.metrics.track(topic, group)  # its series exist, at zero, before it runs
            return handler

        return register

    def on_startup(self, hook: Hook) -> Hook:
        """Run `hook()` before the consumers start (open databases here)."""
        self._startup.append(hook)
        return hook

    def on_shutdown(self, hook: Hook) -> Hook:
        """Run `hook()` after the consumers stopped (close databases here)."""
        self._shutdown.append(hook)
        return hook

    @asynccontextmanager
    async def running(
        self,
        nc: Client,
        *,
        on_handled: OnHandled | None = None,
        pull_expires: float | None = None,
    ) -> AsyncIterator[list[Consumer]]:
        """Start every consumer on `nc` for the block; on exit stop them all gracefully.

        For tests (`txactors.testing`): `on_handled(spec, message)` is called after a handler
        returned (before the ack), and `pull_expires` shortens every consumer's pull, which
        a stopping consumer waits out.
        """
        pulls: dict[str, Any] = {} if pull_expires is None else {"pull_expires": pull_expires}
        if not self.consumers:
            raise ConfigError(f"{self.name} has no consumers: decorate one with @app.consumer")
        for hook in self._startup:
            await hook()
        try:
            for spec in self.consumers:
                if spec.sends is None and spec.idempotent is not None:
                    _database(spec.idempotent)  # a wrong object fails here, not per message
            async with AsyncExitStack() as stack:
                handlers = [await self._handler(spec, nc, stack) for spec in self.consumers]
                consumers = [
                    Consumer(
                        nc,
                        spec.topic,
                        spec.group,
                        handle if on_handled is None else _observed(spec, handle, on_handled),
                        metrics=self.metrics,
                        declare_streams=self.declare_streams,
                        **spec.options,
                        **pulls,
                    )
                    for spec, handle in zip(self.consumers, handlers, strict=True)
                ]
                try:
                    for consumer in consumers:
                        await stack.enter_async_context(consumer)
                    log.info("app_started", app=self.name, consumers=len(consumers))
                    yield consumers
                finally:
                    for consumer in consumers:  # all stop pulling at once, then each drains
                        consumer.request_stop()
        finally:
            self._producers.clear()
            for hook in self._shutdown:
                await hook()
            log.info("app_stopped", app=self.name)

    async def _handler(self, spec: ConsumerSpec, nc: Client, stack: AsyncExitStack) -> Handler:
        """What `spec`'s Consumer calls; for one that sends, its log's tables made and its
        producer started (one per log, stopped after the consumers)."""
        if spec.sends is None:
            return spec.handle
        where = f"{self.name}: handler of {spec.topic!r} for {spec.group!r}"
        sends: Any = _resolved(spec.sends)
        txlog: Any
        producer: Any
        if isinstance(sends, TransactionProducer):
            txlog, producer = _resolved(spec.idempotent), sends
        else:
            txlog = sends
            if spec.idempotent is not None and _resolved(spec.idempotent) is not txlog:
                raise ConfigError(f"{where}: with sends=txlog, idempotent= is that log or unset")
            producer = self._producers.get(id(txlog))
            if producer is None and isinstance(txlog, TxLog):
                producer = TransactionProducer(nc, txlog.group, txlog.check)
                await stack.enter_async_context(producer)
                self._producers[id(txlog)] = producer
        check_sends(txlog, producer, where)
        await txlog.create_table()
        await txlog.create_applied_table()
        return spec.chained(txlog, producer)


def _observed(spec: ConsumerSpec, handler: Handler, on_handled: OnHandled) -> Handler:
    async def handle(message: ConsumedMessage) -> None:
        await handler(message)
        on_handled(spec, message)

    return handle


def _inspect(handler: Callable[..., Any], *, idempotent: bool, sends: bool = False) -> _Signature:
    if not inspect.iscoroutinefunction(handler):
        raise ConfigTypeError(f"{handler.__qualname__} must be an `async def` function")
    hints = get_type_hints(handler)
    body: str | None = None
    message: str | None = None
    connection = False
    outbox: str | None = None
    for name, parameter in inspect.signature(handler).parameters.items():
        annotation = hints.get(name, parameter.empty)
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ConfigTypeError(f"{handler.__qualname__}: *args/**kwargs cannot be filled")
        if isinstance(annotation, type) and issubclass(annotation, ConsumedMessage):
            message = name
        elif _is_outbox(annotation):
            if not sends:
                raise ConfigTypeError(
                    f"{handler.__qualname__}: {name!r} is an Outbox, which only a handler "
                    "declared with sends= (and idempotent=) gets"
                )
            outbox = name
        elif name == CONNECTION_PARAMETER and idempotent:
            connection = True
        elif body is not None:
            raise ConfigTypeError(
                f"{handler.__qualname__}: both {body!r} and {name!r} would be the body; a "
                f"handler takes one body, a ConsumedMessage, and with idempotent= a "
                f"{CONNECTION_PARAMETER!r}"
            )
        elif annotation is parameter.empty:
            raise ConfigTypeError(
                f"{handler.__qualname__}: annotate {name!r} with the body's type "
                "(a msgspec Struct, or bytes for the raw body)"
            )
        else:
            try:
                msgspec.msgpack.Decoder(annotation)
            except TypeError as error:
                raise ConfigTypeError(f"{handler.__qualname__}: {name!r}: {error}") from error
            body = name
    return _Signature(body, hints.get(body) if body else None, message, connection, outbox)


def _is_outbox(annotation: Any) -> bool:
    origin = get_origin(annotation) or annotation
    return isinstance(origin, type) and issubclass(origin, Outbox)


def _resolved(value: Any) -> Any:
    """A `sends=` or `idempotent=` given as a function: what it returns now."""
    return value() if callable(value) else value


def _decode(message: ConsumedMessage, type_: Any) -> Any:
    if type_ is bytes:
        return message.body
    try:
        return message.decode(type_)
    except msgspec.DecodeError as error:
        name = getattr(type_, "__name__", repr(type_))
        raise PoisonMessage(f"body does not decode as {name}: {error}") from error


def _database(idempotent: Idempotent) -> Database:
    db = idempotent() if callable(idempotent) else idempotent
    if isinstance(db, aiosqlite.Connection | PgConnection) or hasattr(db, "acquire"):
        return db
    raise ConfigTypeError(
        f"idempotent= must be an aiosqlite connection or an asyncpg connection or pool "
        f"(or a function returning one), got {type(db).__name__}"
    )
