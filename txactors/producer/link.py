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

`Coalescer`, `chunks`, `answers` and `Dialect` are the bookkeeping, without I/O;
`PartitionLink`, `OnewayLink` and `Inbox` carry it out on NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar, Final, Generic, Protocol, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import Header

from txactors.errors import ActorDeadError, AskTimeout, CommandError
from txactors.nats.client import notice_trouble
from txactors.nats.link import NO_RESPONDERS
from txactors.observe.logs import get_logger
from txactors.wire.answers import item_answer_bytes
from txactors.wire.protocol import (
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    Codec,
    EndBatch,
    Ended,
    EndedBatch,
    EndItem,
    EndTransaction,
    Error,
    ErrorCode,
    Prepare,
    PrepareBatch,
    Prepared,
    PreparedBatch,
    PrepareItem,
    encode,
    encoding_of,
)

log = get_logger(__name__)

WINDOW: Final = 1
"""Rounds in flight per partition and verb. One: the coordinator group-commits what one
round brings, and what arrives meanwhile makes the next round bigger instead of another
request (and another write) of its own. Two measured no faster at 64 in flight, with more
CPU per transaction (docs/benchmarks.md)."""
DEFAULT_MAX_ITEMS: Final = 256
"""Items per batch request, at most."""
REQUEST_HEADROOM: Final = 1024
"""Bytes of `max_payload` a request leaves unused: NATS refuses a larger one outright."""
RELEARN_AFTER: Final = 60.0
"""Seconds a partition's coordinator is spoken to in the older form it asked for before the
newest form is tried again (a rolling upgrade may have replaced it meanwhile)."""
W = TypeVar("W")
I = TypeVar("I", bound=PrepareItem | EndItem)  # noqa: E741
R = TypeVar("R", Prepared, Ended)
Item = TypeVar("Item", contravariant=True)


# -- the bookkeeping ----------------------------------------------------------------------------


class Coalescer(Generic[W]):
    """Which calls of one partition and verb go in the round being opened, which wait in the
    queue for a round to end, and when a round opens.

    A round opened (`submit` or `finished` says so) is taken with `opened` once the
    event-loop turn is over: calls made meanwhile join it."""

    __slots__ = ("_opening", "_queue", "_rounds", "window")

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self._queue: deque[W] = deque()
        self._opening: list[W] | None = None
        """The round opened and not yet taken: calls join it."""
        self._rounds = 0

    def __len__(self) -> int:
        """Calls queued for a round to end."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Rounds opened and not finished."""
        return self._rounds

    def submit(self, item: W) -> bool:
        """True: `item` opens a round (take it with `opened` once this turn is over); False: it
        joins the round being opened, or waits in the queue."""
        if self._opening is not None:
            self._opening.append(item)
            return False
        if self._rounds < self.window:
            self._rounds += 1
            self._opening = [item]
            return True
        self._queue.append(item)
        return False

    def opened(self) -> list[W]:
        """The round opened, with every call that joined it: in flight from now on. Empty
        when each of them was withdrawn (it still counts until `finished`)."""
        round_, self._opening = self._opening or [], None
        return round_

    def withdraw(self, item: W) -> bool:
        """Take out a call not yet taken for a request (its caller gave up); False when it was."""
        if self._opening is not None and item in self._opening:
            self._opening.remove(item)
            return True
        try:
            self._queue.remove(item)
        except ValueError:
            return False
        return True

    def finished(self) -> bool:
        """A round ended. True: the calls queued meanwhile open the next round (take it with
        `opened` once this turn is over); False: none were queued, or they joined a round
        being opened already (a wider window)."""
        self._rounds -= 1
        if not self._queue:
            return False
        queued = list(self._queue)
        self._queue.clear()
        if self._opening is not None:
            self._opening.extend(queued)
            return False
        self._rounds += 1
        self._opening = queued
        return True


def chunks(
    items: Sequence[W],
    max_items: int,
    encode: Callable[[Sequence[W]], bytes],
    limit: int,
    answer_size: Callable[[W], int],
) -> list[tuple[Sequence[W], bytes]]:
    """`items`, in order, as requests with their payloads: at most `max_items` each, whose
    answers (`answer_size` each, at their longest) and encoding (`encode`) fit in `limit`
    bytes; a request too large is halved until it fits. One item stays alone whatever its
    size: NATS or the coordinator refuses it as it would refuse it sent alone."""
    requests: list[tuple[Sequence[W], bytes]] = []
    start, answers = 0, 0
    for end, item in enumerate(items):
        size = answer_size(item)
        if end > start and (end - start == max_items or answers + size > limit):
            _fit(items[start:end], encode, limit, requests)
            start, answers = end, 0
        answers += size
    if start < len(items):
        _fit(items[start:], encode, limit, requests)
    return requests


def _fit(
    items: Sequence[W],
    encode: Callable[[Sequence[W]], bytes],
    limit: int,
    requests: list[tuple[Sequence[W], bytes]],
) -> None:
    payload = encode(items)
    if len(payload) <= limit or len(items) == 1:
        requests.append((items, payload))
        return
    half = len(items) // 2
    _fit(items[:half], encode, limit, requests)
    _fit(items[half:], encode, limit, requests)


def answers(reply: object, count: int, batch: type[Any] | None) -> list[object]:
    """What each of a request's `count` items gets: its reply, or the exception to raise.

    `reply` is the decoded reply (or the exception every item gets); `batch` the batch reply
    type when the request was a batch, None when it was a single verb."""
    if isinstance(reply, BaseException):
        return [copy.copy(reply) for _ in range(count)]
    if isinstance(reply, Error):
        return [_refusal(reply) for _ in range(count)]
    results = reply.results if isinstance(reply, PreparedBatch | EndedBatch) else None
    if batch is not None and isinstance(reply, batch) and len(results or ()) == count:
        return [_refusal(r) if isinstance(r, Error) else r for r in results or ()]
    if batch is None and count == 1 and results is None:
        return [reply]
    shape = type(reply).__name__ if results is None else f"{len(results)} results"
    problem = f"the coordinator answered {count} items with {shape}"
    return [CommandError(ErrorCode.INTERNAL, problem) for _ in range(count)]


def _refusal(error: Error) -> CommandError:
    return CommandError(error.code, error.message, error.retry_after)


class Dialect:
    """What one partition's coordinator speaks, learnt from its answers: batches and protocol
    version 3 until it refuses them (an older coordinator); shared by the partition's links.

    A downgrade is not forever: a rolling upgrade replaces the old coordinator with a new one.
    `RELEARN_AFTER` seconds (on `clock`) after a refusal, one request (`probe`) tries the newest
    form again: refused, the dialect stays downgraded for another interval (the refused items go
    again alone, nothing of them executed); answered, the newest form is spoken again. A probe
    never answered (lost, timed out) is tried again an interval later.

    A one-way end has no answer to learn from, and an older coordinator would drop a batch of
    them unseen: one-way ends go as a batch only once a batch was answered (`served`) since
    the last downgrade."""

    __slots__ = ("_clock", "_relearn_after", "_retry_at", "batches", "served", "version")

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, relearn_after: float = RELEARN_AFTER
    ) -> None:
        self.batches = True
        self.served = False
        self.version = PROTOCOL_VERSION
        self._clock = clock
        self._relearn_after = relearn_after
        self._retry_at: float | None = None
        """Downgraded: when the newest form may be tried again."""

    def probe_due(self) -> bool:
        """Downgraded, and the newest form may be tried again: the next request may probe."""
        return self._retry_at is not None and self._clock() >= self._retry_at

    def probe(self) -> bool:
        """True when the caller's next request is to try the newest form (batches, version 3):
        one probe per interval, so one at a time."""
        if self._retry_at is None:  # the usual case, without reading the clock
            return False
        now = self._clock()
        if now < self._retry_at:
            return False
        self._retry_at = now + self._relearn_after
        return True

    def refused(self, code: str, *, batch: bool, version: int, probe: bool = False) -> bool:
        """A command (a batch or not, in `version`; the `probe` or not) was refused whole with
        `code`. True when nothing of it was executed and its items are to go again alone, as
        this dialect says from now on: an older coordinator's refusal of the version or of
        batches, or a batch refused `bad_request` (more items, or longer answers, than that
        coordinator takes in one; alone, each item gets its own answer: a probe so refused
        was understood, the newest form is spoken)."""
        if code == ErrorCode.UNSUPPORTED_VERSION and version > OLDEST_VERSION:
            self._downgrade(OLDEST_VERSION)
            return True
        if code == ErrorCode.UNKNOWN_COMMAND and batch:
            self._downgrade(self.version)
            return True
        if code == ErrorCode.BAD_REQUEST and batch:
            self.answered(batch=False, probe=probe)
            return True
        return False

    def answered(self, *, batch: bool, probe: bool) -> None:
        """A command was answered, not refused for its form (`batch`: a batch, with a batch's
        answer). An answered probe: the coordinator speaks the newest form again."""
        if probe:
            self.batches, self.version, self._retry_at = True, PROTOCOL_VERSION, None
        if batch and self._retry_at is None:
            self.served = True

    def _downgrade(self, version: int) -> None:
        self.batches, self.version, self.served = False, version, False
        self._retry_at = self._clock() + self._relearn_after


# -- the verbs ----------------------------------------------------------------------------------


class Verb(Protocol[Item]):
    """How items of one kind travel: alone as the single verb, together as its batch."""

    replies: ClassVar[Codec[Any]]
    batch_reply: ClassVar[type[Any]]

    def encode(self, items: Sequence[Item], version: int) -> bytes: ...

    def answer_size(self, item: Item) -> int:
        """The bytes of the item's answer in a batch reply, at most."""
        ...


class PrepareVerb:
    """Prepares of one producer instance: `Prepare` alone, `PrepareBatch` together."""

    replies: ClassVar[Codec[Any]] = Codec(Prepared | PreparedBatch | Error)
    batch_reply: ClassVar[type[Any]] = PreparedBatch

    __slots__ = ("group", "producer")

    def __init__(self, group: str, producer: str) -> None:
        self.group = group
        self.producer = producer

    answer_size = staticmethod(item_answer_bytes)  # no frame of its own per item

    def encode(self, items: Sequence[PrepareItem], version: int) -> bytes:
        if len(items) == 1:
            [item] = items
            return encode(
                Prepare(
                    txid=item.txid,
                    group=self.group,
                    producer=self.producer,
                    messages=item.messages,
                    token=item.token,
                    version=version,
                )
            )
        return encode(
            PrepareBatch(
                group=self.group, producer=self.producer, items=list(items), version=version
            )
        )


class EndVerb:
    """Ends: `EndTransaction` alone, `EndBatch` together."""

    replies: ClassVar[Codec[Any]] = Codec(Ended | EndedBatch | Error)
    batch_reply: ClassVar[type[Any]] = EndedBatch

    __slots__ = ()

    answer_size = staticmethod(item_answer_bytes)  # no frame of its own per item

    def encode(self, items: Sequence[EndItem], version: int) -> bytes:
        if len(items) == 1:
            [item] = items
            return encode(
                EndTransaction(
                    txid=item.txid, token=item.token, decision=item.decision, version=version
                )
            )
        return encode(EndBatch(items=list(items), version=version))


# -- on NATS ------------------------------------------------------------------------------------


class _Waiter(Generic[I]):
    """One caller's item, and where its answer goes."""

    __slots__ = ("future", "item", "request")

    def __init__(self, item: I, future: asyncio.Future[Any]) -> None:
        self.item: I = item
        self.future = future
        self.request: _Request | None = None
        """The request that carries it, once sent."""


class Deadlines:
    """The deadlines of one link's callers, on one timer: each caller still fails at its own
    deadline (`expire`, unless answered or gone by then), but arms and cancels no timer of
    its own (a `call_at` and its cancel cost more than the rest of a call's bookkeeping).

    The timer is armed for the earliest deadline; when it fires, what is due expires and it
    is armed again for the next. Callers answered stay until they reach the front (timeouts
    are alike, so that is soon): whoever adds a deadline drops them there."""

    __slots__ = ("_at", "_expire", "_heap", "_order", "_timer")

    def __init__(self, expire: Callable[[_Waiter[Any], float], None]) -> None:
        self._expire = expire
        self._heap: list[tuple[float, int, _Waiter[Any], float]] = []
        """(deadline, order of the call, waiter, its timeout): the earliest first."""
        self._order = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0
        """When the timer fires (while there is one)."""

    def __len__(self) -> int:
        """Callers not yet dropped (some may be answered already)."""
        return len(self._heap)

    def add(
        self, loop: asyncio.AbstractEventLoop, deadline: float, waiter: _Waiter[Any], timeout: float
    ) -> None:
        """`waiter` fails at `deadline` (of `loop.time()`) unless its future is done by then."""
        heap = self._heap
        while heap and heap[0][2].future.done():
            heapq.heappop(heap)
        heapq.heappush(heap, (deadline, next(self._order), waiter, timeout))
        if self._timer is None or deadline < self._at:
            if self._timer is not None:  # a shorter timeout than those before it
                self._timer.cancel()
            self._arm(loop, deadline)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._at = when
        self._timer = loop.call_at(when, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        heap, due = self._heap, max(self._at, loop.time())  # fired late: all that is overdue
        while heap:
            deadline, _, waiter, timeout = heap[0]
            if not waiter.future.done():
                if deadline > due:
                    self._arm(loop, deadline)
                    return
                self._expire(waiter, timeout)
            heapq.heappop(heap)


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


class Inbox:
    """The replies to one producer's requests, on one subscription of its own: each reply
    settles its request, with no task or timer per request."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._subscription: Subscription | None = None
        self._opening = asyncio.Lock()
        self._requests: dict[str, _Request] = {}
        self._tokens = itertools.count()

    @property
    def opened(self) -> bool:
        """Subscribed (and not closed since)."""
        return self._subscription is not None

    async def open(self) -> None:
        """Subscribe, the first time."""
        if self._subscription is not None:
            return
        async with self._opening:
            if self._subscription is None:
                prefix = self._nc.new_inbox()
                self._subscription = await self._nc.subscribe(f"{prefix}.*", cb=self._answered)
                self._prefix = prefix

    def register(self, request: _Request) -> str:
        """The reply subject for `request`, which its reply will settle."""
        request.token = str(next(self._tokens))
        self._requests[request.token] = request
        return f"{self._prefix}.{request.token}"

    def forget(self, request: _Request) -> None:
        self._requests.pop(request.token, None)

    async def close(self) -> None:
        """Unsubscribe (a request still out is then answered nowhere: its callers time out)."""
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            with contextlib.suppress(nats.errors.Error):  # a closed connection has none left
                await subscription.unsubscribe()

    async def _answered(self, msg: Msg) -> None:
        request = self._requests.pop(msg.subject[len(self._prefix) + 1 :], None)
        if request is not None:
            await request.link.answered(request, msg)


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
        self._deadlines = Deadlines(self._expire)

    async def ask(self, item: I, timeout: float) -> R:
        """`item`'s answer; raises `CommandError` for its `Error`, `AskTimeout` when none came
        within `timeout` of this call, `ActorDeadError` when nobody serves the subject, or the
        client's error when the request could not be sent."""
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
        # the whole timeout (`Deadlines`: no scope, and no timer of its own, per call). It is
        # awaited directly (not through `wait_for`, which wakes the caller a turn later): a
        # caller its answer woke calls again in time to join the round that answer opened.
        self._deadlines.add(loop, deadline, waiter, timeout)
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
    """Each waiter its outcome (a result or an exception), but for those who gave up."""
    for waiter, outcome in zip(waiters, outcomes, strict=True):
        if waiter.future.done():
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
