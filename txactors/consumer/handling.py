"""One message through the handler, and what the server is told afterwards.

Kept apart from the consumer's fetching so the at-least-once rule reads in one place: a
message is acked only after its handler returned (and so after any idempotent apply inside
it committed); raising naks it with the retry policy's delay, or dead-letters it once the
retries are used up (at once for `PoisonMessage`); a handler cancelled at stop is naked for
immediate redelivery.

Acks are not sent one by one: `handle` queues them and `flush` publishes the queued ones
together, which nats-py's flusher then writes in one socket write. The consumer calls it when
a batch is done. Until then a crash loses only acks, so the server redelivers the batch, which
at-least-once allows. Naks go at once: they schedule the message's retry.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from txactors.consumer.dlq import dead_letter, describe_error
from txactors.consumer.message import ConsumedMessage, delivered
from txactors.consumer.retry import RetryPolicy
from txactors.errors import PoisonMessage
from txactors.nats.client import TolerantClient
from txactors.nats.retry import LINK_TROUBLE
from txactors.observe import tracing
from txactors.observe.logs import get_logger
from txactors.observe.metrics import ConsumerMetrics
from txactors.wire.layout import REPLAY_GROUP_HEADER

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer  # the `otel` extra

Handler = Callable[[ConsumedMessage], Awaitable[None]]

log = get_logger(__name__)


class Handling:
    """Runs `handler` for the messages of one (topic, group) and settles each with the server.

    No structlog context is bound per message (it cost more than the rest of the bookkeeping);
    the lines logged here name the message themselves.
    """

    def __init__(
        self,
        nc: Client,
        topic: str,
        group: str,
        handler: Handler,
        policy: RetryPolicy,
        metrics: ConsumerMetrics,
    ) -> None:
        self._nc = nc
        self._topic = topic
        self._group = group
        self._handler = handler
        self._policy = policy
        self._metrics = metrics
        self._lag = metrics.lag_of(topic, group)
        self._latency = metrics.handler_latency.labels(topic, group)
        self._acks: list[Msg] = []

    @property
    def acks_queued(self) -> int:
        return len(self._acks)

    async def handle(self, msg: Msg, tracer: Tracer | None) -> None:
        """Run the handler on `msg` (in a span of `tracer`, if tracing is on); queue its ack on
        success, nak or dead-letter on failure."""
        message, pending = delivered(msg)
        self._lag.set(pending)
        if message.headers.get(REPLAY_GROUP_HEADER, self._group) != self._group:
            # A dead letter replayed for another group (`txactors dlq replay`): we had it.
            self._acks.append(msg)
            return
        started = time.perf_counter()
        try:
            if tracer is None:
                await self._handler(message)
            else:
                with tracing.consuming(message, self._group, tracer):
                    await self._handler(message)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._settle(msg.nak(), "nak")  # another instance may take it now
            raise
        except Exception as exc:
            self._latency.observe(time.perf_counter() - started)
            await self._failed(msg, message, exc)
            return
        self._latency.observe(time.perf_counter() - started)
        self._acks.append(msg)

    async def flush(self) -> None:
        """Publish every queued ack; nats-py's flusher sends them in one socket write."""
        acks, self._acks = self._acks, []
        if not acks:
            return
        if isinstance(self._nc, TolerantClient):
            try:
                if await self._nc.ack_all(acks):
                    return
            except (nats.errors.Error, OSError) as exc:  # the server redelivers them anyway
                self._settle_failed("ack", exc)
                return
        for msg in acks:
            try:
                await msg.ack()
            except (nats.errors.Error, OSError) as exc:  # the server redelivers it anyway
                self._settle_failed("ack", exc)

    async def nak(self, msg: Msg) -> None:
        """Hand `msg` back for immediate redelivery (taken but never handled)."""
        await self._settle(msg.nak(), "nak")

    async def _failed(self, msg: Msg, message: ConsumedMessage, error: Exception) -> None:
        poison = isinstance(error, PoisonMessage)
        delay = None if poison else self._policy.after_failure(message.deliveries)
        about = {
            "topic": self._topic,
            "group": self._group,
            "msg_id": message.msg_id,
            "txid": message.txid,
            "deliveries": message.deliveries,
        }
        if delay is not None:
            self._metrics.retries.labels(self._topic, self._group).inc()
            log.warning(
                "consume_failed",
                **about,
                retry_in=delay,
                error=describe_error(error),
                exc_info=error,
            )
            await self._settle(msg.nak(delay=delay), "nak")
            return
        try:
            seq, entry = await dead_letter(
                self._nc.jetstream(), self._group, message, error, max_payload=self._nc.max_payload
            )
        except LINK_TROUBLE as exc:
            retry_in = self._policy.delay(1)
            log.error("dead_letter_failed", **about, error=repr(exc), retry_in=retry_in)
            await self._settle(msg.nak(delay=retry_in), "nak")
            return
        self._metrics.dead_letters.labels(self._topic, self._group).inc()
        log.error(
            "dead_lettered",
            **about,
            poison=poison,
            dlq_seq=seq,
            omitted=",".join(entry.omitted) or None,
            error=describe_error(error),
            exc_info=error,
        )
        self._acks.append(msg)

    async def _settle(self, action: Awaitable[None], what: str) -> None:
        """Send an ack or nak; if the connection is gone the server redelivers anyway."""
        try:
            await action
        except (nats.errors.Error, OSError) as exc:
            self._settle_failed(what, exc)

    def _settle_failed(self, what: str, error: Exception) -> None:
        log.warning(
            "consume_settle_failed",
            topic=self._topic,
            group=self._group,
            action=what,
            error=repr(error),
        )
