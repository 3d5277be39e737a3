"""The coordinator's transition table: (state, event) → moves and effects, with no I/O.

Everything that decides what happens to a transaction is a row of `TABLE` (h11's
`_state.py` rule): for each `Where` a transaction can be (its `TxnState`, or not in memory)
and each `Kind` of event, the move that does the work (`moves.py`) and the states it may
lead to. This module is the one place a transaction's state changes (`_move_to`). A pair
without a row is a bug in the caller: it raises `CoordinatorStateError("can't handle <kind>
in state <where> for <txid>")` and changes nothing. A move to a state its row does not list
is a bug in the move: it raises `CoordinatorStateError("can't move <txid> from <where> to
<target> on <kind>")`, and what the move had changed is put back (`_fire`, `_unit`). The
table itself has a `Phase` (`PHASES`): recovery is the RECOVERING phase, which accepts only
replayed input and holds every effect back, not a flag checked here and there.

Time is an argument. `now` and every `born` are wall-clock seconds (`time.time()`), because
they outlive the process in TXN_HALF headers; a clock that jumps back only delays work.

One event is one unit: its effects (and op records) are handed out all together, or, if
it fails, not at all and the table is as it was: the unit saves each transaction's fields
before its first move (and the counters and tails) and puts them back, and a transaction
leaves memory only once its unit succeeded. Only random draws are not given back. In a
batch, the events before a failing one stay applied and their effects come out of the next
call; the error names the failing event (`CoordinatorStateError.event`), so the caller can
answer it and feed the rest.

Guarantees (each one a test in tests/test_coordinator_state*.py and tests/unit/test_core_table.py):
- A `Publish` is emitted only after the commit record is persisted, never for a transaction
  that was rolled back or discarded; the reply to a commit only once every one of its
  messages is published (acknowledged by its topic stream).
- At most one check-back in flight per transaction; none once it is decided; at most
  `check_max` inconclusive ones, then DISCARDING.
- A refused request (`Refuse`) or an unexpected check answer changes nothing.
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

import itertools
import random
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, get_args

from txactors.coordinator.core.deadlines import Deadlines
from txactors.coordinator.core.effects import Effect, PersistOp
from txactors.coordinator.core.errors import CoordinatorStateError
from txactors.coordinator.core.events import (
    Event,
    HalvesStored,
    Kind,
    OpPersisted,
    OpReplayed,
    PerTxnEvent,
    kind_of,
    record_kind,
)
from txactors.coordinator.core.moves import Moves
from txactors.coordinator.core.recent import Outcome, RecentOutcomes
from txactors.coordinator.core.records import OpRecord
from txactors.coordinator.core.replay import Replay
from txactors.coordinator.core.states import (
    CHECKING,
    COMMITTED,
    COMMITTING,
    DECIDABLE_BY_OPERATOR,
    DISCARDED,
    DISCARDING,
    FINISHING,
    FORGOTTEN,
    LEAVES_MEMORY,
    OPEN,
    PREPARED,
    PUBLISHING,
    ROLLED_BACK,
    ROLLING_BACK,
    Gone,
    Phase,
    TxnState,
    Where,
)
from txactors.coordinator.core.transactions import (
    Counters,
    ParkedTxn,
    SavedTxn,
    Txn,
    put_back,
    save,
    unparked,
)
from txactors.wire.rules import CoordinatorConfig

K = Kind
Move = Callable[[Replay, Txn | None, Any, float], Where | None]


class Row(NamedTuple):
    move: Move
    to: frozenset[Where]
    """Where the move may take the transaction (besides staying where it is)."""


WHERE: tuple[Where, ...] = (*TxnState, *Gone)
TABLE: dict[tuple[Where, Kind], Row] = {}


def _column(
    kind: Kind, move: Move, to: dict[Where, set[Where]], *, elsewhere: Move | None = None
) -> None:
    """Rows of one event kind: `to` for the states it moves, `elsewhere` for the others
    (None: no row, the pair is illegal)."""
    for where in WHERE:
        if where in to:
            TABLE[where, kind] = Row(move, frozenset(to[where]))
        elif elsewhere is not None:
            TABLE[where, kind] = Row(elsewhere, frozenset())


def _each(states: Iterable[Where], to: set[Where]) -> dict[Where, set[Where]]:
    return {state: to for state in states}


# Requests: admission answers in every state (a refusal changes nothing).
_column(K.HALVES, Moves.store_halves, {Gone.UNKNOWN: {PREPARED}}, elsewhere=Moves.store_halves)
_column(K.END_COMMIT, Moves.end, _each(OPEN, {COMMITTING}), elsewhere=Moves.end)
_column(K.END_ROLLBACK, Moves.end, _each(OPEN, {ROLLING_BACK}), elsewhere=Moves.end)
_column(K.END_UNKNOWN, Moves.end, {}, elsewhere=Moves.end)
_BY_OPERATOR = DECIDABLE_BY_OPERATOR
_column(K.FORCE_COMMIT, Moves.force, _each(_BY_OPERATOR, {COMMITTING}), elsewhere=Moves.force)
_column(K.FORCE_ROLLBACK, Moves.force, _each(_BY_OPERATOR, {ROLLING_BACK}), elsewhere=Moves.force)
_column(K.RESUME, Moves.resume, {DISCARDED: {PREPARED}}, elsewhere=Moves.resume)
# Check-backs: an answer that cannot decide any more is counted and otherwise ignored.
_column(
    K.CHECK_ANSWERED,
    Moves.check_answered,
    {
        CHECKING: {COMMITTING, ROLLING_BACK, PREPARED, DISCARDING},
        PREPARED: {COMMITTING, ROLLING_BACK},  # the late answer to a timed-out check
    },
    elsewhere=Moves.check_answered,
)
_column(
    K.CHECK_FAILED,
    Moves.check_failed,
    {CHECKING: {PREPARED, DISCARDING}},  # or CHECKING again: the group, at once
    elsewhere=Moves.ignore,
)
_column(
    K.DUE,
    Moves.due,
    {
        PREPARED: {CHECKING, DISCARDING},
        CHECKING: {PREPARED, DISCARDING},
        DISCARDED: {FORGOTTEN},
    },
)
# Writes done: only the state that waits for the write takes it.
_column(K.PUBLISHED, Moves.published, {PUBLISHING: {FINISHING}})
TABLE[FINISHING, K.PUBLISHED] = TABLE[COMMITTED, K.PUBLISHED] = Row(Moves.ignore, frozenset())
_column(K.COMMIT_WRITTEN, Moves.commit_written, {COMMITTING: {PUBLISHING}})
_column(K.ROLLBACK_WRITTEN, Moves.rollback_written, {ROLLING_BACK: {ROLLED_BACK}})
_column(K.DONE_WRITTEN, Moves.done_written, {FINISHING: {COMMITTED}})
_column(K.DISCARD_WRITTEN, Moves.discard_written, {DISCARDING: {DISCARDED}})
# Recovery: a record applies only to the state it was written from; any other is a record
# of an earlier, already finished incarnation (or a duplicate write), skipped and counted.
_SKIP = Replay.skip_replayed
_column(
    K.COMMIT_REPLAYED, Replay.commit_replayed, _each(_BY_OPERATOR, {PUBLISHING}), elsewhere=_SKIP
)
_column(
    K.ROLLBACK_REPLAYED,
    Replay.rollback_replayed,
    _each(_BY_OPERATOR, {ROLLED_BACK}),
    elsewhere=_SKIP,
)
_column(K.DONE_REPLAYED, Replay.done_replayed, {PUBLISHING: {COMMITTED}}, elsewhere=_SKIP)
_column(K.DISCARD_REPLAYED, Replay.discard_replayed, _each(OPEN, {DISCARDED}), elsewhere=_SKIP)
_column(K.CHECKED_REPLAYED, Replay.checked_replayed, _each(OPEN, set()), elsewhere=_SKIP)
_column(
    K.RESUME_REPLAYED,
    Replay.resume_replayed,
    {PREPARED: set(), CHECKING: set(), DISCARDED: {PREPARED}},
    elsewhere=_SKIP,
)


class PhaseRule(NamedTuple):
    accepts: frozenset[str]
    """Names of the event types (and `tick`) the phase takes."""
    emits: bool
    """False: effects, op records and deadlines are held back (replayed input is old news)."""
    then: Phase


_PER_TXN = frozenset(get_args(PerTxnEvent))
_LIVE = frozenset({t.__name__ for t in get_args(Event) if t is not OpReplayed} | {"tick"})
PHASES: dict[Phase, PhaseRule] = {
    Phase.FRESH: PhaseRule(_LIVE, emits=True, then=Phase.RUNNING),
    Phase.RECOVERING: PhaseRule(
        frozenset({"HalvesStored", "OpReplayed"}), emits=False, then=Phase.RECOVERING
    ),
    Phase.RUNNING: PhaseRule(_LIVE, emits=True, then=Phase.RUNNING),
}
"""Which inputs each phase takes; `begin_recovery` (FRESH → RECOVERING) and
`finish_recovery` (RECOVERING → RUNNING) are the phase's own moves."""


class TransactionTable(Replay):
    """Open transactions of one partition, their deadlines, and what to do next."""

    def __init__(
        self, config: CoordinatorConfig | None = None, *, rng: random.Random | None = None
    ) -> None:
        self.config = config or CoordinatorConfig()
        self.counters = Counters()
        self.phase = Phase.FRESH
        self._rng = rng or random.Random()
        self._open: dict[str, Txn] = {}
        self._recent = RecentOutcomes(self.config.recent_outcomes)
        self._deadlines = Deadlines()
        self._ops_in_flight: dict[int, tuple[OpRecord, ...]] = {}
        self._op_ids = itertools.count(1)
        # Random start: an answer to a check sent before a restart cannot match a new one.
        self._next_check_id = self._rng.getrandbits(48)
        self._half_tail = 0
        self._half_tail_floor = 1
        self._op_tail = 0
        self._replay_op_from: int | None = None
        self._effects: list[Effect] = []  # of applied events, not yet handed out
        self._records: list[OpRecord] = []
        self._step_effects: list[Effect] = []  # of the event being applied
        self._step_records: list[OpRecord] = []
        self._touched: dict[str, SavedTxn | None] = {}
        """Each transaction a row of the event ran on, as it was (None: not in memory)."""
        self._leaving: dict[str, TxnState] = {}
        """Transactions the event finished or forgot: they leave memory when it succeeds."""

    # ------------------------------------------------------------------ inputs

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Apply one event; return the effects to carry out, in order."""
        return self.handle_batch((event,), now)

    def handle_batch(self, events: Iterable[Event], now: float) -> list[Effect]:
        """Apply several events, each as one unit; their op records share one `PersistOp`.
        An event that fails raises with the error's `event` set to it."""
        for event in events:
            try:
                self._unit(self._apply, event, now)
            except CoordinatorStateError as error:
                error.event = event
                raise
        return self._end_step()

    def tick(self, now: float) -> list[Effect]:
        """Act on every deadline due at `now`: send checks, time them out, discard, forget.

        A due transaction whose move fails (a bug) is left as it was, but without its
        deadline, so that the bug does not fire again at every tick (recovery schedules it
        again); the due ones after it keep theirs, for the next tick.
        """
        self._phase_rule("tick")
        due = self._deadlines.pop_due(now)
        for i, txid in enumerate(due):
            try:
                self._unit(self._fire, txid, K.DUE, None, now)
            except BaseException:
                for later in due[i + 1 :]:
                    self._schedule(self._open[later])
                raise
        self.phase = PHASES[self.phase].then
        return self._end_step()

    def begin_recovery(
        self, *, half_from: int, op_from: int, discarded: Iterable[ParkedTxn] = ()
    ) -> None:
        """Start replaying: restore the `discarded` transactions, feed `HalvesStored` from
        TXN_HALF `half_from`, then `OpReplayed` from TXN_OP `op_from` (all three from a
        `checkpoint()` saved earlier), then `finish_recovery`."""
        if self.phase is not Phase.FRESH:
            raise CoordinatorStateError(f"can't begin recovery in phase {self.phase}")
        self.phase = Phase.RECOVERING
        self._replay_op_from = op_from
        self._half_tail = half_from - 1
        self._half_tail_floor = 1  # nothing is known of the halves before `half_from`
        self._op_tail = op_from - 1
        for parked in discarded:
            if parked.halves:
                self._open[parked.txid] = unparked(parked, op_from)

    def finish_recovery(self, now: float) -> list[Effect]:
        """Resume work: republish commits without `done`, schedule every pending check."""
        if self.phase is not Phase.RECOVERING:
            raise CoordinatorStateError(f"can't finish recovery in phase {self.phase}")
        self.phase = Phase.RUNNING
        self._replay_op_from = None
        # Metrics count what this process did; re-reading the streams did nothing new.
        self.counters = Counters(
            replay_skipped=self.counters.replay_skipped, quarantined=self.counters.quarantined
        )
        for txn in self._open.values():
            if txn.state is PUBLISHING:
                self._publish_all(txn)
            elif txn.state is PREPARED:
                if txn.check_times:
                    txn.next_check_at = now + self.config.check_delay(txn.check_times, self._rng)
                else:
                    txn.next_check_at = max(txn.next_check_at, now)
            self._schedule(txn)
        self._effects.extend(self._step_effects)
        self._step_effects.clear()
        return self._end_step()

    # ------------------------------------------------------------------ dispatch

    def _unit(self, apply: Callable[..., None], *args: Any) -> None:
        """Apply one event as a unit: keep all it did if all of it succeeded, else nothing."""
        # What it puts back besides its transactions if it fails.
        counts = self.counters.__dict__.copy()
        half_tail, tail_floor = self._half_tail, self._half_tail_floor
        next_check_id = self._next_check_id
        try:
            apply(*args)
        except BaseException:
            for txid, saved in self._touched.items():
                if saved is None:
                    self._open.pop(txid, None)
                else:
                    put_back(self._open[txid], saved)
            self.counters = Counters(**counts)
            self._half_tail, self._half_tail_floor = half_tail, tail_floor
            self._next_check_id = next_check_id
            self._end_unit()
            raise
        leaving = self._leaving
        if leaving:
            for txid, final in leaving.items():
                left = self._open.pop(txid)
                self._recent.remember(txid, Outcome(final, left.token))
            leaving.clear()
        rule = PHASES[self.phase]
        self.phase = rule.then
        step_effects, step_records, touched = (
            self._step_effects,
            self._step_records,
            self._touched,
        )
        if rule.emits:
            if step_effects:
                self._effects.extend(step_effects)
                step_effects.clear()
            if step_records:
                self._records.extend(step_records)
                step_records.clear()
            opened = self._open
            for txid in touched:
                txn = opened.get(txid)
                if txn is None:
                    self._deadlines.cancel(txid)
                else:
                    self._schedule(txn)
        else:
            step_effects.clear()
            step_records.clear()
        touched.clear()

    def _end_unit(self) -> None:
        self._step_effects.clear()
        self._step_records.clear()
        self._touched.clear()
        self._leaving.clear()

    def _apply(self, event: Event, now: float) -> None:
        event_type = type(event)
        name = event_type.__name__
        if name not in PHASES[self.phase].accepts:  # `_phase_rule`, inlined: per event
            self._phase_rule(name)
        if event_type in _PER_TXN:
            # Most events, found by their exact type: each class pattern below that fails
            # costs an `isinstance` through `type.__instancecheck__` (an exact one is cheap).
            one: PerTxnEvent = event  # type: ignore[assignment]  # its type is in _PER_TXN
            empty = event_type is HalvesStored and isinstance(one, HalvesStored) and not one.halves
            if not empty:
                self._fire(one.txid, kind_of(one), one, now)
                return
        match event:
            case OpPersisted():
                self._written(event, now)
            case OpReplayed():
                for record in event.records:
                    kind = record_kind(record, replayed=True)
                    if kind is not None:
                        self._fire(record.txid, kind, record, now)
                self._op_tail = max(self._op_tail, event.seq)
            case HalvesStored(halves=()):
                raise CoordinatorStateError(f"HalvesStored for {event.txid} without halves")
            case _:
                self._fire(event.txid, kind_of(event), event, now)

    def _written(self, event: OpPersisted, now: float) -> None:
        """Each record of the op is one row; all of them are checked before any applies."""
        records = self._ops_in_flight.get(event.op_id)
        if records is None:
            raise CoordinatorStateError(f"OpPersisted for op {event.op_id}, which is not in flight")
        fired: list[tuple[OpRecord, Kind]] = []
        after: dict[str, Where] = {}
        opened = self._open
        for record in records:
            kind = record_kind(record, replayed=False)
            if kind is None:
                continue  # advisory: only recovery reads them
            txid = record.txid
            where = after.get(txid)
            if where is None:
                txn = opened.get(txid)
                where = self.where(txid) if txn is None else txn.state
            [after[txid]] = self._row(txid, where, kind).to
            fired.append((record, kind))
        for record, kind in fired:
            self._fire(record.txid, kind, record, now)
        del self._ops_in_flight[event.op_id]
        self._op_tail = max(self._op_tail, event.seq)

    def _fire(self, txid: str, kind: Kind, event: Any, now: float) -> None:
        """Run the row's move, and refuse the state it moves to unless the row lists it."""
        # `where` and `_row` inlined: one lookup of the transaction, five fires a transaction.
        txn = self._open.get(txid)
        where = self.where(txid) if txn is None else txn.state
        row = TABLE.get((where, kind))
        if row is None:
            raise CoordinatorStateError(f"can't handle {kind} in state {where} for {txid}")
        touched = self._touched
        if txid not in touched:
            touched[txid] = None if txn is None else save(txn)
        target = row.move(self, txn, event, now)
        if target is None or target == where:
            return  # it stays
        if target not in row.to:
            raise CoordinatorStateError(f"can't move {txid} from {where} to {target} on {kind}")
        self._move_to(self._open[txid], target)

    def _row(self, txid: str, where: Where, kind: Kind) -> Row:
        row = TABLE.get((where, kind))
        if row is None:
            raise CoordinatorStateError(f"can't handle {kind} in state {where} for {txid}")
        return row

    def _phase_rule(self, name: str) -> None:
        if name not in PHASES[self.phase].accepts:
            raise CoordinatorStateError(f"can't handle {name} in phase {self.phase}")

    def _move_to(self, txn: Txn, target: Where) -> None:
        """The only assignment of a transaction's state (one that leaves memory, FINAL or
        FORGOTTEN, is carried out by `_unit` once the event succeeded)."""
        if target in LEAVES_MEMORY:
            final = DISCARDED if target is FORGOTTEN else _state(target)
            self._leaving[txn.txid] = final
            txn.state = final
        else:
            txn.state = _state(target)

    def _schedule(self, txn: Txn) -> None:
        """Keep the one deadline a transaction has in its state."""
        state = txn.state
        if state is PREPARED:
            retention_at = txn.born + self.config.half_retention
            self._deadlines.set(txn.txid, min(txn.next_check_at, retention_at))
        elif state is CHECKING:
            retention_at = txn.born + self.config.half_retention
            self._deadlines.set(txn.txid, min(txn.check_expires_at, retention_at))
        elif state is DISCARDED:
            self._deadlines.set(txn.txid, txn.born + self.config.half_retention)
        else:
            self._deadlines.cancel(txn.txid)  # waiting for a write, which the actor retries

    def _end_step(self) -> list[Effect]:
        effects, self._effects = self._effects, []
        if self._records:
            op_id = next(self._op_ids)
            records, self._records = tuple(self._records), []
            self._ops_in_flight[op_id] = records
            effects.append(PersistOp(op_id=op_id, records=records))
        return effects


def _state(where: Where) -> TxnState:
    """`TxnState(where)` without the enum's call (Python code of its own, five a transaction)
    when `where` is one already."""
    return where if isinstance(where, TxnState) else TxnState(where)
