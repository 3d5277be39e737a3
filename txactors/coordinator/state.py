"""The coordinator's bookkeeping as a pure state machine: events in, actions out, no I/O.

Everything that decides what happens to a transaction lives here, and this module knows
nothing about NATS, tasks or clocks (h11's `_state.py` rule). The coordinator and checker
actors are thin loops: feed each fact as an event (or `tick(now)` when `next_deadline()`
comes), carry out the returned actions in order, and feed their completions back.

Time is an argument. `now` and every `born` are wall-clock seconds (`time.time()`), because
they outlive the process in TXN_HALF headers; a clock that jumps back only delays work.

Guarantees (each one a test in tests/test_coordinator_state*.py):
- A `Publish` is emitted only after the commit record is persisted, never for a transaction
  that was rolled back or discarded; the reply to a commit only once every one of its
  messages is published (acknowledged by its topic stream).
- At most one check-back in flight per transaction; none once it is decided; at most
  `check_max` inconclusive ones, then DISCARDING.
- A refused request (`Refuse`) or an unexpected check answer changes nothing. Events only
  a bug could produce raise `CoordinatorStateError`; like every failure of an event, it
  leaves the table as it was, and the actions of earlier events of the same batch come out
  of the next call.
- `tick` costs O(due transactions), never O(history): finished transactions leave memory
  (see `recent.py` and `deadlines.py`).
- Replaying TXN_HALF then TXN_OP from `checkpoint()` rebuilds the open transactions exactly;
  a commit without `done` is published again when recovery finishes.

Ordering contract with the actor: feed `HalvesStored` in TXN_HALF order (the order a
connection receives JetStream acks) and append `PersistOp`s to TXN_OP in the order given.
A half fed out of order is still safe; it only pins the OP checkpoint to the stream start
until its transaction finishes. Check whether a prepare is admissible (`refuse_prepare`)
before appending its halves, in the same task that feeds `End`, so no half can land after its
transaction was decided. Tokens in events are what the actor stores (digests, `tokens.py`);
the table only compares them, in constant time.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Collection, Iterable
from typing import assert_never

import msgspec

from txactors.coordinator import tokens
from txactors.coordinator.actions import (
    Acknowledge,
    Action,
    CheckTarget,
    Discard,
    PersistOp,
    Publish,
    Refuse,
    SendCheck,
)
from txactors.coordinator.config import CoordinatorConfig
from txactors.coordinator.deadlines import Deadlines
from txactors.coordinator.events import (
    CheckAnswered,
    CheckFailed,
    CheckFailure,
    End,
    Event,
    ForceCommit,
    ForceRollback,
    HalvesStored,
    OpPersisted,
    OpReplayed,
    Published,
    Resume,
)
from txactors.coordinator.lifecycle import (
    COMMIT_PATH,
    FINAL,
    LEGAL_MOVES,
    OPEN,
    ROLLBACK_PATH,
    TxnState,
)
from txactors.coordinator.recent import Outcome, RecentOutcomes
from txactors.coordinator.records import Decision, DiscardReason, Half, OpKind, OpRecord
from txactors.errors import TxActorsError
from txactors.protocol import ErrorCode

S = TxnState

DECIDABLE_BY_OPERATOR = OPEN | {S.DISCARDED}

# Which states a replayed op record applies to; anything else is a record of an earlier,
# already finished incarnation of the state (or a duplicate write) and is skipped.
REPLAYABLE_FROM: dict[OpKind, frozenset[TxnState]] = {
    OpKind.COMMIT: DECIDABLE_BY_OPERATOR,
    OpKind.ROLLBACK: DECIDABLE_BY_OPERATOR,
    OpKind.DONE: frozenset({S.PUBLISHING}),
    OpKind.DISCARD: OPEN,
    OpKind.CHECKED: OPEN,
    OpKind.RESUME: DECIDABLE_BY_OPERATOR,
}


class CoordinatorStateError(TxActorsError):
    """The actor fed an event that only a bug can produce; nothing was changed."""


MAX_PARKED = 1000
"""Most discarded transactions a checkpoint carries; any beyond pin the offsets as before."""


class ParkedTxn(msgspec.Struct, frozen=True, kw_only=True):
    """A DISCARDED transaction as the checkpoint keeps it: it may wait for an operator until
    retention, and carrying it here spares recovery from re-reading everything since it."""

    txid: str
    token: str
    group: str
    producer: str
    halves: tuple[Half, ...]
    check_times: int
    reason: DiscardReason
    last_check: str | None = None


class Checkpoint(msgspec.Struct, frozen=True):
    """First sequences of TXN_HALF and TXN_OP that recovery must read, and the discarded
    transactions it restores without reading (they do not hold the offsets back)."""

    half_seq: int
    op_seq: int
    discarded: tuple[ParkedTxn, ...] = ()


class TxnView(msgspec.Struct, frozen=True, kw_only=True):
    """What an operator sees of an open or discarded transaction."""

    txid: str
    state: TxnState
    group: str
    producer: str
    topics: tuple[str, ...]
    half_seqs: tuple[int, ...]
    born: float
    check_times: int
    last_check: str | None
    next_check_at: float | None
    discard_reason: DiscardReason | None


@dataclasses.dataclass(slots=True)
class Counters:
    """Monotonic counts for metrics (recovery replay is not counted).

    `late_check_answers` counts answers that came after their check timed out here but
    before another check was sent: they still decide. `unexpected_check_answers` counts
    answers that could not (a newer check was out, or the transaction was decided
    meanwhile); it stays 0 in a healthy run.
    """

    halves_stored: int = 0
    commits: int = 0
    rollbacks: int = 0
    discards: int = 0
    forgotten: int = 0
    unknown_ends: int = 0
    checks_sent: int = 0
    checks_inconclusive: int = 0
    unexpected_check_answers: int = 0
    late_check_answers: int = 0
    refusals: int = 0
    replay_skipped: int = 0
    quarantined: int = 0
    """Records refused by JetStream for good, or unreadable in recovery (kept by the actor)."""


@dataclasses.dataclass(slots=True, kw_only=True)
class _Txn:
    txid: str
    token: str
    group: str
    producer: str
    state: TxnState
    halves: dict[int, Half]
    first_seq: int
    born: float
    """The oldest half's birth: retention counts from here."""
    op_floor: int
    """No op record of this or any later-stored transaction is below this TXN_OP sequence."""
    check_times: int = 0
    next_check_at: float = 0.0
    check_id: int | None = None
    timed_out_check_id: int | None = None
    """The last check that timed out here: its answer may still come, and still decide."""
    check_target: CheckTarget = CheckTarget.INSTANCE
    check_expires_at: float = 0.0
    instance_gone: bool = False
    last_check: str | None = None
    discard_reason: DiscardReason | None = None
    published: set[int] = dataclasses.field(default_factory=set)
    waiters: list[str] = dataclasses.field(default_factory=list)

    def ordered_halves(self) -> tuple[Half, ...]:
        return tuple(self.halves[i] for i in sorted(self.halves))


class TransactionTable:
    """Open transactions of one partition, their deadlines, and what to do next."""

    def __init__(
        self, config: CoordinatorConfig | None = None, *, rng: random.Random | None = None
    ) -> None:
        self.config = config or CoordinatorConfig()
        self.counters = Counters()
        self._rng = rng or random.Random()
        self._open: dict[str, _Txn] = {}
        self._recent = RecentOutcomes(self.config.recent_outcomes)
        self._deadlines = Deadlines()
        self._ops_in_flight: dict[int, tuple[OpRecord, ...]] = {}
        self._op_ids = itertools.count(1)
        # Random start: an answer to a check sent before a restart cannot match a new one.
        self._check_ids = itertools.count(self._rng.getrandbits(48))
        self._half_tail = 0
        self._op_tail = 0
        self._replay_op_from: int | None = None
        self._actions: list[Action] = []
        self._records: list[OpRecord] = []

    # ------------------------------------------------------------------ inputs

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event; return the actions to carry out, in order."""
        return self.handle_batch((event,), now)

    def handle_batch(self, events: Iterable[Event], now: float) -> list[Action]:
        """Apply several events as one step: their op records share one `PersistOp`."""
        for event in events:
            self._dispatch(event, now)
        return self._end_step()

    def tick(self, now: float) -> list[Action]:
        """Act on every deadline due at `now`: send checks, time them out, discard, forget."""
        self._require_running("tick")
        for txid in self._deadlines.pop_due(now):
            self._on_deadline(self._open[txid], now)
        return self._end_step()

    def begin_recovery(
        self, *, half_from: int, op_from: int, discarded: Iterable[ParkedTxn] = ()
    ) -> None:
        """Start replaying: restore the `discarded` transactions, feed `HalvesStored` from
        TXN_HALF `half_from`, then `OpReplayed` from TXN_OP `op_from` (all three from a
        `checkpoint()` saved earlier), then `finish_recovery`."""
        if self._open or self._ops_in_flight or self._half_tail or self._op_tail:
            raise CoordinatorStateError("recovery must start on a fresh table")
        self._replay_op_from = op_from
        self._half_tail = half_from - 1
        self._op_tail = op_from - 1
        for parked in discarded:
            if not parked.halves:
                continue
            self._open[parked.txid] = _Txn(
                txid=parked.txid,
                token=parked.token,
                group=parked.group,
                producer=parked.producer,
                state=S.DISCARDED,
                halves={h.index: h for h in parked.halves},
                first_seq=min(h.seq for h in parked.halves),
                born=min(h.born for h in parked.halves),
                op_floor=op_from,
                check_times=parked.check_times,
                last_check=parked.last_check,
                discard_reason=parked.reason,
            )

    def finish_recovery(self, now: float) -> list[Action]:
        """Resume work: republish commits without `done`, schedule every pending check."""
        if self._replay_op_from is None:
            raise CoordinatorStateError("finish_recovery without begin_recovery")
        self._replay_op_from = None
        # Metrics count what this process did; re-reading the streams did nothing new.
        self.counters = Counters(
            replay_skipped=self.counters.replay_skipped, quarantined=self.counters.quarantined
        )
        for txn in self._open.values():
            if txn.state is S.PUBLISHING:
                self._publish_all(txn)
            elif txn.state is S.PREPARED:
                if txn.check_times:
                    txn.next_check_at = now + self.config.check_delay(txn.check_times, self._rng)
                else:
                    txn.next_check_at = max(txn.next_check_at, now)
            self._schedule(txn)
        return self._end_step()

    # ------------------------------------------------------------------ reads

    def refuse_prepare(
        self, txid: str, token: str, group: str, *, begins: bool
    ) -> tuple[ErrorCode, str] | None:
        """Why halves for `txid` would be refused (None: admissible). Call before appending."""
        txn = self._open.get(txid)
        if txn is None:
            finished = self._recent.get(txid)
            if finished is not None:
                return ErrorCode.CONFLICT, f"transaction {txid} is already {finished.state}"
            if not begins:
                return ErrorCode.NOT_FOUND, f"no open transaction {txid} to add messages to"
            return None
        if not tokens.same(txn.token, token):
            return self.token_refusal(txid, begins=begins)
        if group != txn.group:
            return ErrorCode.CONFLICT, f"transaction {txid} belongs to group {txn.group!r}"
        if txn.state not in OPEN:
            return ErrorCode.CONFLICT, f"transaction {txid} is {txn.state}; it takes no halves"
        return None

    @staticmethod
    def token_refusal(txid: str, *, begins: bool) -> tuple[ErrorCode, str]:
        """A prepare of an existing `txid` without its token: a first prepare (no token)
        is a second transaction under the same id, anything else a wrong token."""
        if begins:
            return ErrorCode.CONFLICT, f"transaction {txid} exists already; its token adds to it"
        return ErrorCode.FORBIDDEN, f"wrong token for transaction {txid}"

    def outcome(self, txid: str) -> TxnState | None:
        """State of an open transaction or a recently finished one (None: not known)."""
        txn = self._open.get(txid)
        if txn is not None:
            return txn.state
        finished = self._recent.get(txid)
        return None if finished is None else finished.state

    def show(self, txid: str) -> TxnView | None:
        txn = self._open.get(txid)
        return None if txn is None else self._view(txn)

    def transactions(self, states: Collection[TxnState] | None = None) -> list[TxnView]:
        """Open and discarded transactions (optionally only in `states`), oldest first."""
        views = [self._view(t) for t in self._open.values() if states is None or t.state in states]
        return sorted(views, key=lambda v: v.born)

    def checkpoint(self) -> Checkpoint:
        """Where recovery must start reading so that it sees every transaction in memory.

        OP: no record of a transaction stored after the oldest open one can precede the OP
        tail we knew when that one was stored; older finished ones are not replayed at all.
        DISCARDED ones (up to MAX_PARKED) travel in the checkpoint instead of holding the
        offsets back: their records are final until an operator acts, and an operator's
        record comes after the checkpoint. Costs O(transactions in memory).
        """
        parked = [t for t in self._open.values() if t.state is S.DISCARDED][:MAX_PARKED]
        parked_ids = {t.txid for t in parked}
        pinning = [t for t in self._open.values() if t.txid not in parked_ids]
        return Checkpoint(
            min((t.first_seq for t in pinning), default=self._half_tail + 1),
            min((t.op_floor for t in pinning), default=self._op_tail + 1),
            tuple(_parked(t) for t in parked),
        )

    def next_deadline(self) -> float | None:
        """When `tick` next has work; the actor sleeps until then (or the next event)."""
        return self._deadlines.earliest()

    def __len__(self) -> int:
        """Transactions in memory: open, deciding, and discarded within retention."""
        return len(self._open)

    @property
    def recent_count(self) -> int:
        return len(self._recent)

    @property
    def timer_heap_size(self) -> int:
        return self._deadlines.heap_size

    @property
    def timer_entries_examined(self) -> int:
        return self._deadlines.examined

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, event: Event, now: float) -> None:
        if self._replay_op_from is not None and not isinstance(event, HalvesStored | OpReplayed):
            raise CoordinatorStateError(f"{type(event).__name__} during recovery")
        match event:
            case HalvesStored():
                self._on_halves_stored(event)
            case End():
                self._on_end(event)
            case OpPersisted():
                self._on_op_persisted(event)
            case OpReplayed():
                self._on_op_replayed(event)
            case Published():
                self._on_published(event)
            case CheckAnswered():
                self._on_check_answered(event, now)
            case CheckFailed():
                txn = self._current_check(event.txid, event.check_id)
                if txn is not None:  # else: timed out here already, or decided meanwhile
                    self._check_failed(txn, event.reason, now)
            case Resume():
                self._on_resume(event, now)
            case ForceCommit():
                self._answer(event.txid, Decision.COMMIT, event.request_id, by_operator=True)
            case ForceRollback():
                self._answer(event.txid, Decision.ROLLBACK, event.request_id, by_operator=True)
            case _:
                assert_never(event)

    def _end_step(self) -> list[Action]:
        actions, self._actions = self._actions, []
        if self._records:
            op_id = next(self._op_ids)
            records, self._records = tuple(self._records), []
            self._ops_in_flight[op_id] = records
            actions.append(PersistOp(op_id=op_id, records=records))
        return actions

    # ------------------------------------------------------------------ events

    def _on_halves_stored(self, event: HalvesStored) -> None:
        if not event.halves:
            raise CoordinatorStateError(f"HalvesStored for {event.txid} without halves")
        refusal = self.refuse_prepare(event.txid, event.token, event.group, begins=event.begins)
        if refusal is not None:
            self._refuse(event.request_id, event.txid, *refusal)
            return
        first_seq = min(h.seq for h in event.halves)
        txn = self._open.get(event.txid)
        if txn is None:
            txn = _Txn(
                txid=event.txid,
                token=event.token,
                group=event.group,
                producer=event.producer,
                state=S.PREPARED,
                halves={},
                first_seq=first_seq,
                born=min(h.born for h in event.halves),
                op_floor=self._op_floor_for(first_seq),
            )
            self._open[txn.txid] = txn
        elif first_seq < txn.first_seq:
            txn.first_seq = first_seq
            txn.op_floor = min(txn.op_floor, self._op_floor_for(first_seq))
        new = [h for h in event.halves if h.index not in txn.halves]  # a retried prepare adds none
        txn.halves.update((h.index, h) for h in new)
        txn.born = min([txn.born, *(h.born for h in new)])
        self.counters.halves_stored += len(new)
        self._half_tail = max([self._half_tail, *(h.seq for h in event.halves)])
        if txn.state is S.PREPARED and txn.check_times == 0:
            # The newest half is left alone for the longest immunity of any half.
            immunity = max(self.config.immunity(h.immunity) for h in txn.halves.values())
            txn.next_check_at = max(h.born for h in txn.halves.values()) + immunity
            self._schedule(txn)
        if event.request_id is not None:
            self._emit(Acknowledge(request_id=event.request_id, txid=txn.txid, state=txn.state))

    def _on_end(self, event: End) -> None:
        known = self._open.get(event.txid) or self._recent.get(event.txid)
        if known is None:
            self._refuse(
                event.request_id, event.txid, ErrorCode.NOT_FOUND, f"no transaction {event.txid}"
            )
        elif not tokens.same(known.token, event.token):
            self._refuse(
                event.request_id,
                event.txid,
                ErrorCode.FORBIDDEN,
                f"wrong token for transaction {event.txid}",
            )
        elif event.decision is Decision.UNKNOWN:
            # Not a decision: the transaction waits for the checker as it was.
            self.counters.unknown_ends += 1
            self._emit(Acknowledge(request_id=event.request_id, txid=event.txid, state=known.state))
        else:
            self._answer(event.txid, event.decision, event.request_id, by_operator=False)

    def _answer(
        self, txid: str, decision: Decision, request_id: str | None, *, by_operator: bool
    ) -> None:
        """Decide, or tell the requester how the transaction was already decided.

        A repeated decision is acknowledged (now if final, else when it becomes final); the
        other decision is a conflict. DISCARDED is decided for producers, not for operators.
        """
        state = self.outcome(txid)
        if state is None:
            self._refuse(request_id, txid, ErrorCode.NOT_FOUND, f"no transaction {txid}")
            return
        txn = self._open.get(txid)
        decidable = DECIDABLE_BY_OPERATOR if by_operator else OPEN
        same_path = COMMIT_PATH if decision is Decision.COMMIT else ROLLBACK_PATH
        if txn is not None and state in decidable:
            self._decide(txn, decision, request_id, by_operator=by_operator)
        elif state in same_path and state in (*FINAL, S.FINISHING):
            if request_id is not None:
                final = S.COMMITTED if state is S.FINISHING else state  # all published already
                self._emit(Acknowledge(request_id=request_id, txid=txid, state=final))
        elif txn is not None and state in same_path:
            if request_id is not None:
                txn.waiters.append(request_id)
        elif state is S.DISCARDED:
            message = f"transaction {txid} was discarded; an operator may resume or force it"
            self._refuse(request_id, txid, ErrorCode.CONFLICT, message)
        else:
            message = f"transaction {txid} is {state}; it cannot {decision}"
            self._refuse(request_id, txid, ErrorCode.CONFLICT, message)

    def _on_op_persisted(self, event: OpPersisted) -> None:
        records = self._ops_in_flight.pop(event.op_id, None)
        if records is None:
            raise CoordinatorStateError(f"OpPersisted for op {event.op_id}, which is not in flight")
        self._op_tail = max(self._op_tail, event.seq)
        for record in records:
            self._on_record_persisted(record)

    def _on_record_persisted(self, record: OpRecord) -> None:
        """The second half of each decision: act once it is durable."""
        if record.kind in (OpKind.CHECKED, OpKind.RESUME):
            return  # advisory: only recovery reads them
        txn = self._open[record.txid]
        match record.kind:
            case OpKind.COMMIT:
                self._move(txn, S.PUBLISHING)
                self._publish_all(txn)
            case OpKind.DONE:
                self._finish(txn, S.COMMITTED)
            case OpKind.ROLLBACK:
                self._finish(txn, S.ROLLED_BACK)
            case OpKind.DISCARD:
                self._move(txn, S.DISCARDED)
                self.counters.discards += 1
                self._emit(
                    Discard(
                        txid=txn.txid,
                        group=txn.group,
                        producer=txn.producer,
                        halves=txn.ordered_halves(),
                        reason=record.reason or DiscardReason.CHECK_MAX,
                        check_times=txn.check_times,
                    )
                )

    def _on_op_replayed(self, event: OpReplayed) -> None:
        """Recovery: re-run each decision's two halves, with every action held back."""
        if self._replay_op_from is None:
            raise CoordinatorStateError("OpReplayed outside recovery")
        self._op_tail = max(self._op_tail, event.seq)
        for record in event.records:
            txn = self._open.get(record.txid)
            if txn is None or txn.state not in REPLAYABLE_FROM[record.kind]:
                self.counters.replay_skipped += 1
                continue
            match record.kind:
                case OpKind.COMMIT:
                    listed = set(record.half_seqs)
                    txn.halves = {i: h for i, h in txn.halves.items() if h.seq in listed}
                    self._decide(txn, Decision.COMMIT, None, by_operator=record.by_operator)
                case OpKind.ROLLBACK:
                    self._decide(txn, Decision.ROLLBACK, None, by_operator=record.by_operator)
                case OpKind.DONE:
                    txn.published = set(txn.halves)
                    self._move(txn, S.FINISHING)
                case OpKind.DISCARD:
                    txn.check_times = max(txn.check_times, record.check_times)
                    self._discard(txn, record.reason or DiscardReason.CHECK_MAX)
                case OpKind.CHECKED:
                    txn.check_times = max(txn.check_times, record.check_times)
                    continue
                case OpKind.RESUME:
                    self._reset_checks(txn)
                    continue
            self._on_record_persisted(record)

    def _on_published(self, event: Published) -> None:
        txn = self._open.get(event.txid)
        if txn is None or txn.state is not S.PUBLISHING:
            if self.outcome(event.txid) in (S.FINISHING, S.COMMITTED):
                return  # the ack of a retried publish, after the first one counted
            raise CoordinatorStateError(f"Published for {event.txid}, which is not publishing")
        if event.index not in txn.halves:
            raise CoordinatorStateError(f"Published for {event.txid} unknown index {event.index}")
        txn.published.add(event.index)
        if len(txn.published) == len(txn.halves):
            self._move(txn, S.FINISHING)
            self._persist(OpRecord(txid=txn.txid, kind=OpKind.DONE))
            # Every message is durable on its topic, so the commit is visible: the producer
            # hears it now. `done` only spares recovery a (deduplicated) republish.
            for request_id in txn.waiters:
                self._emit(Acknowledge(request_id=request_id, txid=txn.txid, state=S.COMMITTED))
            txn.waiters.clear()

    def _on_check_answered(self, event: CheckAnswered, now: float) -> None:
        txn = self._current_check(event.txid, event.check_id)
        if txn is None:
            late = self._open.get(event.txid)
            if (
                late is not None
                and late.state is S.PREPARED
                and late.timed_out_check_id == event.check_id
                and event.resolution is not Decision.UNKNOWN
            ):
                # A slow producer's answer: nothing newer was asked, so it is still the truth.
                self.counters.late_check_answers += 1
                late.last_check = str(event.resolution)
                self._decide(late, event.resolution, None, by_operator=False)
                return
            self.counters.unexpected_check_answers += 1
            return
        txn.last_check = str(event.resolution)
        if event.resolution is Decision.UNKNOWN:
            self._inconclusive(txn, now)
        else:
            self._decide(txn, event.resolution, None, by_operator=False)

    def _on_resume(self, event: Resume, now: float) -> None:
        txn = self._open.get(event.txid)
        if txn is None or txn.state not in DECIDABLE_BY_OPERATOR:
            state = self.outcome(event.txid)
            code = ErrorCode.NOT_FOUND if state is None else ErrorCode.CONFLICT
            message = f"transaction {event.txid} is {state or 'unknown'}; nothing to resume"
            self._refuse(event.request_id, event.txid, code, message)
            return
        txn.next_check_at = now
        self._reset_checks(txn)
        self._persist(OpRecord(txid=txn.txid, kind=OpKind.RESUME))
        self._schedule(txn)  # CHECKING keeps its check in flight; PREPARED is due now
        self._emit(Acknowledge(request_id=event.request_id, txid=txn.txid, state=txn.state))

    def _on_deadline(self, txn: _Txn, now: float) -> None:
        if txn.state is S.DISCARDED:
            del self._open[txn.txid]
            self._recent.remember(txn.txid, Outcome(S.DISCARDED, txn.token))
            self.counters.forgotten += 1
        elif now >= txn.born + self.config.half_retention:
            self._discard(txn, DiscardReason.RETENTION)
        elif txn.state is S.CHECKING:
            self._check_failed(txn, CheckFailure.TIMEOUT, now)
        else:
            self._send_check(txn, now)

    # ------------------------------------------------------------------ transitions

    def _decide(
        self, txn: _Txn, decision: Decision, request_id: str | None, *, by_operator: bool
    ) -> None:
        txn.check_id = None  # a late answer to an in-flight check is now unexpected
        txn.timed_out_check_id = None
        if decision is Decision.COMMIT:
            self._move(txn, S.COMMITTING)
            seqs = tuple(h.seq for h in txn.ordered_halves())
            self._persist(
                OpRecord(txid=txn.txid, kind=OpKind.COMMIT, half_seqs=seqs, by_operator=by_operator)
            )
        else:
            self._move(txn, S.ROLLING_BACK)
            self._persist(OpRecord(txid=txn.txid, kind=OpKind.ROLLBACK, by_operator=by_operator))
        if request_id is not None:
            txn.waiters.append(request_id)

    def _send_check(self, txn: _Txn, now: float) -> None:
        txn.check_id = next(self._check_ids)
        txn.timed_out_check_id = None  # only the newest question's answer may decide
        txn.check_target = CheckTarget.GROUP if txn.instance_gone else CheckTarget.INSTANCE
        txn.check_expires_at = now + self.config.check_answer_timeout
        self._move(txn, S.CHECKING)
        self.counters.checks_sent += 1
        self._emit(
            SendCheck(
                txid=txn.txid,
                check_id=txn.check_id,
                target=txn.check_target,
                group=txn.group,
                producer=txn.producer,
                check_times=txn.check_times,
                halves=txn.ordered_halves(),
                timeout=self.config.check_answer_timeout,
            )
        )

    def _check_failed(self, txn: _Txn, reason: CheckFailure, now: float) -> None:
        txn.last_check = str(reason)
        if reason is CheckFailure.TIMEOUT:
            txn.timed_out_check_id = txn.check_id
        if txn.check_target is CheckTarget.INSTANCE:
            txn.instance_gone = True  # from now on, ask the group
            if reason is CheckFailure.NO_RESPONDERS:
                # The instance is simply gone: ask the group at once; this check did not happen.
                self._move(txn, S.PREPARED)
                self._send_check(txn, now)
                return
        self._inconclusive(txn, now)

    def _inconclusive(self, txn: _Txn, now: float) -> None:
        txn.check_id = None
        txn.check_times += 1
        self.counters.checks_inconclusive += 1
        self._persist(OpRecord(txid=txn.txid, kind=OpKind.CHECKED, check_times=txn.check_times))
        if txn.check_times >= self.config.check_max:
            self._discard(txn, DiscardReason.CHECK_MAX)
        else:
            txn.next_check_at = now + self.config.check_delay(txn.check_times, self._rng)
            self._move(txn, S.PREPARED)

    def _discard(self, txn: _Txn, reason: DiscardReason) -> None:
        txn.check_id = None
        txn.discard_reason = reason
        self._move(txn, S.DISCARDING)
        self._persist(
            OpRecord(
                txid=txn.txid,
                kind=OpKind.DISCARD,
                half_seqs=tuple(h.seq for h in txn.ordered_halves()),
                check_times=txn.check_times,
                reason=reason,
            )
        )

    def _reset_checks(self, txn: _Txn) -> None:
        txn.check_times = 0
        txn.instance_gone = False
        txn.discard_reason = None
        if txn.state is S.DISCARDED:
            self._move(txn, S.PREPARED)

    def _finish(self, txn: _Txn, state: TxnState) -> None:
        self._move(txn, state)
        del self._open[txn.txid]
        self._recent.remember(txn.txid, Outcome(state, txn.token))
        if state is S.COMMITTED:
            self.counters.commits += 1
        else:
            self.counters.rollbacks += 1
        for request_id in txn.waiters:
            self._emit(Acknowledge(request_id=request_id, txid=txn.txid, state=state))

    def _publish_all(self, txn: _Txn) -> None:
        for half in txn.ordered_halves():
            self._emit(
                Publish(txid=txn.txid, index=half.index, topic=half.topic, half_seq=half.seq)
            )

    # ------------------------------------------------------------------ plumbing

    def _move(self, txn: _Txn, new: TxnState) -> None:
        if new not in LEGAL_MOVES[txn.state]:
            raise CoordinatorStateError(f"can't move {txn.txid} from {txn.state} to {new}")
        txn.state = new
        self._schedule(txn)

    def _schedule(self, txn: _Txn) -> None:
        """Keep the one deadline a transaction has in its state (recovery schedules at the end)."""
        if self._replay_op_from is not None:
            return
        retention_at = txn.born + self.config.half_retention
        if txn.state is S.PREPARED:
            self._deadlines.set(txn.txid, min(txn.next_check_at, retention_at))
        elif txn.state is S.CHECKING:
            self._deadlines.set(txn.txid, min(txn.check_expires_at, retention_at))
        elif txn.state is S.DISCARDED:
            self._deadlines.set(txn.txid, retention_at)
        else:
            self._deadlines.cancel(txn.txid)  # waiting for a write, which the actor retries

    def _current_check(self, txid: str, check_id: int) -> _Txn | None:
        txn = self._open.get(txid)
        if txn is None or txn.state is not S.CHECKING or txn.check_id != check_id:
            return None
        return txn

    def _op_floor_for(self, first_seq: int) -> int:
        if self._replay_op_from is not None:
            return self._replay_op_from  # the saved checkpoint already covered it
        if first_seq > self._half_tail:
            return self._op_tail + 1
        return 1  # fed out of TXN_HALF order: only the stream start is surely early enough

    def _require_running(self, what: str) -> None:
        if self._replay_op_from is not None:
            raise CoordinatorStateError(f"{what} during recovery")

    def _emit(self, action: Action) -> None:
        if self._replay_op_from is None:  # recovery holds every action back
            self._actions.append(action)

    def _persist(self, record: OpRecord) -> None:
        if self._replay_op_from is None:  # replayed records are already in TXN_OP
            self._records.append(record)

    def _refuse(self, request_id: str | None, txid: str, code: ErrorCode, message: str) -> None:
        self.counters.refusals += 1
        if request_id is not None:
            self._emit(Refuse(request_id=request_id, txid=txid, code=code, message=message))

    def _view(self, txn: _Txn) -> TxnView:
        halves = txn.ordered_halves()
        return TxnView(
            txid=txn.txid,
            state=txn.state,
            group=txn.group,
            producer=txn.producer,
            topics=tuple(sorted({h.topic for h in halves})),
            half_seqs=tuple(h.seq for h in halves),
            born=txn.born,
            check_times=txn.check_times,
            last_check=txn.last_check,
            next_check_at=txn.next_check_at if txn.state is S.PREPARED else None,
            discard_reason=txn.discard_reason,
        )


def _parked(txn: _Txn) -> ParkedTxn:
    return ParkedTxn(
        txid=txn.txid,
        token=txn.token,
        group=txn.group,
        producer=txn.producer,
        halves=txn.ordered_halves(),
        check_times=txn.check_times,
        reason=txn.discard_reason or DiscardReason.CHECK_MAX,
        last_check=txn.last_check,
    )
