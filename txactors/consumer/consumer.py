"""The consumer runtime: a durable JetStream pull consumer per (topic, group).

Delivery is at least once. The handler returning acks the message; raising naks it with the
retry policy's delay, so the server (not this process) holds the message until its next
attempt and a restarted consumer keeps the schedule; after the last retry the message goes
to the group's dead-letter stream and is acked (`handling`). Every instance of a group shares
one durable consumer, so a group's messages are spread over its live instances, as in
RocketMQ's clustering mode.

Why pull requests are issued by hand rather than with nats-py's `fetch`: `fetch(n)` returns
only when n messages came or the wait expired, which would hold an early message back for
the whole wait. Here one request asks for as many messages as there are free handler slots
(at most `concurrency` taken at any time, and a new request once half the slots are free),
and each message is ready for a handler the moment it arrives.

Cheap per message, because per-message overhead is what limits a Python consumer: messages
are taken by the client's read loop itself on a `TolerantClient` (`subscribe_direct`; by a
subscription callback on another client: nats-py's message iterator costs a task and a loop
turn per message), `concurrency` long-lived workers take them (no task per message), and a
worker that runs out of ready messages publishes the batch's queued acks together, which go in
one socket write (on a `TolerantClient`, as one command: `ack_all`). Acks are sent only after
their handlers returned; a crash before that redelivers.

Stopping is graceful: no new pull is issued, the open one runs out (at most `pull_expires`),
in-flight handlers finish and their acks are flushed to the server. A handler still running
after `stop_timeout` is cancelled and its message naked for immediate redelivery, as is a
message taken but not started.

A handler that raises `PoisonMessage` (e.g. a body that does not decode) is dead-lettered at
once: no retry can help it. Lag, retries, dead letters and handler time go to `metrics`.

Who declares the streams: with `declare_streams=True` (the default, for a deployment whose
clients may create streams) the consumer declares its topic and dead-letter streams itself.
Under least privilege (docs/nats-tenants.conf) it may not: with `declare_streams=False` it
never creates or changes a stream, only reads their info, and waits (logged) until the
coordinator has made them (a topic's stream at its first prepare, or both at the
coordinator's start when `consumer_groups` names the group).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack, suppress
from types import TracebackType
from typing import Final, Self

import anyio
import anyio.abc
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from txactors.consumer.handling import Handler, Handling
from txactors.consumer.retry import DEFAULT_MAX_RECONSUME, DEFAULT_RETRY_DELAYS, RetryPolicy
from txactors.errors import ConfigError, ungrouped
from txactors.nats.client import (
    TolerantClient,
    notice_trouble,
    raising_connection_lost,
    watch_connection,
)
from txactors.nats.retry import LINK_TROUBLE
from txactors.nats.topics import (
    DECLARE_DEADLINE,
    declaring,
    ensure_dlq_stream,
    ensure_topic_stream,
    wait_for_stream,
)
from txactors.observe import tracing
from txactors.observe.logs import get_logger
from txactors.observe.metrics import ConsumerMetrics
from txactors.wire.layout import (
    dlq_stream,
    pull_subject,
    topic_filter,
    topic_stream,
    topic_subject,
    validate_name,
)

__all__ = ["Consumer", "Handler"]

RETRY_BACKLOG: Final = 1000
"""A message waiting for a delayed retry still counts against JetStream's max_ack_pending;
this much room on top of `concurrency` keeps a batch of failing messages from stalling the
group until their retries come due."""
PULL_GRACE: Final = 1.0
"""Extra seconds to wait past a pull's expiry before deciding its end status was lost."""
ACK_BATCH: Final = 256
"""Queued acks a busy worker sends without waiting for its batch to end (bounds how long an
ack can wait under a steady stream)."""
_STATUS: Final = "Status"
_HEARTBEAT: Final = "100"
_PULL_DONE: Final = frozenset({"404", "408"})  # no messages / the request expired
_FLUSH_TIMEOUT: Final = 5

log = get_logger(__name__)


class Consumer:
    """Runs `handler` on every message of `topic` for consumer group `group`.

    Run it with `async with Consumer(...):`, or `await tg.start(consumer.run)` in your own
    task group and `await consumer.stop()` later. `tags` narrows the subscription to messages
    with one of those tags (all messages when empty); all instances of a group should
    subscribe alike, since they share one durable consumer. `declare_streams=False`: never
    create or change a stream, wait for the coordinator's (see the module docstring).
    """

    def __init__(
        self,
        nc: Client,
        topic: str,
        group: str,
        handler: Handler,
        *,
        tags: Sequence[str] = (),
        concurrency: int = 16,
        max_reconsume: int = DEFAULT_MAX_RECONSUME,
        retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
        ack_wait: float = 30.0,
        max_ack_pending: int | None = None,
        pull_expires: float = 1.0,
        stop_timeout: float = 30.0,
        replicas: int = 1,
        declare_streams: bool = True,
        metrics: ConsumerMetrics | None = None,
    ) -> None:
        if replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {replicas}")
        if concurrency < 1:
            raise ConfigError(f"concurrency must be >= 1, got {concurrency}")
        if not ack_wait > 0 or not pull_expires > 0:
            raise ConfigError("ack_wait and pull_expires must be > 0 seconds")
        self.topic = validate_name("topic", topic)
        self.group = validate_name("group", group)
        for tag in tags:
            validate_name("tag", tag)
        self._nc = nc
        self._tags = tuple(tags)
        self._concurrency = concurrency
        policy = RetryPolicy(max_reconsume, tuple(retry_delays))
        self._ack_wait = ack_wait
        self._max_ack_pending = max_ack_pending or concurrency + RETRY_BACKLOG
        self._pull_expires = pull_expires
        self._stop_timeout = stop_timeout
        self._replicas = replicas
        self._declare_streams = declare_streams
        self._stream = ""
        self._log = log.bind(topic=topic, group=group)
        self._stopping = False
        self._running = False
        self._done = anyio.Event()
        self._wake = anyio.Event()  # handler slots came free, or stop was asked
        self._active = 0  # messages taken and not yet acked/naked
        self._requested = 0  # messages the open pull request may still bring
        self._pull_done = anyio.Event()
        self._refused = False  # the server refused a pull: re-declare before the next
        self._ready: deque[Msg] = deque()  # taken, no worker yet
        self._in_handler: dict[int, Msg] = {}  # whose handler runs, by id: kept alive
        self._idle: list[asyncio.Future[None]] = []  # one per parked worker
        self._tracer = tracing.RecentTracer()
        self._waking = 0  # workers woken that have not taken a message yet
        self._exit_stack: AsyncExitStack | None = None
        self.metrics = metrics or ConsumerMetrics()
        """Where this consumer's series go (a registry of its own unless one was given)."""
        self.metrics.track(self.topic, self.group)
        self._handling = Handling(nc, self.topic, self.group, handler, policy, self.metrics)

    @property
    def durable_name(self) -> str:
        """The JetStream consumer shared by the group (one per topic stream)."""
        return self.group

    # -- lifecycle ------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Declare the streams and the durable consumer, then consume until `stop()`."""
        if self._running or self._done.is_set():
            raise RuntimeError("a Consumer runs once; create a new one to consume again")
        self._running = True
        try:
            await self._declare()
            sub = await self._subscribe()
            try:
                task_status.started()
                self._log.info("consumer_started", concurrency=self._concurrency)
                # Stop with the error (as itself), never pull in vain.
                with raising_connection_lost(), ungrouped():
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(self._keep_alive)
                        for _ in range(self._concurrency):
                            tg.start_soon(self._work)
                        tg.start_soon(watch_connection, self._nc)
                        await self._pull_loop(sub)
                        await self._drain()
                        tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await self._close(sub)
        finally:
            self._done.set()
        self._log.info("consumer_stopped")

    def request_stop(self) -> None:
        """Ask the consumer to stop, without waiting (safe to call from a handler)."""
        self._stopping = True
        self._wake.set()

    async def stop(self) -> None:
        """Stop fetching, let in-flight handlers finish and ack, and wait until done."""
        self.request_stop()
        if self._running:
            await self._done.wait()

    async def __aenter__(self) -> Self:
        with ungrouped():  # a start that failed, as itself
            async with AsyncExitStack() as stack:
                tg = await stack.enter_async_context(anyio.create_task_group())
                await tg.start(self.run)
                self._exit_stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self.request_stop()
        stack, self._exit_stack = self._exit_stack, None
        assert stack is not None, "__aexit__ without __aenter__"
        with ungrouped():  # the block's error, or the consumer's, as itself
            return await stack.__aexit__(exc_type, exc, tb)

    # -- setup ------------------------------------------------------------------------------

    async def _declare(self) -> None:
        js = self._nc.jetstream()
        if self._declare_streams:
            # The durable consumer inherits its stream's replicas.
            self._stream = await ensure_topic_stream(js, self.topic, replicas=self._replicas)
            # Dead letters are kept as well as the messages they stand for: as many copies as
            # the topic's stream has (a coordinator made it with its `--replicas`), even when
            # this consumer was not told a count.
            topic_replicas = (await js.stream_info(self._stream)).config.num_replicas or 1
            replicas = max(self._replicas, topic_replicas)
            await ensure_dlq_stream(js, self.group, replicas=replicas)
        else:
            self._stream = await wait_for_stream(js, topic_stream(self.topic))
            await wait_for_stream(js, dlq_stream(self.group))
        filters = [topic_subject(self.topic, tag) for tag in self._tags] or [
            topic_filter(self.topic)
        ]
        config = ConsumerConfig(
            name=self.durable_name,
            durable_name=self.durable_name,
            description=f"txactors group {self.group} on topic {self.topic}",
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self._ack_wait,
            max_ack_pending=self._max_ack_pending,
        )
        if len(filters) == 1:
            config.filter_subject = filters[0]
        else:
            config.filter_subjects = filters
        # Creates the durable, or updates it when this instance's settings differ.
        info = await declaring(
            f"consumer {self._stream}/{self.durable_name}",
            lambda: js.add_consumer(self._stream, config),
            deadline=DECLARE_DEADLINE,
        )
        self.metrics.lag_of(self.topic, self.group).set(info.num_pending or 0)

    async def _close(self, sub: Subscription) -> None:
        with suppress(*LINK_TROUBLE):
            await sub.unsubscribe()
        while self._ready:  # taken, never started: someone else may have it now
            await self._handling.nak(self._ready.popleft())
        await self._handling.flush()
        # Acks are fire-and-forget publishes: make sure they left before we say "stopped".
        with suppress(*LINK_TROUBLE):
            await self._nc.flush(_FLUSH_TIMEOUT)

    # -- pulling ----------------------------------------------------------------------------

    async def _pull_loop(self, sub: Subscription) -> None:
        next_subject = pull_subject(self._stream, self.durable_name)
        expires_ns = int(self._pull_expires * 1e9)
        while not self._stopping:
            capacity = self._concurrency - self._active
            # Wait for half the slots (or all, when busy ones are few): fewer, larger pulls.
            if capacity <= 0 or capacity * 2 < self._concurrency:
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            self._requested = capacity
            self._pull_done = anyio.Event()
            request = json.dumps({"batch": capacity, "expires": expires_ns}).encode()
            try:
                await self._nc.publish(next_subject, request, reply=sub.subject)
            except (nats.errors.Error, OSError) as exc:
                self._log.warning("consumer_pull_failed", error=repr(exc))
                self._refused = True
            else:
                # No end status in time means it was lost (e.g. a reconnect, or a server
                # that reaches no consumer leader: a sign for its watch): just pull again.
                with anyio.move_on_after(self._pull_expires + PULL_GRACE) as lost:
                    await self._pull_done.wait()
                if lost.cancelled_caught:
                    notice_trouble(self._nc)
            if self._refused:
                self._refused = False
                await self._recover()

    async def _subscribe(self) -> Subscription:
        """The pull requests' inbox. On a `TolerantClient` its messages are taken in the read
        loop itself (`subscribe_direct`): no queue and no subscription task per message."""
        inbox = self._nc.new_inbox()
        if isinstance(self._nc, TolerantClient):
            return await self._nc.subscribe_direct(inbox, self._delivered, self._delivered_cb)
        return await self._nc.subscribe(inbox, cb=self._delivered_cb)

    async def _delivered_cb(self, msg: Msg) -> None:
        self._delivered(msg)

    def _delivered(self, msg: Msg) -> bool:
        """Make a message ready for a worker, or note how the pull request ended. It never
        waits, so a burst is taken in one loop turn; it takes every message (True)."""
        status = (msg.headers or {}).get(_STATUS)
        if status is None and msg.reply:
            self._active += 1
            self._ready.append(msg)
            self._wake_worker()
            self._requested -= 1
            if self._requested <= 0:
                self._pull_done.set()
        elif status in _PULL_DONE:
            self._pull_done.set()
        elif status != _HEARTBEAT:
            # 409: consumer deleted, leadership change, limits… Say so and re-declare.
            self._log.warning(
                "consumer_pull_refused",
                status=status,
                description=(msg.headers or {}).get("Description"),
            )
            self._refused = True
            self._pull_done.set()
        return True

    async def _recover(self) -> None:
        await anyio.sleep(min(self._pull_expires, 1.0))
        if self._stopping:
            return
        try:
            await self._declare()
        except LINK_TROUBLE as exc:
            self._log.warning("consumer_declare_failed", error=repr(exc))

    async def _drain(self) -> None:
        with anyio.move_on_after(self._stop_timeout) as scope:
            while self._active:
                await self._wake.wait()
                self._wake = anyio.Event()
        if scope.cancelled_caught:
            self._log.warning("consumer_stop_timeout", cancelled_handlers=self._active)

    async def _keep_alive(self) -> None:
        """Tell the server every running handler is still at work, so a slow handler is not
        redelivered to another instance in parallel (ack_wait restarts on each signal)."""
        while True:
            await anyio.sleep(self._ack_wait / 3)
            for key, msg in list(self._in_handler.items()):
                if key in self._in_handler:  # not settled while we were sending
                    with suppress(nats.errors.Error, OSError):
                        await msg.in_progress()

    # -- workers ----------------------------------------------------------------------------

    def _wake_worker(self) -> None:
        """Wake one parked worker, unless one is already on its way: a worker takes ready
        messages until none are left, so one spare is enough. If its handler waits, the spare
        takes the next message and wakes another, so busy workers grow with slow handlers."""
        if self._ready and not self._waking and self._idle:
            self._waking += 1
            self._idle.pop().set_result(None)

    async def _work(self) -> None:
        """Take ready messages one by one; when none are left, send the batch's acks, park
        (on a bare future: nats-py runs on asyncio, and a worker parks once a batch)."""
        handling = self._handling
        loop = asyncio.get_running_loop()
        while True:
            if not self._ready:
                if handling.acks_queued:
                    await handling.flush()
                    continue  # more may have come while the acks went out
                parked: asyncio.Future[None] = loop.create_future()
                self._idle.append(parked)
                try:
                    await parked
                except BaseException:
                    if parked in self._idle:
                        self._idle.remove(parked)
                    raise
                self._waking -= 1
                continue
            msg = self._ready.popleft()
            self._wake_worker()
            key = id(msg)
            self._in_handler[key] = msg
            try:
                await handling.handle(msg, self._tracer())
            finally:
                del self._in_handler[key]
                self._active -= 1
                self._wake.set()
            if handling.acks_queued >= ACK_BATCH:
                await handling.flush()
