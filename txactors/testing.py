"""Test your own transactional code against the real thing, in milliseconds: a pytest plugin.

Installed with txactors (entry point `pytest11`), so its fixtures are there in every test
(they need pytest-asyncio: `pip install txactors[testing]`; each lives for one test, so set
`asyncio_default_fixture_loop_scope = "function"` in your pytest settings, as the README
shows, and pytest-asyncio does not warn). Each is named `txactors_*`:

- `txactors_nats_server`: a private nats-server with JetStream on a free port, with its
  store in the test's temporary directory (so every test starts with empty streams);
- `txactors_nc`: a client connected to it;
- `txactors_clock`: a `ManualClock`, the coordinator's time, which moves only by
  `advance(seconds)`: a check-back due in 6 s (or after 15 checks, hours) comes at once;
- `txactors_coordinator`: a coordinator in this process on that server and clock, with
  `txactors_coordinator_config` (override that fixture to change timeouts or check_max);
- `txactors_producer`: `await txactors_producer(group, checker)` gives a running
  `TransactionProducer`;
- `txactors_consumer`: `await txactors_consumer(topic, group)` gives a `Received` that records
  each message the group consumed (after your `handler`, if given, returned);
- `txactors_app`: `await txactors_app(app)` runs a `TxApp`'s consumers and gives a `Received`
  of what its handlers handled.

Everything started by a fixture is stopped after the test. `Received.wait` waits for messages;
for anything else, `eventually(probe)` calls a probe (sync or async) until its answer holds and
fails the test naming it if it never does, instead of a hand-written loop of sleeps:

    js = txactors_nc.jetstream()
    await eventually(lambda: js.stream_info("TXN_DISCARD"), until=lambda i: i.state.messages)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import anyio
import pytest
import pytest_asyncio
from nats.aio.client import Client

from txactors.app.txapp import ConsumerSpec, TxApp
from txactors.consumer import ConsumedMessage, Consumer, Handler
from txactors.coordinator import CoordinatorConfig
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import RunningCoordinator, run_coordinator
from txactors.embedded.server import EmbeddedNatsServer
from txactors.errors import ConfigError, TxActorsError
from txactors.nats.client import connect
from txactors.producer import Checker, TransactionProducer

__all__ = ["MakeConsumer", "MakeProducer", "ManualClock", "Received", "RunApp", "eventually"]

TICK = 0.005
"""The test coordinator's tick: the unit of its clock-driven looks (late halves)."""
PULL_EXPIRES = 0.1
"""Test consumers' pull length: a consumer stops (at teardown) within this."""
DEFAULT_WAIT = 10.0
POLL_INTERVAL = 0.02
"""Seconds between two looks of `eventually` at its condition: short against any timeout."""

T = TypeVar("T")


async def eventually(
    probe: Callable[[], T] | Callable[[], Awaitable[T]],
    *,
    what: str | None = None,
    timeout: float = DEFAULT_WAIT,
    until: Callable[[T], object] = bool,
    ignoring: tuple[type[BaseException], ...] = (),
    interval: float = POLL_INTERVAL,
    explain: Callable[[], str] | None = None,
) -> T:
    """Call `probe` (sync or async) until `until(value)` holds, and return that value.

    For a condition no event announces (a stream's count, a row in a database): a fixed
    sleep is too short on a loaded machine and wasted on an idle one. A probe raising one of
    `ignoring` counts as "not yet" (a stream not declared so far); any other error fails at
    once. On timeout, raises `AssertionError` with `what` (by default the probe's name, or a
    lambda's source), the last value (or error) seen and what `explain` says then.
    """
    last: object = "(no answer yet)"
    with anyio.move_on_after(timeout):
        while True:
            try:
                value = probe()
                if inspect.isawaitable(value):
                    value = await value
            except ignoring as error:
                last = error
            else:
                last = value
                if until(cast(T, value)):
                    return cast(T, value)
            await anyio.sleep(interval)
    awaited = what or _described(probe)
    message = f"not within {timeout:g} s: {awaited} (last seen: {_short(last)})"
    raise AssertionError(message if explain is None else f"{message}\n{explain()}")


def _described(probe: Callable[..., object]) -> str:
    """A lambda's source line, or a function's name: what a test waited for, unless it said."""
    name = getattr(probe, "__qualname__", repr(probe))
    if not name.endswith("<lambda>"):
        return name
    try:
        return inspect.getsource(probe).strip()
    except (OSError, TypeError):
        return name


def _short(value: object, limit: int = 500) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


class ManualClock:
    """Time that stands still until `advance` moves it; the coordinator reads it as its
    clock, and its timers wake when it moves (a `MovingClock`). It starts at the real time,
    so timestamps in headers still look like dates."""

    def __init__(self, start: float | None = None) -> None:
        self._now = time.time() if start is None else start
        self._moved: anyio.Event | None = None
        """Set by the next `advance`; made by the first waiter (it needs a running loop)."""

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward; the coordinator acts on what fell due within a few ms."""
        if seconds < 0:
            raise ConfigError(f"time only moves forward, not by {seconds}")
        self._now += seconds
        moved, self._moved = self._moved, None
        if moved is not None:
            moved.set()

    async def moved(self) -> None:
        """Return once `advance` has moved the clock."""
        if self._moved is None:
            self._moved = anyio.Event()
        await self._moved.wait()


class Received:
    """The messages a test consumer (or app) handled, in the order they were handled."""

    def __init__(self) -> None:
        self.messages: list[ConsumedMessage] = []
        self._changed = anyio.Event()

    def record(self, message: ConsumedMessage) -> None:
        self.messages.append(message)
        self._changed.set()
        self._changed = anyio.Event()

    async def wait(self, count: int = 1, timeout: float = DEFAULT_WAIT) -> list[ConsumedMessage]:
        """The first `count` messages, once they arrived; TimeoutError after `timeout` s."""
        with anyio.fail_after(timeout):
            while len(self.messages) < count:
                await self._changed.wait()
        return self.messages[:count]


class _Holder:
    """Keeps async context managers open in a task of its own until `close()`.

    pytest-asyncio runs a fixture's setup and its teardown in two different tasks, but a
    coordinator or consumer holds anyio task groups, whose cancel scopes must be left in the
    task that entered them. So the fixture asks this task to enter them, and to leave them.
    A failure inside one (a consumer that died) surfaces at `close()`, i.e. at teardown.
    """

    def __init__(self) -> None:
        self._requests: asyncio.Queue[
            tuple[AbstractAsyncContextManager[object], asyncio.Future[object]] | None
        ] = asyncio.Queue()
        self._task = asyncio.create_task(self._hold())

    async def enter(self, manager: AbstractAsyncContextManager[T]) -> T:
        entered: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        await self._requests.put((manager, entered))
        waiting: set[asyncio.Future[Any]] = {entered, self._task}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if not entered.done():  # what it held failed, and it stopped
            self._task.result()
            raise TxActorsError("txactors.testing: the fixture's holder task stopped")
        return entered.result()  # type: ignore[return-value]

    async def close(self) -> None:
        await self._requests.put(None)
        await self._task

    async def _hold(self) -> None:
        async with AsyncExitStack() as stack:
            while (request := await self._requests.get()) is not None:
                manager, entered = request
                try:
                    entered.set_result(await stack.enter_async_context(manager))
                except Exception as error:
                    entered.set_exception(error)


@asynccontextmanager
async def _held() -> AsyncIterator[_Holder]:
    holder = _Holder()
    try:
        yield holder
    finally:
        await holder.close()


class MakeProducer(Protocol):
    def __call__(
        self, group: str, checker: Checker, *, partitions: int | None = None
    ) -> Awaitable[TransactionProducer]: ...


class MakeConsumer(Protocol):
    def __call__(
        self, topic: str, group: str, handler: Handler | None = None, *, max_reconsume: int = 16
    ) -> Awaitable[Received]: ...


RunApp = Callable[[TxApp], Awaitable[Received]]


@pytest.fixture
def txactors_clock() -> ManualClock:
    return ManualClock()


@pytest_asyncio.fixture
async def txactors_nats_server(tmp_path: Path) -> AsyncIterator[EmbeddedNatsServer]:
    async with EmbeddedNatsServer(tmp_path / "txactors-nats") as server:
        yield server


@pytest_asyncio.fixture
async def txactors_nc(txactors_nats_server: EmbeddedNatsServer) -> AsyncIterator[Client]:
    client = await connect(txactors_nats_server.url, name="txactors-testing")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def txactors_coordinator_config() -> CoordinatorConfig:
    """RocketMQ's defaults (6 s transaction timeout, 15 checks); time is the manual clock."""
    return CoordinatorConfig()


@pytest_asyncio.fixture
async def txactors_coordinator(
    txactors_nc: Client,
    txactors_clock: ManualClock,
    txactors_coordinator_config: CoordinatorConfig,
) -> AsyncIterator[RunningCoordinator]:
    options = CoordinatorOptions(tick_interval=TICK)
    coordinator = run_coordinator(
        txactors_nc, config=txactors_coordinator_config, options=options, clock=txactors_clock
    )
    async with _held() as holder:
        yield await holder.enter(coordinator)


@pytest_asyncio.fixture
async def txactors_producer(txactors_nc: Client) -> AsyncIterator[MakeProducer]:
    async with _held() as holder:

        async def make(
            group: str, checker: Checker, *, partitions: int | None = None
        ) -> TransactionProducer:
            producer = TransactionProducer(txactors_nc, group, checker, partitions=partitions)
            return await holder.enter(producer)

        yield make


@pytest_asyncio.fixture
async def txactors_consumer(txactors_nc: Client) -> AsyncIterator[MakeConsumer]:
    async with _held() as holder:

        async def make(
            topic: str, group: str, handler: Handler | None = None, *, max_reconsume: int = 16
        ) -> Received:
            received = Received()

            async def handle(message: ConsumedMessage) -> None:
                if handler is not None:
                    await handler(message)
                received.record(message)

            consumer = Consumer(
                txactors_nc,
                topic,
                group,
                handle,
                max_reconsume=max_reconsume,
                pull_expires=PULL_EXPIRES,
            )
            await holder.enter(consumer)
            return received

        yield make


@pytest_asyncio.fixture
async def txactors_app(txactors_nc: Client) -> AsyncIterator[RunApp]:
    async with _held() as holder:

        async def run(app: TxApp) -> Received:
            received = Received()

            def handled(spec: ConsumerSpec, message: ConsumedMessage) -> None:
                received.record(message)

            running = app.running(txactors_nc, on_handled=handled, pull_expires=PULL_EXPIRES)
            await holder.enter(running)
            return received

        yield run
