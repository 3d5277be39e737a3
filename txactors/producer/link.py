"""The producer's link to one coordinator partition: many transactions per request.

Per partition and verb (prepare, acknowledged end) at most `WINDOW` *rounds* of requests are
in flight. A call that finds none opens a round, which goes out as soon as the event-loop turn
the call was made in is over, with every call made in that turn: a lone caller waits for
nothing but the end of its own turn (its request reaches nats-py one loop turn later, not a
round trip), and nothing waits on a timer. One call alone goes as the single verb (`Prepare`,
`EndTransaction`). Calls made while a round is in flight queue; when it completes, everything
queued opens the next round, joined by the calls made in the turn of the answer (the callers
it woke, calling again): one `PrepareBatch` / `EndBatch`, split only where a request would
carry more than `max_items` or not fit the server's `max_payload`. A busy link so carries as
many transactions per message as arrived during one round trip, and a burst of calls (the
callers of one answer moving on together) goes as one request, not as its first call alone
and the rest a round trip later. One-way ends issued in one event-loop turn go as one
publish (`OnewayLink`).

Each item's answer goes to its caller; a failure of the whole request (no answer in time,
nobody serving the subject, a batch-level `Error`, a publish that failed) to every caller in
it, raised as a single request's would be. Each caller's timeout counts from its own call.
A caller that gives up (cancelled, timed out) while its item is queued takes the item out:
it is never sent; after it was sent, its answer is dropped, and once every caller of a
request gave up, that request no longer holds the window.

A caller may ask for its item to go again (`resend_after`) when no answer came that soon, far
sooner than its timeout: a request or its reply is lost with the connection of the
coordinator it was on its way to (a node killed, cut off), and waiting out the timeout would
hold the caller seconds after the coordinator reconnected. The copy goes at once, alone and
outside the rounds (the window may be held by the very request that was lost); the caller
takes the first answer of either, except an answer that says only that the other one arrived
(`keep_waiting_on`: a prepare's `conflict`), after which it waits on for the other's answer
until its own deadline. Only idempotent items are sent again.

A command refused whole for what it is executed nothing, so its items go again alone: a
coordinator that does not serve batches (`unknown_command`) or protocol version 3
(`unsupported_version`) gets single verbs, in the version it speaks (`Dialect`, shared by the
partition's links), until `RELEARN_AFTER` seconds later one request tries the newest form
again (a rolling upgrade may have replaced that coordinator); a batch refused `bad_request`
(more items, or longer answers, than that coordinator takes in one) is sent alone that once.
A batch never carries more than the coordinator's bound on its answer admits: each item's
answer is counted by the rule the coordinator counts it by (wire/answers.py), and the
request's `REQUEST_HEADROOM` leaves more than the reply's (`REPLY_HEADROOM`) plus the batch
answer's own bytes.
The bookkeeping is pure and apart: `Coalescer`, `chunks`, `answers` (batching.py), `Dialect`
(dialect.py), the verbs' encodings (verbs.py); `CallTimeouts` (timeouts.py) fails callers at
their deadlines on one timer, `Inbox` (inbox.py) takes the replies. `PartitionLink` and
`OnewayLink` carry it out on NATS.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, Final, Generic, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import Header

from txactors.errors import ActorDeadError, AskTimeout, CommandError
from txactors.nats.client import notice_trouble
from txactors.nats.link import NO_RESPONDERS
from txactors.observe.logs import get_logger
from txactors.producer.batching import Coalescer, answers, chunks
from txactors.producer.dialect import Dialect
from txactors.producer.inbox import Inbox
from txactors.producer.timeouts import CallTimeouts
from txactors.producer.verbs import EndVerb, Verb
from txactors.wire.protocol import (
    PROTOCOL_VERSION,
    Ended,
    EndItem,
    Error,
    Prepared,
    PrepareItem,
    encoding_of,
)

log = get_logger(__name__)

DEFAULT_MAX_ITEMS: Final = 256
"""Items per batch request, at most."""
REQUEST_HEADROOM: Final = 1024
"""Bytes of `max_payload` a request leaves unused: NATS refuses a larger one outright."""
I = TypeVar("I", bound=PrepareItem | EndItem)  # noqa: E741
R = TypeVar("R", Prepared, Ended)


class _Waiter(Generic[I]):
    """One caller's item, and where its answer goes."""

    __slots__ = (
        "copy",
        "deadline",
        "future",
        "held",
        "item",
        "keep_waiting_on",
        "released",
        "request",
    )

    def __init__(self, item: I, future: asyncio.Future[Any]) -> None:
        self.item: I = item
        self.future = future
        self.request: _Request | None = None
        """The request that carries it, once sent."""
        self.released = False
        """Nobody waits for its request's answer any more (`_release`, once)."""
        self.deadline = 0.0
        self.keep_waiting_on: frozenset[str] = frozenset()
        """Error codes that, once a copy went, say only that the other request arrived: the
        caller waits for the other's answer."""
        self.copy: _Waiter[I] | None = None
        """The copy sent again (`_resend`), once sent."""
        self.held: BaseException | None = None
        """Its own answer held back while the copy's may still come (`keep_waiting_on`)."""


class _Round:
    """The requests sent for one round; it ends when all are answered or given up."""

    __slots__ = ("pending", "sealed")

    def __init__(self) -> None:
        self.pending = 0
        self.sealed = False
        """Every request of the round is issued: a round ends only after that."""


class _Request:
    __slots__ = ("batch", "done", "link", "live", "probe", "round", "token", "version", "waiters")

    def __init__(
        self,
        link: PartitionLink[Any, Any],
        waiters: Sequence[_Waiter[Any]],
        round_: _Round | None,
        version: int,
        probe: bool,
    ) -> None:
        self.link = link
        self.waiters = waiters
        self.round = round_
        self.batch = len(waiters) > 1
        self.version = version
        self.probe = probe
        """It tries the newest form again (`Dialect.probe`)."""
        self.live = len(waiters)
        """Callers still waiting for it: none left, it holds the window no longer."""
        self.done = False
        self.token = ""

    async def answered(self, msg: Msg) -> None:
        """`msg` is its reply (`Inbox`)."""
        await self.link.answered(self, msg)


class _Link(Generic[I]):
    """What both kinds of link do: cut what goes to one subject into requests."""

    def __init__(
        self, nc: Client, subject: str, verb: Verb[I], dialect: Dialect, max_items: int
    ) -> None:
        self.subject = subject
        self._nc = nc
        self._verb: Verb[I] = verb
        self._dialect = dialect
        self._max_items = max_items
        self._tasks: set[asyncio.Task[None]] = set()

    def _requests(
        self, waiters: Sequence[_Waiter[I]], batches: bool, version: int
    ) -> list[tuple[Sequence[_Waiter[I]], bytes]]:
        """`waiters` as requests in `version` with their payloads: batches (`chunks`), or one
        each (one alone is its own request whatever its size: nothing to count)."""
        if not batches or len(waiters) == 1:
            return [([waiter], self._encode([waiter], version)) for waiter in waiters]
        limit = self._nc.max_payload - REQUEST_HEADROOM
        size = self._verb.answer_size

        def encoded(part: Sequence[_Waiter[I]]) -> bytes:
            return self._encode(part, version)

        return chunks(waiters, self._max_items, encoded, limit, lambda w: size(w.item))

    def _encode(self, waiters: Sequence[_Waiter[I]], version: int) -> bytes:
        return self._verb.encode([w.item for w in waiters], version)


class PartitionLink(_Link[I], Generic[I, R]):
    """Requests of one verb to one partition, coalesced while a round is in flight."""

    def __init__(
        self,
        nc: Client,
        subject: str,
        verb: Verb[I],
        inbox: Inbox,
        dialect: Dialect,
        *,
        max_items: int = DEFAULT_MAX_ITEMS,
    ) -> None:
        super().__init__(nc, subject, verb, dialect, max_items)
        self._inbox = inbox
        self._coalescer: Coalescer[_Waiter[I]] = Coalescer()
        self._deadlines: CallTimeouts[_Waiter[I]] = CallTimeouts(self._expire)
        self._resends: CallTimeouts[_Waiter[I]] = CallTimeouts(self._resend)

    async def ask(
        self,
        item: I,
        timeout: float,
        *,
        resend_after: float | None = None,
        keep_waiting_on: frozenset[str] = frozenset(),
    ) -> R:
        """`item`'s answer; raises `CommandError` for its `Error`, `AskTimeout` when none came
        within `timeout` of this call, `ActorDeadError` when nobody serves the subject, or the
        client's error when the request could not be sent. With `resend_after`, an item not
        answered by then goes again (see the module docstring): only for idempotent items."""
        loop = asyncio.get_running_loop()
        waiter: _Waiter[I] = _Waiter(item, loop.create_future())
        deadline = loop.time() + timeout
        if not (self._dialect.batches or self._dialect.probe_due()):
            try:
                async with asyncio.timeout_at(deadline):  # the publish is awaited here too
                    await self._alone(waiter)
                    alone: R = await waiter.future
            except TimeoutError:
                self._abandon(waiter)
                notice_trouble(self._nc)
                raise AskTimeout(f"{self.subject} did not answer within {timeout}s") from None
            except BaseException:
                self._abandon(waiter)
                raise
            return alone
        # Nothing but the future is awaited: the link's timer failing it at its deadline is
        # the whole timeout (`CallTimeouts`: no scope, and no timer of its own, per call). It is
        # awaited directly (not through `wait_for`, which wakes the caller a turn later): a
        # caller its answer woke calls again in time to join the round that answer opened.
        self._deadlines.add(loop, deadline, waiter, timeout)
        if resend_after is not None and resend_after < timeout:
            waiter.deadline, waiter.keep_waiting_on = deadline, keep_waiting_on
            self._resends.add(loop, loop.time() + resend_after, waiter, resend_after)
        try:
            if self._coalescer.submit(waiter):
                self._open_if(True)
            reply: R = await waiter.future
        except BaseException:
            self._abandon(waiter)
            raise
        return reply

    def _expire(self, waiter: _Waiter[I], timeout: float) -> None:
        """`waiter`'s time is up: its caller gets `AskTimeout` (and gives it up); for the
        client's watch, a sign that its server may reach no coordinator."""
        notice_trouble(self._nc)
        waiter.future.set_exception(AskTimeout(f"{self.subject} did not answer within {timeout}s"))

    def _resend(self, waiter: _Waiter[I], after: float) -> None:
        """No answer to `waiter` within `after` seconds: its item goes again, alone."""
        loop = waiter.future.get_loop()
        copy: _Waiter[I] = _Waiter(waiter.item, loop.create_future())
        self._deadlines.add(loop, waiter.deadline, copy, waiter.deadline - loop.time())
        log.info("request_sent_again", subject=self.subject, after=round(after, 3))

        def settled(answer: asyncio.Future[Any]) -> None:
            """The copy's answer, if it is the item's: a result, or the coordinator's refusal
            of the item itself. Not what only says the copy went nowhere (no answer, nobody
            serving, not sent) or was not taken now (`retry_after`), nor `keep_waiting_on`:
            the first one may still have been received, and its own answer or deadline
            decides."""
            if answer.cancelled() or waiter.future.done():
                return
            error = answer.exception()
            if error is None:
                waiter.future.set_result(answer.result())
            elif isinstance(error, CommandError) and error.code in waiter.keep_waiting_on:
                if waiter.held is None:
                    return  # the first one arrived: its answer decides
                waiter.future.set_exception(waiter.held)  # each says the other came: neither
            elif isinstance(error, CommandError) and error.retry_after is None:
                waiter.future.set_exception(error)
            else:
                return
            self._release(waiter)  # its own request, maybe lost, must not hold the window

        def first_settled(_: asyncio.Future[Any]) -> None:
            if not copy.future.done():
                self._abandon(copy)

        copy.future.add_done_callback(settled)
        waiter.future.add_done_callback(first_settled)
        waiter.copy = copy
        version = self._dialect.version
        _spawn(self._tasks, self._issue([copy], None, self._encode([copy], version), version))

    async def answered(self, request: _Request, msg: Msg) -> None:
        """`msg` answers `request`: settle its callers, and open a round of what queued
        meanwhile (the callers it woke may join it)."""
        reply = self._decode(msg)
        if isinstance(reply, Error) and self._dialect.refused(
            reply.code, batch=request.batch, version=request.version, probe=request.probe
        ):
            log.warning(
                "batch_sent_again_alone" if self._dialect.batches else "coordinator_speaks_older",
                subject=self.subject,
                code=reply.code,
                reason=reply.message,
                items=len(request.waiters),
                batches=self._dialect.batches,
                version=self._dialect.version,
            )
            opened = self._finish(request)
            for waiter in request.waiters:  # nothing was executed: the same, alone
                if not waiter.future.done():
                    await self._alone(waiter)
        else:
            batch = self._verb.batch_reply if request.batch else None
            if not isinstance(reply, ActorDeadError):  # nobody heard it: nothing learnt
                served = batch is not None and isinstance(reply, batch)
                self._dialect.answered(batch=served, probe=request.probe)
            opened = self._settle(request, answers(reply, len(request.waiters), batch))
        self._open_if(opened)

    def _decode(self, msg: Msg) -> object:
        if (msg.headers or {}).get(Header.STATUS) == NO_RESPONDERS:
            return ActorDeadError(f"no actor is serving {self.subject!r}")
        encoding = encoding_of(msg.headers)
        if isinstance(encoding, Error):
            return Error(encoding.code, f"unreadable reply: {encoding.message}")
        return self._verb.replies.decode(msg.data, encoding)

    def _open_if(self, opened: bool) -> None:
        """A round was opened: send it once this event-loop turn is over, with the calls made
        meanwhile (a task of its own: nothing waits for it)."""
        if opened:
            _spawn(self._tasks, self._send_opened())

    async def _send_opened(self) -> None:
        """Send the round opened (callers who gave up meanwhile left out). A failure to send
        it reaches each of its callers, as it would have reached a call sending alone."""
        round_ = _Round()
        waiters = self._coalescer.opened()
        try:
            live = [waiter for waiter in waiters if not waiter.future.done()]
            if live and self._dialect.probe():  # its first request tries the newest form
                [(part, payload), *_] = self._requests(live, True, PROTOCOL_VERSION)
                await self._issue(part, round_, payload, PROTOCOL_VERSION, probe=True)
                live = live[len(part) :]
            dialect = self._dialect
            for part, payload in self._requests(live, dialect.batches, dialect.version):
                await self._issue(part, round_, payload, dialect.version)
        except Exception as error:
            _hand_out(waiters, answers(error, len(waiters), None))
        finally:  # also when cut off: an empty round must not hold the window
            round_.sealed = True
            if round_.pending == 0:
                self._open_if(self._coalescer.finished())

    async def _alone(self, waiter: _Waiter[I]) -> None:
        """Send `waiter` alone, at once, in the version the dialect speaks."""
        version = self._dialect.version
        await self._issue([waiter], None, self._encode([waiter], version), version)

    async def _issue(
        self,
        waiters: Sequence[_Waiter[I]],
        round_: _Round | None,
        payload: bytes,
        version: int,
        *,
        probe: bool = False,
    ) -> None:
        """Send one request carrying `waiters` in `version`, as part of `round_` (None:
        outside rounds)."""
        if not self._inbox.opened:
            await self._inbox.open()
        request = _Request(self, waiters, round_, version, probe)
        for waiter in waiters:
            waiter.request = request
        if round_ is not None:
            round_.pending += 1
        reply = self._inbox.register(request)
        try:
            await self._nc.publish(self.subject, payload, reply=reply)
        except Exception as error:  # not sent: each caller gets the client's error
            self._inbox.forget(request)
            # Its round is not sealed yet (or it has none): this cannot end a round.
            self._settle(request, answers(error, len(waiters), None))

    def _settle(self, request: _Request, outcomes: Sequence[object]) -> bool:
        """Hand each caller its outcome; True when this ended a round and opened the next."""
        _hand_out(request.waiters, outcomes)
        return self._finish(request)

    def _finish(self, request: _Request) -> bool:
        request.done = True
        round_ = request.round
        if round_ is None:
            return False
        round_.pending -= 1
        if round_.pending or not round_.sealed:
            return False
        return self._coalescer.finished()

    def _abandon(self, waiter: _Waiter[I]) -> None:
        """Its caller gave up: a queued item is never sent; a request nobody waits for any
        more stops holding the window."""
        waiter.future.cancel()
        self._release(waiter)

    def _release(self, waiter: _Waiter[I]) -> None:
        """Nobody waits for `waiter`'s answer any more (given up, or answered by a copy)."""
        if waiter.released:
            return
        waiter.released = True
        request = waiter.request
        if request is None:
            self._coalescer.withdraw(waiter)
            return
        if request.done:
            return
        request.live -= 1
        if request.live == 0:
            self._inbox.forget(request)
            self._open_if(self._finish(request))


class OnewayLink(_Link[EndItem]):
    """One-way ends to one partition: the ends issued in one event-loop turn go as one
    publish (one end alone: a plain `EndTransaction`), once the partition's coordinator is
    known to serve batches (`Dialect.served`); singles until then."""

    def __init__(
        self, nc: Client, subject: str, dialect: Dialect, *, max_items: int = DEFAULT_MAX_ITEMS
    ) -> None:
        super().__init__(nc, subject, EndVerb(), dialect, max_items)
        self._queue: list[_Waiter[EndItem]] = []

    async def tell(self, item: EndItem) -> None:
        """Publish `item` with the others of this turn; returns once handed to the client,
        raising the client's error when the publish failed. Cancelled before, it is not sent."""
        waiter = _Waiter(item, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        if len(self._queue) == 1:  # the first of this turn: the flush runs in the next
            _spawn(self._tasks, self._flush())
        await waiter.future

    async def _flush(self) -> None:
        waiters = [waiter for waiter in self._queue if not waiter.future.done()]
        self._queue = []
        # A one-way batch is refused whole, unanswered, just as an acknowledged one would be.
        batches = self._dialect.batches and self._dialect.served
        for part, payload in self._requests(waiters, batches, self._dialect.version):
            try:
                await self._nc.publish(self.subject, payload)
            except Exception as error:
                _hand_out(part, answers(error, len(part), None))
            else:
                _hand_out(part, [None for _ in part])


def _hand_out(waiters: Sequence[_Waiter[Any]], outcomes: Sequence[object]) -> None:
    """Each waiter its outcome (a result or an exception), but for those who gave up, and
    but an answer that says only that its copy arrived first (the copy's answer decides)."""
    for waiter, outcome in zip(waiters, outcomes, strict=True):
        if waiter.future.done():
            continue
        if (
            waiter.copy is not None
            and not waiter.copy.future.done()
            and getattr(outcome, "code", None) in waiter.keep_waiting_on
            and isinstance(outcome, BaseException)
        ):
            waiter.held = outcome
            continue
        if isinstance(outcome, BaseException):
            waiter.future.set_exception(outcome)
        else:
            waiter.future.set_result(outcome)


def _spawn(tasks: set[asyncio.Task[None]], work: Coroutine[Any, Any, None]) -> None:
    """Run `work` as a task of its own, held until done (the loop keeps only weak ones)."""
    task = asyncio.get_running_loop().create_task(work)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
