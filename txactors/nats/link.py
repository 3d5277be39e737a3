"""Talking to JetStream over a connection that may drop: waiting, and being woken.

`LinkWatch` wakes whoever waits on a connection the moment it drops, comes back or closes, so
nothing polls it; `await_ack` waits for one write's ack, woken by the ack, by the connection
dropping or by its deadline (the last two give the write up); `linked` gives up a call as soon
as the connection drops instead of waiting out its timeout; `AckInbox` settles every answer to
our writes, refusals included.
The writers (`nats/writer.py`, `oplog.py`) and the check-backs build on these; what a failure
means and trying again is `txactors.nats.retry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header, PubAck

from txactors.errors import TxActorsError
from txactors.nats.client import TolerantClient
from txactors.nats.retry import LinkLost

T = TypeVar("T")

ACK_TIMEOUT = 5.0
"""An ack not back this long after its append, on a live connection, counts as lost."""
NO_RESPONDERS = "503"
_STATUS = Header.STATUS
"""Read per answer: `Header.X` goes through `EnumType.__getattr__`'s hook on Python 3.11."""


def link_generation(nc: Client) -> int:
    """Counts the connection's reconnects: an ack awaited since an older one is lost."""
    return int(nc.stats["reconnects"])


class LinkWatch:
    """Wakes every waiter on a connection when it drops, comes back or closes.

    nats-py tells only the callbacks given to `connect` (the application's); the watch
    chains itself after them, once per connection (`watch`), so the application's are still
    called, first. Waiters check the connection's state, then wait for `changed()`; nothing
    awaits between the two, so no change goes unnoticed.
    """

    def __init__(self, nc: Client) -> None:
        self._changed: asyncio.Future[None] | None = None
        nc._disconnected_cb = self._chained(nc._disconnected_cb)
        nc._reconnected_cb = self._chained(nc._reconnected_cb)
        nc._closed_cb = self._chained(nc._closed_cb)

    def changed(self) -> asyncio.Future[None]:
        """Settles at the connection's next change (shared: wait on it, never cancel it)."""
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        return self._changed

    def _chained(
        self, callback: Callable[[], Awaitable[None]] | None
    ) -> Callable[[], Awaitable[None]]:
        async def chained() -> None:
            try:
                if callback is not None:
                    await callback()
            finally:  # the application's callback failing must not leave a waiter asleep
                changed, self._changed = self._changed, None
                if changed is not None and not changed.done():
                    changed.set_result(None)

        return chained


_watches: weakref.WeakKeyDictionary[Client, LinkWatch] = weakref.WeakKeyDictionary()


def watch(nc: Client) -> LinkWatch:
    """The connection's one `LinkWatch`."""
    found = _watches.get(nc)
    if found is None:
        found = _watches[nc] = LinkWatch(nc)
    return found


async def until_changed(
    nc: Client, *futures: asyncio.Future[Any], timeout: float | None = None
) -> None:
    """Wait until one of `futures` settles, the connection changes, or `timeout` passes;
    cancelling the waiter cancels none of them. (`asyncio.wait` would do, at twice the cost:
    every write's ack is awaited here.)"""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    watched = (*futures, watch(nc).changed())
    for future in watched:
        future.add_done_callback(wake)
    timer = None if timeout is None else loop.call_later(timeout, wake)
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()
        for future in watched:
            future.remove_done_callback(wake)


class Ack(enum.Enum):
    SETTLED = "settled"
    LINK_LOST = "link lost"
    OVERDUE = "overdue"


async def await_ack(
    nc: Client, future: asyncio.Future[PubAck], generation: int, issued_at: float
) -> Ack:
    """Wait for the answer to a write issued at `issued_at` on connection `generation`:
    `SETTLED` once `future` is done (with an ack or an error), `LINK_LOST` as soon as the
    connection dropped since (the answer will never come), `OVERDUE` after `ACK_TIMEOUT`.

    The future itself is awaited, so its answer wakes the waiter in one loop turn (through
    `until_changed` it took two, on every write); the connection's change or the deadline
    wake it by cancelling the future: a write not answered is given up (both writers give
    it up then anyway). Cancelling the waiter cancels the future too."""
    if future.done():
        return Ack.SETTLED
    if not nc.is_connected or link_generation(nc) != generation:
        return Ack.LINK_LOST
    remaining = issued_at + ACK_TIMEOUT - time.monotonic()
    if remaining <= 0:
        return Ack.OVERDUE

    def give_up(_: object = None) -> None:
        future.cancel()

    timer = asyncio.get_running_loop().call_later(remaining, give_up)
    changed = watch(nc).changed()
    changed.add_done_callback(give_up)
    task = asyncio.current_task()
    assert task is not None
    cancelling = task.cancelling()
    try:
        await future
    except asyncio.CancelledError:
        if task.cancelling() > cancelling:
            raise  # the waiter is cancelled, not the write given up
    except Exception:  # a refusal: the writer reads it from the future
        pass
    finally:
        timer.cancel()
        changed.remove_done_callback(give_up)
    if not future.cancelled():
        return Ack.SETTLED
    if not nc.is_connected or link_generation(nc) != generation or changed.done():
        return Ack.LINK_LOST
    return Ack.OVERDUE


async def linked(nc: Client, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """`await fn(*args)`, given up with `LinkLost` as soon as the connection drops.

    A request sent to a server that then died is never answered; without this, the caller
    waits out the request's whole timeout even after the server is back.
    """
    generation = link_generation(nc)

    async def watch_link(scope: anyio.CancelScope) -> None:
        while nc.is_connected and link_generation(nc) == generation:
            await until_changed(nc)
        scope.cancel()

    outcome: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(watch_link, tasks.cancel_scope)
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
    """Return once the connection is up, woken by its coming back (it may be down now)."""
    while not nc.is_connected:
        if nc.is_closed:
            raise nats.errors.ConnectionClosedError
        await until_changed(nc)


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
            answers = f"{self._prefix}.*"
            if isinstance(self._nc, TolerantClient):  # settled in the read loop, a turn sooner
                self._subscription = await self._nc.subscribe_direct(
                    answers, self._settle, self._answered
                )
            else:
                self._subscription = await self._nc.subscribe(answers, cb=self._answered)
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
        self._settle(msg)

    def _settle(self, msg: Msg) -> bool:
        """Settle the future of the write `msg` answers (never raises: it may run in the
        client's read loop); True: every answer is taken."""
        future = self._futures.get(msg.subject[len(self._prefix) + 1 :])
        if future is None or future.done():
            return True
        if (msg.headers or {}).get(_STATUS) == NO_RESPONDERS:
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return True
        try:
            answer = msgspec.json.decode(msg.data)
            if "error" in answer:
                nats.js.errors.APIError.from_error(answer["error"])  # raises the typed error
            future.set_result(pub_ack(answer))
        except Exception as error:  # the typed refusal, or an answer we cannot read
            future.set_exception(error)
        return True


_PUB_ACK_FIELDS = tuple(field.name for field in dataclasses.fields(PubAck))


def pub_ack(answer: dict[str, Any]) -> PubAck:
    """`PubAck.from_response(answer)` at a third of its cost (it lists the dataclass's fields
    on every call), for the ack of every write; `batch` and `count` are its batch fields."""
    if "batch" in answer and "batch_id" not in answer:
        answer["batch_id"] = answer.pop("batch")
    if "count" in answer and "batch_size" not in answer:
        answer["batch_size"] = answer.pop("count")
    return PubAck(**{name: answer[name] for name in _PUB_ACK_FIELDS if name in answer})


class WriteNotAcked(TxActorsError):
    """An ack is lost or refused for now: give up every pending ack and issue again."""
