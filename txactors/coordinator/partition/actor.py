"""The partition actor: inputs become table events, the table's actions go to the writers.

It owns one partition's `TransactionTable`. Requests (prepare, end, admin) arrive in its
mailbox, pass the validation `Boundary` and become events (a batch of prepares or ends is
split into one request per item first, batches.py, and its prepares' halves are stored as
one pack, `store.pack_appends`); the actions of each step are handed on at once and never
awaited: op records to `OpLog`, publishes to `Publisher`, answers to `Answers`, check-backs
and the next deadline to the partition's `Checker` actor.

A step (`_step`: `table.handle_batch`, then handing on its actions) never waits, so it is
atomic on the event loop, and the writers feed their completions (`HalvesStored`,
`OpPersisted`, `Published`: the table's own events) straight into a step instead of through the
mailbox. Mailbox hops per committed transaction: **two**, the prepare request and the end
request (two per batch of them); every write's completion is a direct step. The writers are the
process's, shared by its partitions (`coordinator/writers.py`): a completion that raises fails
this instance, never the shared writer. The checker is another actor: its messages (`Due`,
`Checked`) come through the mailbox, off the commit path, tagged with the epoch of the instance
that started it, so a restarted instance (fresh table, fresh checker) ignores what its
predecessor's checker said. Writes outlive their instance (the shared writers go on, though
what its op log still queued is dropped when it ends), so each completion carries the epoch of
the instance that submitted it and is dropped once that instance has ended (and a failure of
one of its tasks is dropped by the actor cell), so a restarted instance never trips over its
predecessor's writes.

Faults stay local: each topic and the discards have writers apart from the halves' (a
topic's outage holds up only its own commits, see `publisher.py`), JetStream's transient
errors in recovery and checkpoints are retried with backoff, and while the halves cannot be
written a prepare is answered at once with a retry-after hint instead of queueing behind them.
After recovery, `LateHalves` (late.py) reads on in TXN_HALF; a half this instance did not
write is fed to the table like a recovered one (a direct step too).
An event the table refuses as impossible (a bug) changes nothing there: it is logged, its
request answered with an internal error, and the partition keeps serving.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.kv import KeyValue

from txactors.actors import Actor, ActorSystem, LocalActorRef, Request, Supervisor
from txactors.coordinator.boundary import HEADER_RESERVE, Boundary, ends_of, prepares_of
from txactors.coordinator.core import tokens
from txactors.coordinator.core.effects import (
    Acknowledge,
    Action,
    Discard,
    PersistOp,
    Publish,
    Refuse,
    SendCheck,
)
from txactors.coordinator.core.errors import CoordinatorStateError
from txactors.coordinator.core.events import (
    End,
    Event,
    HalvesRefused,
    HalvesStored,
    OperatorDecided,
    OpPersisted,
    Published,
)
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.core.transactions import Checkpoint
from txactors.coordinator.options import Clock, CoordinatorOptions, OnDiscard
from txactors.coordinator.partition.answers import Answers
from txactors.coordinator.partition.audit import audited
from txactors.coordinator.partition.batches import item_requests
from txactors.coordinator.partition.checker import Checked, Checker, CheckWork, Due
from txactors.coordinator.partition.checkpoints import load_checkpoint, save_checkpoint
from txactors.coordinator.partition.discard import discard, quarantine
from txactors.coordinator.partition.halves import StoredHalf, by_transaction, halves_stored
from txactors.coordinator.partition.late import LateHalves
from txactors.coordinator.partition.listing import info, select
from txactors.coordinator.partition.oneway import OneWayErrors
from txactors.coordinator.partition.oplog import OpLog
from txactors.coordinator.partition.packs import pack_appends
from txactors.coordinator.partition.prepares import PreparesInFlight
from txactors.coordinator.partition.publisher import Publisher
from txactors.coordinator.partition.recovery import recover, take_fence
from txactors.coordinator.partition.streams import ensure_partition_streams
from txactors.coordinator.partition.upgrade import LegacyLog
from txactors.coordinator.writers import SharedWriters
from txactors.errors import ActorError, MailboxFull
from txactors.faults import FaultPoint, crash_if_armed
from txactors.nats.link import link_generation, wait_connected
from txactors.nats.retry import RETRY_MAX, describe, retry_transient
from txactors.nats.writer import Append, PartitionWriter
from txactors.observe import tracing
from txactors.observe.logs import get_logger
from txactors.observe.metrics import CoordinatorMetrics
from txactors.wire import layout
from txactors.wire.protocol import (
    EndBatch,
    Ended,
    EndedBatch,
    EndTransaction,
    Error,
    ErrorCode,
    ListTransactions,
    OperatorDecision,
    Prepare,
    PrepareBatch,
    Prepared,
    PreparedBatch,
    ShowTransaction,
    TransactionList,
)
from txactors.wire.rules import CoordinatorConfig

log = get_logger(__name__)

_epochs = itertools.count(1)

CHECKER_MAILBOX = 4096
ANSWER_ON_STOP = 0.25
"""Seconds an instance that stops may spend answering what it took on: a stop by signal has a
second in all (`cli/coordinator.py` STOP_GRACE)."""
STALL_GRACE = 0.5
"""Seconds the log's writes may be in trouble before the first prepares waiting for them are
answered `timeout`: a transient answer (409/10158, a lost ack) is retried within this by the
writer (its backoff starts at 50 ms), a leader lost is not."""
MIN_RETRY_AFTER = 0.5
"""Seconds a producer is told to wait at least before retrying a prepare refused for now."""


class PartitionCoordinator(Actor):
    answers_later = True  # asks arrive as `Request` handles, answered once the table decides

    def __init__(
        self,
        *,
        system: ActorSystem,
        nc: Client,
        js: JetStreamContext,
        checkpoints: KeyValue,
        partition: int,
        config: CoordinatorConfig,
        options: CoordinatorOptions,
        writers: SharedWriters,
        legacy: LegacyLog | None = None,
        clock: Clock = time.time,
        on_discard: OnDiscard | None = None,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.system = system
        self.nc = nc
        self.js = js
        self.checkpoints = checkpoints
        self.partition = partition
        self.options = options
        self.clock = clock
        self.on_discard = on_discard
        self.metrics = metrics
        self.table = TransactionTable(config)
        self._writers = writers
        self._legacy = legacy
        self._own = writers.of(partition)
        self._streams = layout.LogStreams.of(partition)
        self.boundary = Boundary(
            partition=partition,
            partitions=options.partitions,
            max_messages=options.max_messages_per_prepare,
            max_immunity=config.max_immunity,
            max_batch_items=options.max_batch_items,
            group_topics={g: tuple(ps) for g, ps in options.group_topics.items()},
        )
        self._epoch = next(_epochs)
        self._answers = Answers(partition, metrics)
        self._one_way = OneWayErrors(
            partition, on_error=metrics.oneway(partition) if metrics else None
        )
        self._prepares = PreparesInFlight()
        self._waiting: set[_Preparing] = set()
        """Prepares whose halves were submitted and are not written yet."""
        self._halves = PartitionWriter(self._own.halves, self._quarantine, self._failed)
        self._discards = PartitionWriter(writers.discards, self._quarantine, self._failed)
        self._publisher = Publisher(
            nc,
            js,
            lambda topic: PartitionWriter(writers.topic(topic), self._quarantine, self._failed),
            partition,
            options,
            clock,
            self._quarantine,
            functools.partial(self._on_published, self._epoch),
        )
        self._ended = False
        """Set when this instance is retired: completions of its writes are stale from then."""
        self.stale_completions = 0
        self._oplog: OpLog | None = None
        self._late: LateHalves | None = None
        self._checker: LocalActorRef | None = None
        self._sends: list[SendCheck] = []
        self._told: float | None = None
        """The deadline the checker was last told (None: none, or it reported it due)."""

    # -- lifecycle --------------------------------------------------------------------------

    async def on_start(self) -> None:
        started = time.perf_counter()
        await ensure_partition_streams(
            self.js,
            self.partition,
            half_retention=self.table.config.half_retention,
            replicas=self.options.replicas,
        )
        if self._legacy is not None:  # upgrading from the shared layout
            await self._legacy.carry_over(self.partition)
        checkpoint = await retry_transient(load_checkpoint, self.checkpoints, self.partition)
        recovered = await recover(
            self.js, self.table, self.partition, checkpoint, self._publisher.keep, self.clock()
        )
        if self.metrics is not None:
            self.metrics.track(self.partition, self.table)
        await self._own.ops.idle(self.partition)  # a predecessor's write has settled
        # Never past a record the table has not applied: what landed since recovery's read
        # (that write, a leaver's last one) is applied first.
        fence = await take_fence(
            self.js, self.table, self.partition, recovered.op_end, self.clock()
        )
        appended = functools.partial(self._ops_appended, self._epoch)
        self._oplog = self._own.ops.open(self.partition, fence.seq, appended, self._failed)
        log.info(
            "coordinator_recovered",
            partition=self.partition,
            halves_read=recovered.halves,
            op_messages_read=recovered.ops + fence.ops,
            op_messages_after_read=fence.ops,
            open=len(self.table),
            seconds=round(time.perf_counter() - started, 3),
        )
        self._publisher.forget_finished(self.table)
        late = functools.partial(self._late_half, self._epoch)
        end = self._own.half_end
        self._late = LateHalves(self.js, self.partition, recovered.half_end, late, end=end)
        self.start_task(self._save_checkpoints)
        self._checker = await self.system.spawn(
            self._new_checker,
            name=f"checker-{self.partition}",
            mailbox_size=CHECKER_MAILBOX,
            supervisor=Supervisor(max_restarts=5, within=60.0, backoff_initial=0.5),
        )
        self._apply(self.table.finish_recovery(self.clock()))
        self.start_task(self._late.run)  # what it finds is live input: after recovery
        self.start_task(self._give_up_waiting)
        await self._answers.flush()

    def _new_checker(self) -> Checker:
        return Checker(
            nc=self.nc,
            js=self.js,
            partition=self.partition,
            owner=self.ref,
            epoch=self._epoch,
            clock=self.clock,
            tick_interval=self.options.tick_interval,
            metrics=self.metrics,
        )

    async def on_stop(self) -> None:
        self._ended = True
        if self._oplog is not None:
            self._oplog.close()  # a lease lost: nothing more may reach TXN_OP from here
        checker, self._checker = self._checker, None  # writers finishing meanwhile tell nobody
        if checker is not None:
            await checker.stop()
        await self._answer_unfinished()

    async def _answer_unfinished(self) -> None:
        """This instance ends (its partition handed over, its lease lost, a restart) with
        requests it took on and did not finish: answer them `timeout` now (what they asked
        for may or may not be done: a prepare's halves may land, an end's record may be
        written) rather than leave their callers to their own timeouts. A producer goes on
        elsewhere; the check-back settles the rest. (Requests still in the mailbox were not
        taken on: the actor's cell tells their callers to come back, `NotHandled`.)"""
        problem = (
            f"partition {self.partition} stopped serving here (handed over, or its lease "
            "lost) before this was done; it may be done or not"
        )
        error = Error(ErrorCode.TIMEOUT, problem)
        for p in self._waiting:
            if not p.answered:
                p.answered = True
                self._answers.send(p.request, error)
        self._waiting.clear()
        self._answers.give_up(error)
        with anyio.CancelScope(shield=True), anyio.move_on_after(ANSWER_ON_STOP):
            await self._answers.flush()  # a connection gone meanwhile must not hold the stop

    async def _save_checkpoints(self) -> None:
        """Best effort: a checkpoint that cannot be saved now is saved at the next interval.
        One equal to the last saved is not saved again (an idle partition writes nothing)."""
        saved: Checkpoint | None = None
        while True:
            await anyio.sleep(self.options.checkpoint_interval)
            self._publisher.forget_finished(self.table)
            checkpoint = self.table.checkpoint()
            if self._late is not None:
                checkpoint = self._late.hold(checkpoint)
            if checkpoint == saved:
                continue
            try:
                await save_checkpoint(self.checkpoints, self.partition, checkpoint)
            except Exception as error:
                log.warning("checkpoint_not_saved", partition=self.partition, error=describe(error))
            else:
                saved = checkpoint

    # -- the mailbox ------------------------------------------------------------------------

    async def receive(self, message: Any) -> None:
        match message:
            case Request():
                message = self._one_way.wrap(message)  # no reply subject: errors counted, not sent
                if self._admitted(message):
                    await self._carry_out(message)
            case Due(epoch=epoch) | Checked(epoch=epoch) if epoch != self._epoch:
                log.info("stale_checker_message_ignored", message=type(message).__name__)
            case Due():
                self._told = None  # the checker forgot it; whatever is next must be told
                self._apply(self._tick())
                await self._flush_checker()
            case Checked(event=event):
                self._step(event)
                await self._flush_checker()
            case _:
                raise ActorError(f"coordinator got an unexpected {type(message).__name__}")
        await self._answers.flush()

    async def _carry_out(self, request: Request) -> None:
        command = request.message
        if isinstance(command, PrepareBatch):
            await self._prepare(self._items(request, prepares_of(command), PreparedBatch))
        elif isinstance(command, EndBatch):
            self._end(self._items(request, ends_of(command), EndedBatch))
        elif isinstance(command, Prepare):
            await self._prepare([request])
        elif isinstance(command, EndTransaction):
            self._end([request])
        else:
            await self._admin(audited(request, self.partition))

    def _admitted(self, request: Request) -> bool:
        """Whether the request passes the boundary; if not, its refusal is queued."""
        refusal = self.boundary.refusal(
            request.message,
            max_payload=self.nc.max_payload,
            subject=request.subject,
            group_of=self.table.group_of,
        )
        if refusal is None:
            return True
        if request.reply is not None:  # a one-way request's are logged rate-limited
            log.info("request_refused", partition=self.partition, reason=refusal.message)
        self._answers.send(request, refusal)
        return False

    def _items(
        self,
        batch: Request,
        commands: Sequence[Any],
        wrap: type[PreparedBatch] | type[EndedBatch],
    ) -> list[Request]:
        """The requests of a batch's items that pass the boundary, each as a lone one
        would (the others are answered with their refusal)."""
        if self.metrics is not None:
            verb = "prepare" if isinstance(batch.message, PrepareBatch) else "end"
            self.metrics.batch_items.labels(str(self.partition), verb).observe(len(commands))
        requests = item_requests(
            batch, commands, lambda results: wrap(results=results), self._one_way
        )
        return [request for request in requests if self._admitted(request)]

    def _end(self, requests: list[Request]) -> None:
        """The ends of `requests`, in one step and in their order."""
        events: list[Event] = []
        for request in requests:
            end: EndTransaction = request.message
            request_id = self._answers.wait(request, functools.partial(_ended, end.txid))
            token = tokens.digest(end.token)
            events.append(
                End(txid=end.txid, token=token, decision=end.decision, request_id=request_id)
            )
        if events:
            self._step(*events)

    # -- steps ------------------------------------------------------------------------------

    def _step(self, *events: Event) -> None:
        self._apply(self._handle(events))

    def _handle(self, events: Sequence[Event]) -> list[Action]:
        """The table's actions for `events`. One it refuses as impossible (a bug) changed
        nothing: it is logged, its request answered with an internal error, and the events
        after it still apply, so that one bad event does not take the partition down."""
        rest = list(events)
        while True:
            try:
                return self.table.handle_batch(rest, self.clock())
            except CoordinatorStateError as error:
                failed = next(i for i, event in enumerate(rest) if event is error.event)
                self._refused(error, rest[failed])
                rest = rest[failed + 1 :]

    def _tick(self) -> list[Action]:
        """`table.tick`; a due transaction it cannot move (a bug) is logged and left as it
        was, and the due ones after it are moved at the next tick."""
        try:
            return self.table.tick(self.clock())
        except CoordinatorStateError as error:
            self._refused(error, None)
            return self._handle(())  # what the due transactions before it did

    def _refused(self, error: CoordinatorStateError, event: Event | None) -> None:
        log.error(
            "coordinator_event_refused",
            partition=self.partition,
            refused=type(event).__name__ if event is not None else "due",
            error=str(error),
        )
        if isinstance(event, _REQUESTS) and event.request_id is not None:
            message = f"the coordinator could not handle this request: {error}"
            refusal = Refuse(
                request_id=event.request_id,
                txid=event.txid,
                code=ErrorCode.INTERNAL,
                message=message,
            )
            self._answers.settle(refusal)

    def _apply(self, actions: list[Action]) -> None:
        """Hand each action on, in order, without waiting for any of them."""
        publishes: list[Publish] = []
        for action in actions:
            match action:  # the commonest first: each class pattern that fails costs a check
                case Acknowledge() | Refuse():
                    self._answers.settle(action)
                case Publish():
                    publishes.append(action)
                case PersistOp(op_id=op_id, records=records):
                    assert self._oplog is not None
                    self._oplog.append(op_id, records)
                    tracing.record_decisions(records, self._publisher.trace_context, self.partition)
                case SendCheck():
                    self._sends.append(action)
                case Discard():
                    half_stream = self._streams.half
                    self.start_task(
                        discard, self.js, self._discards, action, self.on_discard, half_stream
                    )
        for unkept in self._publisher.publish(publishes):
            self.start_task(self._publisher.publish_from_stream, unkept)
        work = self._checker_work()
        if work is not None and self._checker is not None:
            try:
                self._checker.tell_nowait(work)
            except MailboxFull:  # kept for the next step, which tells it again
                self._sends[:0] = work.sends
                self._told = None

    def _checker_work(self) -> CheckWork | None:
        """What the checker must hear: checks to send, or a deadline earlier than it knows."""
        deadline = self.table.next_deadline()
        if deadline is not None and (self._told is None or deadline < self._told):
            self._told = deadline
        elif not self._sends:
            return None
        work = CheckWork(sends=tuple(self._sends), deadline=self._told)
        self._sends.clear()
        return work

    async def _flush_checker(self) -> None:
        """Tell the checker, waiting for room, what a full mailbox kept back."""
        work = self._checker_work()
        if work is not None and self._checker is not None:
            await self._checker.tell(work)

    # -- completions of the writers (direct steps, see the module docstring) ---------------

    def _stale(self, epoch: int, what: str) -> bool:
        """Whether a completion comes from a write of an instance that has ended."""
        if epoch == self._epoch and not self._ended:
            return False
        self.stale_completions += 1
        log.debug("stale_completion_ignored", partition=self.partition, what=what, epoch=epoch)
        return True

    async def _ops_appended(self, epoch: int, op_ids: list[int], seq: int) -> None:
        if self._stale(epoch, "ops"):
            return
        events = [OpPersisted(op_id=op_id, seq=seq) for op_id in op_ids]
        actions = self._handle(events)
        if any(isinstance(a, Publish) for a in actions):
            crash_if_armed(FaultPoint.AFTER_COMMIT_RECORD)
        self._apply(actions)
        await self._answers.flush()

    async def _on_published(self, epoch: int, published: list[Published]) -> None:
        if self._stale(epoch, "published"):
            return
        self._step(*published)
        await self._answers.flush()

    async def _late_half(self, epoch: int, seq: int, halves: list[StoredHalf]) -> None:
        """Halves this instance did not write, found after recovery (`halves`: those of the
        TXN_HALF message at `seq`): taken as recovered ones, in one step (a transaction not
        known here is checked back; one decided here refuses them)."""
        if self._stale(epoch, "late half"):
            return
        # A transaction with halves in flight: our own write, whose ack is on its way.
        late = [h for h in halves if not self._prepares.in_flight(h.txid)]
        events = [halves_stored(run) for run in by_transaction(late)]
        for event in events:
            log.warning("late_half_found", partition=self.partition, txid=event.txid, seq=seq)
        if events:
            self._step(*events)
            await self._answers.flush()

    def _failed(self, error: Exception) -> None:
        """A completion from a shared writer raised, or TXN_OP fenced this partition out:
        this instance fails as if one of its tasks had (the supervisor decides; a fenced one
        stops), and the writer goes on serving the others."""
        if not self._ended:
            self.start_task(_reraise, error)

    async def _quarantine(self, append: Append, reason: str) -> None:
        self.table.counters.quarantined += 1
        await quarantine(
            self.js,
            partition=self.partition,
            subject=append.subject,
            headers=append.headers,
            body=append.payload,
            reason=reason,
        )

    # -- prepare ----------------------------------------------------------------------------

    async def _prepare(self, requests: list[Request]) -> None:
        """Admit each prepare (in order: a later one of the same transaction is admitted
        against the earlier ones), declare their topics, and hand the halves of all that
        are admitted to the writer in one job, in one step: one TXN_HALF message (a pack)
        carries them, a few if together they would outgrow the server's `max_payload`."""
        fresh = iter(tokens.new_tokens(sum(1 for r in requests if not r.message.token)))
        prepares = [_Preparing(request, fresh) for request in requests]
        topics = {m.topic for p in prepares for m in p.prepare.messages}
        if not self._publisher.declared(topics):
            prepares = [p for p in prepares if self._admissible(p)]
            if not prepares or self._halves_trouble(prepares):
                return
            topics = {m.topic for p in prepares for m in p.prepare.messages}
            rules = {
                t: self.boundary.prefix_rules(p.prepare.group, t)
                for p in prepares
                for t in {m.topic for m in p.prepare.messages}
            }
            undeclared = await self._publisher.declare(topics, rules)
            if undeclared is not None:
                error = Error(undeclared.code, undeclared.reason, undeclared.retry_after)
                for p in prepares:
                    self._answers.send(p.request, error)
                return
            # Checked again with no wait before the submit: a step may have run meanwhile.
        born = self.clock()
        admitted = [p for p in prepares if self._admissible(p, born=born)]
        if admitted and not self._halves_trouble(admitted):
            halves = [h for p in admitted for h in p.halves]
            max_bytes = self.nc.max_payload - HEADER_RESERVE
            packs = pack_appends(self.partition, halves, max_bytes)
            counts = [count for _, count in packs]
            stored = functools.partial(self._halves_appended, self._epoch, admitted, counts)
            self._halves.submit([append for append, _ in packs], stored)
            self._waiting.update(admitted)

    def _admissible(self, preparing: _Preparing, *, born: float | None = None) -> bool:
        """Whether the table (and the prepares in flight) admit it; if not, its refusal is
        queued. With `born`, an admitted one's halves are numbered, born then, and in flight
        from now."""
        prepare, digest = preparing.prepare, preparing.digest
        refusal = self._prepares.refusal(self.table, prepare, digest)
        if refusal is not None:
            self._answers.send(preparing.request, Error(*refusal))
            return False
        if born is not None and self._halves.trouble is None:
            preparing.halves = self._prepares.start(self.table, prepare, digest, born)
        return True

    async def _give_up_waiting(self) -> None:
        """Each time the log's writes run into trouble (its stream electing a leader, the
        connection lost), answer the first prepares of a transaction waiting for their halves
        with `timeout`: waiting, they would hold a worker for the whole outage; answered at
        once, their producers move on to another partition (`producer/sticky.py`). Unlike
        the retry-after `_halves_trouble` gives those arriving meanwhile, this says nothing
        of whether the halves were stored: they may still land (docs/protocol.md, "What to
        retry": start again under a new txid), and the check-back rolls such a transaction
        back, as after a prepare that timed out at the producer."""
        while True:
            await self._halves.troubled()
            if not await self._stall_outlasts_grace():
                continue  # a blip the writer's own retries got past
            waiting = [p for p in self._waiting if not p.answered and p.prepare.token is None]
            if waiting:
                problem = (
                    f"{self._streams.half} stopped answering ({self._halves.trouble}) before "
                    "the halves were confirmed; they may still be stored: start again under "
                    "a new txid"
                )
                for p in waiting:
                    p.answered = True
                    self._answers.send(p.request, Error(ErrorCode.TIMEOUT, problem))
                await self._answers.flush()
                log.info("prepares_told_to_come_back", partition=self.partition, count=len(waiting))
            await self._halves.cleared()

    async def _stall_outlasts_grace(self) -> bool:
        """True once the log's writes stay in trouble `STALL_GRACE` seconds on an unbroken
        connection; False if they go through again first. The time without a connection
        does not count: nothing could be answered meanwhile anyway, and once it is back the
        writer's own reissue usually gets through (a broker restarted, not a log stalled)."""
        while True:
            await wait_connected(self.nc)
            generation = link_generation(self.nc)
            with anyio.move_on_after(STALL_GRACE):
                await self._halves.cleared()
                return False
            if self.nc.is_connected and link_generation(self.nc) == generation:
                return True

    def _halves_trouble(self, prepares: list[_Preparing]) -> bool:
        """While TXN_HALF cannot be written, answer the prepares at once with a retry-after:
        queued, they would wait out the outage and the producer's timeout; told to come
        back, the producer neither wonders whether its halves were stored nor hammers."""
        if self._halves.trouble is None:
            return False
        problem = f"{self._streams.half} cannot be written now ({self._halves.trouble}); try again"
        retry_after = min(max(self._halves.retry_after, MIN_RETRY_AFTER), RETRY_MAX)
        for p in prepares:
            self._answers.send(p.request, Error(ErrorCode.INTERNAL, problem, retry_after))
        return True

    async def _halves_appended(
        self,
        epoch: int,
        prepares: list[_Preparing],
        counts: list[int],
        acks: list[PubAck | None],
    ) -> None:
        """The packs of `prepares`' halves are written (`counts`: halves in each pack, in
        order; an ack is None for a pack refused for good): each half has its pack's ack."""
        if self._stale(epoch, "halves"):
            return  # the producers' prepares time out; the check-back settles their halves
        self._waiting.difference_update(prepares)
        if self._late is not None:
            # Taken in by the table just below, their transactions get this floor there too.
            self._late.own((ack.seq for ack in acks if ack is not None), self.table.op_floor())
        half_acks = [ack for ack, count in zip(acks, counts, strict=True) for _ in range(count)]
        events: list[Event] = []
        offset = 0
        for p in prepares:
            own_acks = half_acks[offset : offset + len(p.halves)]
            offset += len(p.halves)
            stored, refused = self._prepares.finish(p.prepare, p.digest, p.halves, own_acks)
            if p.answered:  # its producer went on: the check-back settles what landed
                if stored:
                    for half in stored:
                        self._publisher.keep(half)
                    events.append(halves_stored(stored))
                if refused:
                    if events:
                        self._step(*events)
                        events.clear()
                    self._step(HalvesRefused(txid=p.prepare.txid, token=p.digest))
                continue
            if refused:
                if events:  # the table sees halves in TXN_HALF order
                    self._step(*events)
                    events.clear()
                self._halves_refused(p.request, p.prepare, p.digest, stored, refused)
                continue
            for half in stored:
                self._publisher.keep(half)
            prepared = Prepared(
                txid=p.prepare.txid, token=p.token, seqs=[s.half.seq for s in stored]
            )
            request_id = self._answers.wait(p.request, functools.partial(_given, prepared))
            events.append(halves_stored(stored, request_id))
        if events:
            self._step(*events)
        await self._answers.flush()

    def _halves_refused(
        self,
        request: Request,
        prepare: Prepare,
        digest: str,
        stored: list[StoredHalf],
        refused: list[str],
    ) -> None:
        """JetStream refused some halves for good: the prepare fails, and the table rolls
        back what did land of the transaction (`HalvesRefused`)."""
        txid = prepare.txid
        landed: list[Event] = [halves_stored(stored)] if stored else []
        self._step(*landed, HalvesRefused(txid=txid, token=digest))
        message = f"JetStream refused {'; '.join(refused)} of transaction {txid} (quarantined); "
        message += "the transaction is rolled back"
        self._answers.send(request, Error(ErrorCode.INTERNAL, message))

    # -- admin ------------------------------------------------------------------------------

    async def _admin(self, request: Request) -> None:
        """Operator commands; those that change a transaction log `operator_action`."""
        command = request.message
        match command:
            case ListTransactions():
                views, more = select(self.table.transactions(), command, self.clock())
                infos = [info(v) for v in views]
                await request.answer(TransactionList(transactions=infos, more=more))
            case ShowTransaction(txid=txid):
                view = self.table.show(txid)
                if view is None:
                    state = self.table.outcome(txid)
                    detail = f"it is {state}" if state else "not open here"
                    await request.answer(Error(ErrorCode.NOT_FOUND, f"{txid}: {detail}"))
                else:
                    await request.answer(info(view))
            case OperatorDecision():
                txid = command.txid
                request_id = self._answers.wait(request, lambda s: Ended(txid=txid, state=s))
                resolution = command.resolution
                self._step(OperatorDecided(txid=txid, resolution=resolution, request_id=request_id))
            case _:
                name = type(command).__name__
                problem = f"not an admin command: {name}"
                await request.answer(Error(ErrorCode.UNKNOWN_COMMAND, problem))


_REQUESTS = (HalvesStored, End, OperatorDecided)
"""The events that carry a request to answer."""


class _Preparing:
    """A prepare on its way to TXN_HALF: its request, token, and halves once admitted."""

    __slots__ = ("answered", "digest", "halves", "prepare", "request", "token")

    def __init__(self, request: Request, fresh: Iterator[str]) -> None:
        """`fresh`: new tokens, one taken if the prepare begins its transaction."""
        self.request = request
        self.prepare: Prepare = request.message
        self.token = self.prepare.token or next(fresh)
        self.digest = tokens.digest(self.token)
        self.halves: list[StoredHalf] = []
        self.answered = False
        """Told to come back while its halves were still being written (`_give_up_waiting`)."""


def _ended(txid: str, state: str) -> Ended:
    return Ended(txid=txid, state=state)


def _given(answer: Any, state: str) -> Any:
    """The answer known before the table acknowledges (a prepare's, once its halves count)."""
    return answer


async def _reraise(error: Exception) -> None:
    raise error
