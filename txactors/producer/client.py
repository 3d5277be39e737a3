"""The producer's two requests to the coordinator, and what each failure means.

The two requests fail differently, and the whole producer rests on that difference:
- a failed *prepare* leaves nothing to undo: the caller gets `PrepareFailed` and its local
  transaction must not run;
- a failed *end* is normal operation in a distributed system: the local transaction has
  already happened, the decision is kept in memory and the check-back settles the
  transaction later. Only a refusal (`conflict`, `forbidden`, ...) is raised, because it
  means the coordinator's outcome differs from the local one.

An end is acknowledged (a request: the caller learns the state reached, or the refusal) or
one-way (a publish without a reply subject, RocketMQ's `endTransactionOneway`: no round
trip, and no answer either way). A one-way end's decision is kept in memory like an
unconfirmed one, so a check-back for an end that was lost or refused is answered from it.

A prepare the coordinator refused with a `retry_after` hint (it cannot write now) stored
nothing, so it is sent again, up to `prepare_retries` times, each after waiting at least
the hint (plus jitter, so producers refused together do not come back together). Once they
are spent, `PrepareFailed.retry_after` carries the last hint to the caller. A prepare nobody
received (no responders: a partition between two owners, as while coordinators rebalance or
take over) stored nothing either, and is sent again the same way after about a second; so
is an acknowledged end nobody received (`END_RESENDS` times), rather than left to the
check-back.

Which partition a txid goes to depends on the coordinators' partition count, read where they
publish it the first time a transaction needs it (txactors/nats/partition_count.py). The
requests to one partition issued while another is in flight travel together, and what each
caller gets is what a request of its own would have given it (txactors/producer/link.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable

import anyio
import nats.errors
from nats.aio.client import Client

from txactors.errors import ActorDeadError, AskTimeout, CommandError, EndRefused, PrepareFailed
from txactors.nats.partition_count import PartitionCount, PartitionCountUnknown
from txactors.observe import tracing
from txactors.observe.logs import get_logger
from txactors.producer.dialect import Dialect
from txactors.producer.failed_sends import FailedSends
from txactors.producer.inbox import Inbox
from txactors.producer.inflight import InFlight
from txactors.producer.link import DEFAULT_MAX_ITEMS, OnewayLink, PartitionLink
from txactors.producer.outcomes import UnconfirmedOutcomes
from txactors.producer.resend import ResendTimer
from txactors.producer.sticky import StickyPartitions, random_txid, txid_in
from txactors.producer.verbs import EndVerb, PrepareVerb
from txactors.wire.layout import end_subject, partition_of, prepare_subject
from txactors.wire.protocol import (
    Decision,
    Ended,
    EndItem,
    ErrorCode,
    OutgoingMessage,
    Prepared,
    PrepareItem,
)

log = get_logger(__name__)

#: Failures after which the coordinator may or may not have acted: nobody answered in time.
_UNREACHABLE = (AskTimeout, ActorDeadError, nats.errors.Error, OSError)

#: Error codes that say the coordinator may not have applied the end; retrying (or the
#: check-back) can still settle it. Every other code is a definite refusal.
_RETRYABLE_CODES = frozenset({ErrorCode.INTERNAL, ErrorCode.TIMEOUT})

_FIRST_ARRIVED = frozenset({ErrorCode.CONFLICT})
"""A first prepare sent again is refused so when the first one arrived."""

END_RESENDS = 2
"""Times an acknowledged end that nobody received (a partition between two owners) is sent
again, each after about `NO_COORDINATOR_RETRY_AFTER`, before it is left to the check-back
(which would settle it only after the transaction timeout and a check)."""

NO_COORDINATOR_RETRY_AFTER = 1.0
"""The hint on a prepare nobody served (no coordinator holds the partition right now): about
what a failover takes to start serving it again."""

Sleep = Callable[[float], Awaitable[None]]


class _Links:
    """The links to one partition, which share what its coordinator speaks."""

    __slots__ = ("end", "oneway", "prepare")

    def __init__(
        self,
        nc: Client,
        partition: int,
        group: str,
        verb: PrepareVerb,
        inbox: Inbox,
        most: int,
        clock: Callable[[], float],
    ) -> None:
        dialect = Dialect(clock=clock)
        prepares, ends = prepare_subject(partition, group), end_subject(partition, group)
        self.prepare: PartitionLink[PrepareItem, Prepared] = PartitionLink(
            nc, prepares, verb, inbox, dialect, max_items=most
        )
        self.end: PartitionLink[EndItem, Ended] = PartitionLink(
            nc, ends, EndVerb(), inbox, dialect, max_items=most
        )
        self.oneway = OnewayLink(nc, ends, dialect, max_items=most)


class CoordinatorClient:
    """Prepare and end requests for one producer instance, routed by partition; the requests
    to one partition travel together when several are issued at once (`producer/link.py`)."""

    def __init__(
        self,
        nc: Client,
        *,
        group: str,
        instance: str,
        partitions: PartitionCount,
        request_timeout: float,
        outcomes: UnconfirmedOutcomes,
        in_flight: InFlight,
        failed_sends: FailedSends,
        prepare_retries: int = 0,
        sleep: Sleep = anyio.sleep,
        max_items: int = DEFAULT_MAX_ITEMS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.group = group
        self.instance = instance
        self.outcomes = outcomes
        self.in_flight = in_flight
        self.failed_sends = failed_sends
        self.tracer = tracing.RecentTracer()
        """The tracer of this producer's transaction spans (None: tracing is off)."""
        self._nc = nc
        self._partitions = partitions
        self._timeout = request_timeout
        self._prepare_retries = prepare_retries
        self._sleep = sleep
        self._max_items = max_items
        self._clock = clock
        """What the links' dialects time their relearning by (`Dialect`)."""
        self._resend = ResendTimer()
        self._verb = PrepareVerb(group, instance)
        self._inbox = Inbox(nc)
        self._count = 0
        """The partition count, once read (0: not yet); kept for good (`PartitionCount`)."""
        self._links: dict[int, _Links] = {}
        """The links of the partitions used so far: one each, made on first use."""
        self._sticky: StickyPartitions | None = None

    async def close(self) -> None:
        """Stop taking replies: the producer is done."""
        await self._inbox.close()

    def new_txid(self) -> str:
        """A txid for a new transaction, in the partition this producer fills now
        (`sticky.py`); before the partition count is known, any txid."""
        if self._sticky is None:
            return random_txid()
        return txid_in(self._sticky.next(), self._sticky.partitions)

    async def _pause(self, hint: float, event: str, **fields: object) -> None:
        """Wait at least `hint` seconds before sending again, plus jitter (so producers
        turned away together do not come back together), logged as `event`."""
        wait = hint * (1 + random.random() / 5)
        log.warning(event, retry_after=hint, wait=wait, **fields)
        await self._sleep(wait)

    def _avoid(self, partition: int) -> None:
        """New transactions leave `partition`, which just failed a prepare (`sticky.py`)."""
        if self._sticky is not None:
            self._sticky.avoid(partition)

    async def _route(self, txid: str) -> int:
        """The partition of `txid`; the count is read the first time (PartitionCountUnknown
        while no coordinator has published one, PartitionCountMismatch against an override).
        Once it is known, the callers compute it themselves (no coroutine per request)."""
        if not self._count:
            count = await self._partitions.get()
            if not self._count:  # the first of the calls that waited for the count
                self._count = count
                # Made with the count, so that a first transaction (any txid) failing its
                # prepare already moves the next ones elsewhere (`_avoid`).
                self._sticky = StickyPartitions(count, self._max_items)
        return partition_of(txid, self._count)

    def _link(self, partition: int) -> _Links:
        """The links of `partition`, made the first time it is used: a producer filling one
        partition at a time (`sticky.py`) never pays for the others."""
        links = self._links.get(partition)
        if links is None:
            links = self._links[partition] = _Links(
                self._nc,
                partition,
                self.group,
                self._verb,
                self._inbox,
                self._max_items,
                self._clock,
            )
        return links

    async def prepare(
        self, txid: str, messages: list[OutgoingMessage], token: str | None
    ) -> Prepared:
        """Store halves; raises `PrepareFailed` unless the coordinator confirmed them."""
        try:
            partition = partition_of(txid, self._count) if self._count else await self._route(txid)
        except PartitionCountUnknown as error:  # no coordinator yet: nothing was sent
            log.warning("prepare_unrouted", error=str(error))
            raise PrepareFailed(
                f"the prepare of {txid} was not sent: {error}",
                txid=txid,
                retry_after=NO_COORDINATOR_RETRY_AFTER,
            ) from error
        item = PrepareItem(txid=txid, messages=messages, token=token)
        retries = self._prepare_retries
        # The first prepare of a transaction may go again: a second one is refused `conflict`
        # if the first arrived (then its own answer counts). A later one would store twice.
        resend_after = self._resend.after(self._timeout) if token is None else None
        while True:
            try:
                sent = time.monotonic()
                reply: Prepared = await self._link(partition).prepare.ask(
                    item, self._timeout, resend_after=resend_after, keep_waiting_on=_FIRST_ARRIVED
                )
                self._resend.observe(time.monotonic() - sent, resend_after)
            except CommandError as error:
                if error.retry_after is not None or error.code == ErrorCode.TIMEOUT:
                    self._avoid(partition)  # slow or stalled: new transactions go elsewhere
                if error.retry_after is not None and retries > 0:
                    retries -= 1
                    await self._pause(error.retry_after, "prepare_retry", code=error.code)
                    continue
                log.warning("prepare_refused", code=error.code, reason=error.message)
                raise PrepareFailed(
                    f"the coordinator refused the prepare of {txid}: {error}",
                    txid=txid,
                    code=error.code,
                    retry_after=error.retry_after,
                ) from error
            except _UNREACHABLE as error:
                self._avoid(partition)
                nobody = isinstance(error, ActorDeadError)  # nothing was stored: come back
                if nobody and retries > 0:  # a partition between two owners, for about this
                    retries -= 1
                    await self._pause(
                        NO_COORDINATOR_RETRY_AFTER,
                        "prepare_retry",
                        code="no_responders",
                        partition=partition,
                    )
                    continue
                log.warning("prepare_unreachable", partition=partition, error=repr(error))
                raise PrepareFailed(
                    f"the coordinator of partition {partition} did not confirm the prepare of "
                    f"{txid} ({error!r}); is it running? Halves may have been stored: the "
                    "check-back will roll them back",
                    txid=txid,
                    retry_after=NO_COORDINATOR_RETRY_AFTER if nobody else None,
                ) from error
            return reply

    async def end(self, txid: str, token: str, decision: Decision) -> Ended | None:
        """Send the end; None when it was not confirmed (the decision is then remembered
        for the check-back). Raises `EndRefused` when the coordinator said no."""
        partition = partition_of(txid, self._count) if self._count else await self._route(txid)
        item = EndItem(txid=txid, token=token, decision=decision)
        resends = END_RESENDS
        while True:
            try:
                sent, resend_after = time.monotonic(), self._resend.after(self._timeout)
                reply: Ended = await self._link(partition).end.ask(
                    item, self._timeout, resend_after=resend_after
                )
                self._resend.observe(time.monotonic() - sent, resend_after)
            except CommandError as error:
                if error.retry_after is not None and resends > 0:  # not handled: nothing done
                    resends -= 1
                    self.outcomes.remember(txid, decision)  # should the wait be cut short
                    await self._pause(error.retry_after, "end_retry", code=error.code)
                    continue
                if error.code not in _RETRYABLE_CODES:
                    log.error(
                        "end_refused", decision=decision, code=error.code, reason=error.message
                    )
                    raise EndRefused(
                        f"the coordinator refused to {decision} {txid}: {error}",
                        txid=txid,
                        code=error.code,
                    ) from error
                failure: Exception = error
            except _UNREACHABLE as error:
                if isinstance(error, ActorDeadError) and resends > 0:  # nobody received it
                    resends -= 1
                    self.outcomes.remember(txid, decision)  # should the wait be cut short
                    await self._pause(
                        NO_COORDINATOR_RETRY_AFTER,
                        "end_retry",
                        code="no_responders",
                        partition=partition,
                    )
                    continue
                failure = error
            else:
                self.outcomes.forget(txid)
                return reply
            break
        self.outcomes.remember(txid, decision)
        log.warning(
            "end_unconfirmed",
            decision=decision,
            partition=partition,
            error=repr(failure),
            hint="the coordinator's check-back will settle this transaction",
        )
        return None

    async def end_oneway(self, txid: str, token: str, decision: Decision) -> None:
        """Publish the end without waiting for (or getting) an answer. The decision is
        remembered first, so the check-back of an end that never arrives is answered."""
        partition = partition_of(txid, self._count) if self._count else await self._route(txid)
        self.outcomes.remember(txid, decision)
        try:
            await self._link(partition).oneway.tell(
                EndItem(txid=txid, token=token, decision=decision)
            )
        except _UNREACHABLE as error:
            log.warning(
                "end_unconfirmed",
                decision=decision,
                partition=partition,
                error=repr(error),
                hint="the coordinator's check-back will settle this transaction",
            )
