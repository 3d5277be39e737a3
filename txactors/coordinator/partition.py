"""The coordinator actor of one partition: a thin loop around `TransactionTable`.

Requests (prepare, end, admin) and the completions of its own writes arrive as messages;
each is turned into events for the table, and the table's actions are carried out against
JetStream. Writes run beside the loop (`start_task` and the writers), never inside it, so
many transactions are in flight at once while the table sees one fact at a time.

Completions carry the `epoch` of the instance that started the work: after a supervisor
restart, the fresh instance (with a fresh table) ignores those still queued in the mailbox
instead of failing on facts about a table that no longer exists.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.kv import KeyValue

from txactors import layout, tracing
from txactors.actors import Actor, Request
from txactors.coordinator import tokens
from txactors.coordinator.audit import audited
from txactors.coordinator.checkback import ask_producer
from txactors.coordinator.config import CoordinatorConfig
from txactors.coordinator.core.effects import (
    Acknowledge,
    Action,
    Discard,
    PersistOp,
    Publish,
    Refuse,
    SendCheck,
)
from txactors.coordinator.core.events import (
    CheckAnswered,
    CheckFailed,
    CheckFailure,
    End,
    ForceCommit,
    ForceRollback,
    HalvesStored,
    OpPersisted,
    Published,
    Resume,
)
from txactors.coordinator.core.states import FINAL, TxnState
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.core.transactions import Checkpoint, TxnView
from txactors.coordinator.discard import discard, quarantine
from txactors.coordinator.listing import select
from txactors.coordinator.oneway import OneWayErrors
from txactors.coordinator.options import (
    Clock,
    CoordinatorOptions,
    OnDiscard,
)
from txactors.coordinator.recovery import last_op_seq, recover
from txactors.coordinator.streams import (
    StoredHalf,
    half_headers,
    load_checkpoint,
    read_half,
    read_raw_half,
    save_checkpoint,
)
from txactors.coordinator.validation import Boundary
from txactors.coordinator.writers import (
    LINK_TROUBLE,
    Append,
    LinkLost,
    OpLog,
    PipelinedWriter,
    describe,
    linked,
    retry_transient,
)
from txactors.errors import ConfigError
from txactors.faults import FaultPoint, crash_if_armed
from txactors.logs import get_logger
from txactors.metrics import CoordinatorMetrics
from txactors.protocol import (
    CommitTransaction,
    Decision,
    Ended,
    EndTransaction,
    Error,
    ErrorCode,
    ListTransactions,
    OutgoingMessage,
    Prepare,
    Prepared,
    ResumeTransaction,
    RollbackTransaction,
    ShowTransaction,
    TransactionInfo,
    TransactionList,
)
from txactors.topics import ensure_topic_stream

log = get_logger(__name__)

_epochs = itertools.count(1)

# -- messages the actor sends itself (each tagged with the sending instance's epoch) -------


@dataclass(frozen=True, slots=True)
class _HalvesAppended:
    epoch: int
    request_id: str
    txid: str
    token: str
    group: str
    producer: str
    begins: bool
    stored: tuple[StoredHalf, ...]
    refused: tuple[str, ...] = ()
    """Why JetStream refused some of the prepare's halves for good (they were quarantined)."""


@dataclass(frozen=True, slots=True)
class _OpsAppended:
    epoch: int
    op_ids: list[int]
    seq: int


@dataclass(frozen=True, slots=True)
class _TopicPublished:
    epoch: int
    txid: str
    index: int


@dataclass(frozen=True, slots=True)
class _CheckReturned:
    epoch: int
    txid: str
    check_id: int
    resolution: Decision | None
    failure: CheckFailure | None


_Completion = _HalvesAppended | _OpsAppended | _TopicPublished | _CheckReturned


class _Tick:
    __slots__ = ()


_TICK = _Tick()


@dataclass(slots=True)
class _Waiting:
    """A request whose answer waits for the table (and so for a durable write)."""

    request: Request | None
    """None: the coordinator's own request (a rollback of refused halves), nobody to answer."""
    reply: Callable[[TxnState], Any]
    since: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class _Bodies:
    """The messages of an open transaction, kept for publishing and check-backs."""

    group: str
    messages: dict[int, OutgoingMessage] = field(default_factory=dict)


class PartitionCoordinator(Actor):
    def __init__(
        self,
        *,
        nc: Client,
        js: JetStreamContext,
        checkpoints: KeyValue,
        partition: int,
        config: CoordinatorConfig,
        options: CoordinatorOptions,
        clock: Clock = time.time,
        on_discard: OnDiscard | None = None,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.checkpoints = checkpoints
        self.partition = partition
        self.options = options
        self.clock = clock
        self.on_discard = on_discard
        self.metrics = metrics
        self.table = TransactionTable(config)
        self.boundary = Boundary(
            partition=partition,
            partitions=options.partitions,
            max_messages=options.max_messages_per_prepare,
            max_immunity=config.max_immunity,
        )
        self._one_way = OneWayErrors(
            partition, on_error=metrics.oneway(partition) if metrics else None
        )
        self._checks_in_flight: set[str] = set()
        self._bodies: dict[str, _Bodies] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._request_ids = 0
        self._next_index: dict[str, tuple[str, int]] = {}  # txid -> (token digest, next index)
        self._topics: set[str] = set()
        self._epoch = next(_epochs)
        self._halves = PipelinedWriter(nc, js, self._quarantine)
        self._published = PipelinedWriter(nc, js, self._quarantine)
        self._oplog: OpLog | None = None
        self._last_checkpoint = 0.0

    # -- lifecycle --------------------------------------------------------------------------

    async def on_start(self) -> None:
        started = time.perf_counter()
        checkpoint = await load_checkpoint(self.checkpoints, self.partition)
        halves, ops = await recover(
            self.js, self.table, self.partition, checkpoint, self._remember, self.clock()
        )
        if self.metrics is not None:
            self.metrics.track(self.partition, self.table)
        fence = await last_op_seq(self.js, self.partition)
        self._oplog = OpLog(self.nc, self.js, self.partition, fence, self._ops_appended)
        log.info(
            "coordinator_recovered",
            partition=self.partition,
            halves_read=halves,
            op_messages_read=ops,
            open=len(self.table),
            seconds=round(time.perf_counter() - started, 3),
        )
        for txid in [t for t in self._bodies if self.table.show(t) is None]:
            del self._bodies[txid]
        self.start_task(self._halves.run)
        self.start_task(self._published.run)
        self.start_task(self._oplog.run)
        self.start_task(self._ticker)
        await self._carry_out(self.table.finish_recovery(self.clock()))

    def _remember(self, stored: StoredHalf) -> None:
        bodies = self._bodies.setdefault(stored.txid, _Bodies(stored.group))
        bodies.messages[stored.half.index] = stored.message

    async def _ticker(self) -> None:
        while True:
            await anyio.sleep(self.options.tick_interval)
            await self.ref.tell(_TICK)

    # -- the loop ---------------------------------------------------------------------------

    async def receive(self, message: Any) -> Any:
        if isinstance(message, _Completion) and message.epoch != self._epoch:
            log.info("stale_completion_ignored", completion=type(message).__name__)
            return
        if isinstance(message, Request):
            message = self._one_way.wrap(message)  # no reply subject: errors counted, not sent
            refusal = self.boundary.refusal(message.message, max_payload=self.nc.max_payload)
            if refusal is not None:
                if message.reply is not None:  # a one-way request's are logged rate-limited
                    log.info("request_refused", partition=self.partition, reason=refusal.message)
                await message.answer(refusal)
                return
        match message:
            case Request(message=Prepare() as prepare):
                await self._prepare(message, prepare)
            case Request(message=EndTransaction() as end):
                request_id = self._wait(message, lambda state: Ended(txid=end.txid, state=state))
                token = tokens.digest(end.token)
                await self._handle(
                    End(txid=end.txid, token=token, decision=end.decision, request_id=request_id)
                )
            case Request():
                await self._admin(message)
            case _HalvesAppended():
                await self._halves_appended(message)
            case _OpsAppended(op_ids=op_ids, seq=seq):
                for op_id in op_ids:
                    actions = self.table.handle(OpPersisted(op_id=op_id, seq=seq), self.clock())
                    if any(isinstance(a, Publish) for a in actions):
                        crash_if_armed(FaultPoint.AFTER_COMMIT_RECORD)
                    await self._carry_out(actions)
            case _TopicPublished(txid=txid, index=index):
                bodies = self._bodies.get(txid)
                if bodies is not None:
                    bodies.messages.pop(index, None)
                await self._handle(Published(txid=txid, index=index))
            case _CheckReturned(txid=txid, check_id=check_id, resolution=resolution):
                self._checks_in_flight.discard(txid)
                if resolution is not None:
                    await self._handle(
                        CheckAnswered(txid=txid, check_id=check_id, resolution=resolution)
                    )
                else:
                    reason = message.failure or CheckFailure.ERROR
                    await self._handle(CheckFailed(txid=txid, check_id=check_id, reason=reason))
            case _Tick():
                await self._tick()
            case _:
                raise TypeError(f"coordinator got an unexpected {type(message).__name__}")

    async def _handle(self, event: Any) -> None:
        await self._carry_out(self.table.handle(event, self.clock()))

    async def _tick(self) -> None:
        now = self.clock()
        await self._carry_out(self.table.tick(now))
        if now - self._last_checkpoint >= self.options.checkpoint_interval:
            self._last_checkpoint = now
            self._forget_finished()
            self.start_task(self._save_checkpoint, self.table.checkpoint())

    async def _save_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Best effort: a checkpoint that cannot be saved now is saved at the next interval."""
        try:
            await save_checkpoint(self.checkpoints, self.partition, checkpoint)
        except Exception as error:
            log.warning("checkpoint_not_saved", partition=self.partition, error=describe(error))

    def _forget_finished(self) -> None:
        """Drop kept bodies of transactions that ended without a publish (rolled back,
        answered by a check): O(kept), done at checkpoint time, not per message."""
        for txid in [t for t in self._bodies if self.table.outcome(t) in (None, *FINAL)]:
            del self._bodies[txid]

    # -- prepare ----------------------------------------------------------------------------

    async def _prepare(self, request: Request, prepare: Prepare) -> None:
        begins = prepare.token is None
        token = prepare.token or tokens.new_token()
        digest = tokens.digest(token)
        in_flight = self._next_index.get(prepare.txid)
        if in_flight is not None:
            kept_digest, first_index = in_flight
            if begins or not tokens.same(kept_digest, digest):
                await request.answer(Error(*self.table.token_refusal(prepare.txid, begins=begins)))
                return
        else:
            refusal = self.table.refuse_prepare(prepare.txid, digest, prepare.group, begins=begins)
            if refusal is not None:
                await request.answer(Error(*refusal))
                return
            view = self.table.show(prepare.txid)
            first_index = len(view.half_seqs) if view is not None else 0
        problem = await self._declare_topics({m.topic for m in prepare.messages})
        if problem is not None:
            await request.answer(Error(ErrorCode.INTERNAL, problem))
            return
        self._next_index[prepare.txid] = (digest, first_index + len(prepare.messages))
        born = self.clock()
        appends = [
            Append(
                layout.half_subject(self.partition),
                message.body,
                half_headers(
                    txid=prepare.txid,
                    token_digest=digest,
                    group=prepare.group,
                    producer=prepare.producer,
                    begins=begins,
                    index=first_index + offset,
                    born=born,
                    message=message,
                ),
                layout.HALF_STREAM,
            )
            for offset, message in enumerate(prepare.messages)
        ]
        request_id = self._new_request_id()
        self._waiting[request_id] = _Waiting(request, lambda state: None)

        async def report(acks: list[PubAck | None]) -> None:
            pairs = list(zip(appends, acks, strict=True))
            stored = tuple(read_raw_half_from(a, ack) for a, ack in pairs if ack is not None)
            refused = tuple(
                f"message {a.headers.get(layout.INDEX_HEADER)}" for a, ack in pairs if ack is None
            )
            await self.ref.tell(
                _HalvesAppended(
                    self._epoch,
                    request_id,
                    prepare.txid,
                    token,
                    prepare.group,
                    prepare.producer,
                    begins,
                    stored,
                    refused,
                )
            )

        await self._halves.submit(appends, report)

    async def _declare_topics(self, topics: set[str]) -> str | None:
        """Make sure each topic has its stream; why not, if JetStream cannot say so now."""
        for topic in topics - self._topics:
            declare = functools.partial(
                ensure_topic_stream,
                self.js,
                topic,
                duplicate_window=self.options.topic_duplicate_window,
                replicas=self.options.replicas,
            )
            try:
                await linked(self.nc, declare)
            except (ConfigError, LinkLost, *LINK_TROUBLE) as error:
                log.warning("topic_stream_not_declared", topic=topic, error=describe(error))
                return f"the stream of topic {topic} cannot be declared now: {describe(error)}"
            self._topics.add(topic)
        return None

    async def _halves_appended(self, done: _HalvesAppended) -> None:
        token_and_next = self._next_index.get(done.txid)
        if token_and_next is not None and tokens.same(token_and_next[0], tokens.digest(done.token)):
            last_index = max((s.half.index for s in done.stored), default=-1)
            if token_and_next[1] <= last_index + 1 or done.refused:
                del self._next_index[done.txid]  # no later prepare of this txid in flight
        seqs = [s.half.seq for s in done.stored]
        waiting = self._waiting[done.request_id]
        if done.refused:
            await self._halves_refused(done, waiting)
            return
        waiting.reply = lambda state: Prepared(txid=done.txid, token=done.token, seqs=seqs)
        bodies = self._bodies.setdefault(done.txid, _Bodies(done.group))
        for stored in done.stored:
            bodies.messages[stored.half.index] = stored.message
        await self._handle(_stored_event(done, done.request_id))

    async def _halves_refused(self, done: _HalvesAppended, waiting: _Waiting) -> None:
        """JetStream refused some halves for good: the prepare fails, and nothing of the
        transaction may ever be delivered, so what did land is rolled back at once."""
        del self._waiting[done.request_id]
        if done.stored:
            await self._handle(_stored_event(done, None))
        if self.table.outcome(done.txid) is not None:
            request_id = self._new_request_id()
            self._waiting[request_id] = _Waiting(None, lambda state: None)  # nobody to answer
            await self._handle(
                End(
                    txid=done.txid,
                    token=tokens.digest(done.token),
                    decision=Decision.ROLLBACK,
                    request_id=request_id,
                )
            )
        reason = "; ".join(done.refused)
        message = f"JetStream refused {reason} of transaction {done.txid} (quarantined); "
        message += "the transaction is rolled back"
        assert waiting.request is not None
        await waiting.request.answer(Error(ErrorCode.INTERNAL, message))

    # -- admin ------------------------------------------------------------------------------

    async def _admin(self, request: Request) -> None:
        request = audited(request, self.partition)  # actions log `operator_action` when answered
        command = request.message
        match command:
            case ListTransactions():
                views, more = select(self.table.transactions(), command, self.clock())
                infos = [_info(v) for v in views]
                await request.answer(TransactionList(transactions=infos, more=more))
            case ShowTransaction(txid=txid):
                view = self.table.show(txid)
                if view is None:
                    state = self.table.outcome(txid)
                    detail = f"it is {state}" if state else "not open here"
                    await request.answer(Error(ErrorCode.NOT_FOUND, f"{txid}: {detail}"))
                else:
                    await request.answer(_info(view))
            case ResumeTransaction(txid=txid):
                request_id = self._wait(request, lambda state: Ended(txid=txid, state=state))
                await self._handle(Resume(txid=txid, request_id=request_id))
            case CommitTransaction(txid=txid):
                request_id = self._wait(request, lambda state: Ended(txid=txid, state=state))
                await self._handle(ForceCommit(txid=txid, request_id=request_id))
            case RollbackTransaction(txid=txid):
                request_id = self._wait(request, lambda state: Ended(txid=txid, state=state))
                await self._handle(ForceRollback(txid=txid, request_id=request_id))
            case _:
                name = type(command).__name__
                await request.answer(
                    Error(ErrorCode.UNKNOWN_COMMAND, f"not an admin command: {name}")
                )

    # -- actions ----------------------------------------------------------------------------

    async def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case PersistOp(op_id=op_id, records=records):
                    assert self._oplog is not None
                    self._oplog.append(op_id, records)
                    tracing.record_decisions(records, self._trace_context, self.partition)
                case Publish():
                    await self._publish(action)
                case SendCheck():
                    if action.txid in self._checks_in_flight and self.metrics is not None:
                        self.metrics.duplicate_checks.labels(self.partition).inc()
                    self._checks_in_flight.add(action.txid)
                    self.start_task(self._check, action)
                case Discard():
                    self.start_task(self._discard, action)
                case Acknowledge(request_id=request_id, state=state):
                    waiting = self._waiting.pop(request_id)
                    if self.metrics is not None and state is TxnState.COMMITTED:
                        latency = time.perf_counter() - waiting.since
                        self.metrics.commit_latency.labels(self.partition).observe(latency)
                    if waiting.request is not None:
                        await waiting.request.answer(waiting.reply(state))
                case Refuse(request_id=request_id, code=code, message=text):
                    waiting = self._waiting.pop(request_id)
                    if waiting.request is not None:
                        await waiting.request.answer(Error(code, text))

    async def _publish(self, action: Publish) -> None:
        bodies = self._bodies.get(action.txid)
        message = bodies.messages.get(action.index) if bodies is not None else None
        if message is None or bodies is None:
            self.start_task(self._publish_from_stream, action)
            return
        await self._published.submit(
            [self._topic_append(action, bodies.group, message)],
            lambda _: self.ref.tell(_TopicPublished(self._epoch, action.txid, action.index)),
        )

    async def _publish_from_stream(self, action: Publish) -> None:
        """After a restart the body is only in TXN_HALF: read it back by sequence."""
        try:
            raw = await retry_transient(self.js.get_msg, layout.HALF_STREAM, action.half_seq)
            stored = read_raw_half(raw)
        except Exception as error:  # gone (purged by hand?) or unreadable: never publishable
            subject = layout.half_subject(self.partition)
            reason = f"committed half {action.half_seq} cannot be read: {describe(error)}"
            await self._quarantine(Append(subject, b"", {}), reason)
            await self.ref.tell(_TopicPublished(self._epoch, action.txid, action.index))
            return
        await self._published.submit(
            [self._topic_append(action, stored.group, stored.message)],
            lambda _: self.ref.tell(_TopicPublished(self._epoch, action.txid, action.index)),
        )

    def _topic_append(self, action: Publish, group: str, message: OutgoingMessage) -> Append:
        headers = dict(message.properties)
        headers[layout.MSG_ID_HEADER] = action.msg_id
        headers[layout.TXID_HEADER] = action.txid
        headers[layout.GROUP_HEADER] = group
        headers[layout.INDEX_HEADER] = str(action.index)
        headers[layout.COMMITTED_AT_HEADER] = repr(self.clock())
        if message.tag is not None:
            headers[layout.TAG_HEADER] = message.tag
        if message.keys:
            headers[layout.KEYS_HEADER] = ",".join(message.keys)
        tracing.record_publish(headers, action.txid, action.msg_id, message.topic)
        subject = layout.topic_subject(message.topic, message.tag)
        return Append(subject, message.body, headers, layout.topic_stream(message.topic))

    def _trace_context(self, txid: str) -> dict[str, str]:
        """The properties of a kept half of `txid`, where its trace context travels."""
        bodies = self._bodies.get(txid)
        half = next(iter(bodies.messages.values()), None) if bodies is not None else None
        return half.properties if half is not None else {}

    async def _check(self, action: SendCheck) -> None:
        try:
            resolution, failure = await ask_producer(self.nc, self.js, action)
        except Exception as error:  # JetStream or the connection failed: an inconclusive check
            log.warning("check_back_failed", txid=action.txid, error=describe(error))
            resolution, failure = None, CheckFailure.ERROR
        await self.ref.tell(
            _CheckReturned(self._epoch, action.txid, action.check_id, resolution, failure)
        )

    async def _discard(self, action: Discard) -> None:
        await discard(self.js, self._published, action, self.on_discard)

    async def _ops_appended(self, op_ids: list[int], seq: int) -> None:
        await self.ref.tell(_OpsAppended(self._epoch, op_ids, seq))

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

    # -- requests ---------------------------------------------------------------------------

    def _new_request_id(self) -> str:
        self._request_ids += 1
        return str(self._request_ids)

    def _wait(self, request: Request, reply: Callable[[TxnState], Any]) -> str:
        request_id = self._new_request_id()
        self._waiting[request_id] = _Waiting(request, reply)
        return request_id


def _stored_event(done: _HalvesAppended, request_id: str | None) -> HalvesStored:
    """What the table learns from appended halves (with the request to answer, if any)."""
    return HalvesStored(
        txid=done.txid,
        token=tokens.digest(done.token),
        group=done.group,
        producer=done.producer,
        halves=tuple(s.half for s in done.stored),
        begins=done.begins,
        request_id=request_id,
    )


def read_raw_half_from(append: Append, ack: PubAck) -> StoredHalf:
    """The half as stored, from what we appended and the sequence JetStream gave it."""
    return read_half(ack.seq, append.headers, append.payload)


def _info(view: TxnView) -> TransactionInfo:
    return TransactionInfo(
        txid=view.txid,
        state=view.state.value,
        group=view.group,
        producer=view.producer,
        topics=list(view.topics),
        half_seqs=list(view.half_seqs),
        born=view.born,
        check_times=view.check_times,
        last_check=view.last_check,
        next_check_at=view.next_check_at,
        discard_reason=view.discard_reason.value if view.discard_reason else None,
    )
