"""Talking to JetStream over a connection that may drop: what a failure means, and waiting.

`classify` tells a transient failure (worth the same write again) from a permanent one;
`linked` gives up a call as soon as the connection drops instead of waiting out its
timeout; `AckInbox` settles every answer to our writes, refusals included. The writers
(`effects.py`, `oplog.py`) and the check-backs build on these.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import json
import random
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header, PubAck

from txactors.errors import TxActorsError
from txactors.logs import get_logger
from txactors.topics import CLUSTER_TRANSIENT_CODES

log = get_logger(__name__)

T = TypeVar("T")

RETRY_INITIAL = 0.05
RETRY_MAX = 2.0
ACK_TIMEOUT = 5.0
"""An ack not back this long after its append, on a live connection, counts as lost."""
FIRST_ATTEMPT = 1.0
"""Seconds the first attempt of a retried read may take. A request sent while the stream has
no leader is never answered: waiting out the JetStream API timeout (5 s) would hold a
recovery or a commit that long after the election. Later attempts get twice as long each, so
a slow server is waited for too."""
LINK_POLL = 0.05
NO_RESPONDERS = "503"

LINK_TROUBLE = (nats.errors.Error, TimeoutError, OSError)
"""What a NATS or JetStream call raises when the broker, not our code, is the problem."""


class Fault(enum.Enum):
    TRANSIENT = "transient"
    PERMANENT = "permanent"


def classify(error: BaseException) -> Fault:
    """Whether trying the same append again can succeed.

    Timeouts, lost connections, "no responders" (JetStream restarting or electing a leader)
    and 503/500 answers pass; anything else JetStream answers (too large, wrong expected
    sequence, stream sealed or misconfigured) will be answered the same way every time.
    A stream that is really gone answers "no responders" too: `PipelinedWriter` tells it
    apart by asking JetStream which stream holds the subject.
    """
    if isinstance(error, nats.js.errors.ServiceUnavailableError | nats.js.errors.ServerError):
        return Fault.TRANSIENT
    if isinstance(error, nats.js.errors.APIError) and error.err_code in CLUSTER_TRANSIENT_CODES:
        return Fault.TRANSIENT
    if isinstance(error, nats.js.errors.APIError | nats.errors.MaxPayloadError):
        return Fault.PERMANENT
    return Fault.TRANSIENT


def backoff(delay: float) -> float:
    """The wait after `delay`: doubled up to `RETRY_MAX`, with up to a fifth of jitter so
    the partitions of a coordinator do not all come back to a recovering server at once."""
    return min(delay * 2, RETRY_MAX) * (1 - random.random() / 5)


def transient(error: BaseException) -> bool:
    """A broker failure worth trying again (`LINK_TROUBLE`, `LinkLost`, not `PERMANENT`)."""
    return isinstance(error, (*LINK_TROUBLE, LinkLost)) and classify(error) is Fault.TRANSIENT


async def retry_transient(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`await fn(*args)`, tried again with capped, jittered backoff while it fails
    transiently (`classify`): a partition rides out a leader election instead of failing.
    The first attempt may take `FIRST_ATTEMPT` seconds, each next one twice as long."""
    delay = RETRY_INITIAL
    attempt = FIRST_ATTEMPT
    while True:
        try:
            with anyio.fail_after(attempt):
                return await fn(*args)
        except (*LINK_TROUBLE, LinkLost) as error:
            if not transient(error):
                raise
            name = getattr(fn, "__name__", type(fn).__name__)
            log.warning("jetstream_retry", call=name, error=describe(error), delay=delay)
        await anyio.sleep(delay)
        delay = backoff(delay)
        attempt *= 2


def link_generation(nc: Client) -> int:
    """Counts the connection's reconnects: an ack awaited since an older one is lost."""
    return int(nc.stats["reconnects"])


class LinkLost(TxActorsError):
    """The connection dropped while a JetStream call was waiting for its answer."""


async def linked(nc: Client, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`await fn(*args)`, given up with `LinkLost` as soon as the connection drops.

    A request sent to a server that then died is never answered; without this, the caller
    waits out the request's whole timeout even after the server is back.
    """
    generation = link_generation(nc)

    async def watch(scope: anyio.CancelScope) -> None:
        # nats-py offers callbacks only at connect time, which belong to the application
        while nc.is_connected and link_generation(nc) == generation:  # noqa: ASYNC110
            await anyio.sleep(LINK_POLL)
        scope.cancel()

    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch, tasks.cancel_scope)
        try:
            outcome.append(await fn(*args))
        except Exception as error:  # raised below as itself, not wrapped in a group
            failure.append(error)
        tasks.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if outcome:
        return outcome[0]
    raise LinkLost("the connection to NATS dropped while waiting for JetStream")


async def wait_connected(nc: Client) -> None:
    while not nc.is_connected:
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        await anyio.sleep(LINK_POLL)


class AckInbox:
    """Acks of our writes, on a reply subject of our own.

    nats-py 2.16's `publish_async` loses JetStream's refusal of a write (its reply handler
    raises instead of failing the future), which would leave a refused batch waiting for an
    ack until `ACK_TIMEOUT`; here every answer settles its future: an ack, an `APIError`, or
    `NoStreamResponseError` when no stream took the subject.
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = nc.new_inbox()
        self._subscription: Subscription | None = None
        self._futures: dict[str, asyncio.Future[PubAck]] = {}
        self._tokens = itertools.count()

    async def publish(
        self, subject: str, payload: bytes, headers: dict[str, str]
    ) -> asyncio.Future[PubAck]:
        """Send the write now; the future settles with JetStream's answer."""
        if self._subscription is None:
            self._subscription = await self._nc.subscribe(f"{self._prefix}.*", cb=self._answered)
        token = str(next(self._tokens))
        future: asyncio.Future[PubAck] = asyncio.get_running_loop().create_future()
        self._futures[token] = future

        def forget(done: asyncio.Future[PubAck]) -> None:
            self._futures.pop(token, None)
            if not done.cancelled():
                # Retrieved here: the answer to a write given up on (its connection or batch
                # abandoned) is news to nobody, not "Future exception was never retrieved".
                done.exception()

        future.add_done_callback(forget)
        try:
            await self._nc.publish(
                subject, payload, reply=f"{self._prefix}.{token}", headers=headers
            )
        except BaseException:
            future.cancel()
            raise
        return future

    async def close(self) -> None:
        """Unsubscribe: a writer's inbox dies with its partition actor (a restarted actor
        makes new writers, and the old subscriptions would pile up on the connection)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error):
                await subscription.unsubscribe()

    async def _answered(self, msg: Msg) -> None:
        future = self._futures.get(msg.subject[len(self._prefix) + 1 :])
        if future is None or future.done():
            return
        if (msg.headers or {}).get(Header.STATUS) == NO_RESPONDERS:
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            answer = json.loads(msg.data)
            if "error" in answer:
                nats.js.errors.APIError.from_error(answer["error"])  # raises the typed error
            future.set_result(PubAck.from_response(answer))
        except Exception as error:  # the typed refusal, or an answer we cannot read
            future.set_exception(error)


class Troubled(TxActorsError):
    """An ack is lost or refused for now: give up every pending ack and issue again."""


def describe(error: BaseException) -> str:
    """One line naming the error, for logs and the quarantine header."""
    if isinstance(error, nats.js.errors.APIError):
        return f"{type(error).__name__} {error.code}/{error.err_code}: {error.description}"
    return f"{type(error).__name__}: {error}".rstrip(": ")
