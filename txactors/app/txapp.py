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

Underneath, each handler is one `Consumer`; `TxApp.running` starts them all and stops them
gracefully (in-flight handlers finish and ack). `txactors run module:app` runs an app as a
worker process.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, get_type_hints

import aiosqlite
import msgspec
from nats.aio.client import Client

from txactors.consumer.consumer import Consumer, Handler
from txactors.consumer.idempotent import PgConnection, apply_once_postgres, apply_once_sqlite
from txactors.consumer.message import ConsumedMessage
from txactors.consumer.retry import DEFAULT_MAX_RECONSUME, DEFAULT_RETRY_DELAYS
from txactors.errors import ConfigError, ConfigTypeError, PoisonMessage
from txactors.observe.logs import get_logger
from txactors.observe.metrics import ConsumerMetrics
from txactors.wire.layout import validate_name

log = get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Awaitable[None]])
Hook = Callable[[], Awaitable[None]]
Database = Any
"""An aiosqlite connection, or an asyncpg connection or pool (asyncpg is optional)."""
Idempotent = Database | Callable[[], Database]
"""The database itself, or a function returning it (for one opened in an `on_startup` hook)."""

CONNECTION_PARAMETER = "conn"
OnHandled = Callable[["ConsumerSpec", ConsumedMessage], None]


@dataclass(frozen=True, slots=True)
class _Signature:
    """Which of a handler's parameters gets what: decided once, at decoration."""

    body: str | None
    body_type: Any
    message: str | None
    connection: bool


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """One decorated handler and how its Consumer is to run."""

    topic: str
    group: str
    handler: Callable[..., Awaitable[None]]
    signature: _Signature
    idempotent: Idempotent | None
    options: dict[str, Any]

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
        self._shutdown: list[Hook] = []

    def __repr__(self) -> str:
        return f"<TxApp {self.name}: {len(self.consumers)} consumers>"

    def consumer(
        self,
        topic: str,
        *,
        group: str | None = None,
        idempotent: Idempotent | None = None,
        tags: Sequence[str] = (),
        concurrency: int = 16,
        max_reconsume: int = DEFAULT_MAX_RECONSUME,
        retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
        stop_timeout: float = 30.0,
    ) -> Callable[[F], F]:
        """Register the decorated async function as the handler of `topic` for `group`
        (default: the app's name). Returning acks; raising retries with backoff, then
        dead-letters. The function is returned unchanged, so it can be called in unit tests.
        """
        group = validate_name("group", group or self.name)
        validate_name("topic", topic)
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
                    signature=_inspect(handler, idempotent=idempotent is not None),
                    idempotent=idempotent,
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
                if spec.idempotent is not None:
                    _database(spec.idempotent)  # a wrong object fails here, not per message
            async with AsyncExitStack() as stack:
                consumers = [
                    Consumer(
                        nc,
                        spec.topic,
                        spec.group,
                        spec.handle if on_handled is None else _observed(spec, on_handled),
                        metrics=self.metrics,
                        declare_streams=self.declare_streams,
                        **spec.options,
                        **pulls,
                    )
                    for spec in self.consumers
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
            for hook in self._shutdown:
                await hook()
            log.info("app_stopped", app=self.name)


def _observed(spec: ConsumerSpec, on_handled: OnHandled) -> Handler:
    async def handle(message: ConsumedMessage) -> None:
        await spec.handle(message)
        on_handled(spec, message)

    return handle


def _inspect(handler: Callable[..., Any], *, idempotent: bool) -> _Signature:
    if not inspect.iscoroutinefunction(handler):
        raise ConfigTypeError(f"{handler.__qualname__} must be an `async def` function")
    hints = get_type_hints(handler)
    body: str | None = None
    message: str | None = None
    connection = False
    for name, parameter in inspect.signature(handler).parameters.items():
        annotation = hints.get(name, parameter.empty)
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise ConfigTypeError(f"{handler.__qualname__}: *args/**kwargs cannot be filled")
        if isinstance(annotation, type) and issubclass(annotation, ConsumedMessage):
            message = name
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
    return _Signature(body, hints.get(body) if body else None, message, connection)


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
