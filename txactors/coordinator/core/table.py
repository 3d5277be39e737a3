"""The coordinator's transition table: (state, event) → where the transaction goes, with no I/O.

`TABLE` is the table, as data (h11's `_state.py` rule), read top to bottom: for each `Where`
a transaction can be (its `TxnState`, or not in memory) and each `Kind` of event, the state
it goes to (or the states, of which the move picks one), or `Stays`: `REFUSE` (a request
answered with an error), `IGNORE` (nothing to do), `REANSWER` (a request answered as the
transaction stands). The moves (`moves.py`, `replay.py`; `MOVES`, `STAYS`) only do the work
the row names. This module is the one place a transaction's state changes (`_move_to`). A
pair without a row is a bug in the caller: it raises `CoordinatorStateError("can't handle
<kind> in state <where> for <txid>")` and changes nothing. A move to a state its row does
not name is a bug in the move: it raises `CoordinatorStateError("can't move <txid> from
<where> to <target> on <kind>")`, and what the move had changed is put back (`_fire`,
`_unit`). A move may always stay, on a guard its event fails (a wrong token, an answer to
another check). The table itself has a `Phase` (`PHASES`): recovery is the RECOVERING
phase, which accepts only replayed input and holds every effect back, not a flag checked
here and there.

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

import enum
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
    DISCARDED,
    DISCARDING,
    FINISHING,
    FORGOTTEN,
    LEAVES_MEMORY,
    PREPARED,
    PUBLISHING,
    ROLLED_BACK,
    ROLLING_BACK,
    UNKNOWN,
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


class Stays(enum.Enum):
    """A row whose event leaves the transaction where it is, and what it does instead."""

    REFUSE = "refuse"  # refused and counted; a request is answered with an error (`Refuse`)
    IGNORE = "ignore"  # nothing to do (a stale answer, a duplicate ack, an old record)
    REANSWER = "reanswer"  # a request answered as the transaction stands, now or once final


REFUSE, IGNORE, REANSWER = Stays.REFUSE, Stays.IGNORE, Stays.REANSWER
Target = Where | frozenset[Where] | Stays

TABLE: dict[Where, dict[Kind, Target]] = {
    PREPARED: {
        K.HALVES: PREPARED,
        K.HALVES_REFUSED: ROLLING_BACK,
        K.END_COMMIT: COMMITTING,
        K.END_ROLLBACK: ROLLING_BACK,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: COMMITTING,
        K.FORCE_ROLLBACK: ROLLING_BACK,
        K.RESUME: PREPARED,
        K.CHECK_ANSWERED: frozenset({COMMITTING, ROLLING_BACK}),  # late, to a timed-out check
        K.CHECK_FAILED: IGNORE,
        K.DUE: frozenset({CHECKING, DISCARDING}),
        K.COMMIT_REPLAYED: PUBLISHING,
        K.ROLLBACK_REPLAYED: ROLLED_BACK,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: DISCARDED,
        K.CHECKED_REPLAYED: PREPARED,
        K.RESUME_REPLAYED: PREPARED,
    },
    CHECKING: {
        K.HALVES: CHECKING,
        K.HALVES_REFUSED: ROLLING_BACK,
        K.END_COMMIT: COMMITTING,
        K.END_ROLLBACK: ROLLING_BACK,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: COMMITTING,
        K.FORCE_ROLLBACK: ROLLING_BACK,
        K.RESUME: CHECKING,
        K.CHECK_ANSWERED: frozenset({COMMITTING, ROLLING_BACK, PREPARED, DISCARDING}),
        K.CHECK_FAILED: frozenset({PREPARED, DISCARDING, CHECKING}),  # CHECKING: ask the group
        K.DUE: frozenset({PREPARED, DISCARDING}),
        K.COMMIT_REPLAYED: PUBLISHING,
        K.ROLLBACK_REPLAYED: ROLLED_BACK,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: DISCARDED,
        K.CHECKED_REPLAYED: CHECKING,
        K.RESUME_REPLAYED: CHECKING,
    },
    COMMITTING: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: REFUSE,  # decided meanwhile: what landed stays
        K.END_COMMIT: REANSWER,  # once all is published
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REANSWER,
        K.FORCE_ROLLBACK: REFUSE,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.COMMIT_WRITTEN: PUBLISHING,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    PUBLISHING: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: REFUSE,
        K.END_COMMIT: REANSWER,
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REANSWER,
        K.FORCE_ROLLBACK: REFUSE,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.PUBLISHED: frozenset({PUBLISHING, FINISHING}),  # FINISHING: the last of its halves
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: COMMITTED,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    FINISHING: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: REFUSE,
        K.END_COMMIT: REANSWER,
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REANSWER,
        K.FORCE_ROLLBACK: REFUSE,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.PUBLISHED: IGNORE,  # the ack of a retried publish
        K.DONE_WRITTEN: COMMITTED,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    COMMITTED: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: REFUSE,
        K.END_COMMIT: REANSWER,
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REANSWER,
        K.FORCE_ROLLBACK: REFUSE,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.PUBLISHED: IGNORE,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    ROLLING_BACK: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: IGNORE,
        K.END_COMMIT: REFUSE,
        K.END_ROLLBACK: REANSWER,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REFUSE,
        K.FORCE_ROLLBACK: REANSWER,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.ROLLBACK_WRITTEN: ROLLED_BACK,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    ROLLED_BACK: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: IGNORE,
        K.END_COMMIT: REFUSE,
        K.END_ROLLBACK: REANSWER,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REFUSE,
        K.FORCE_ROLLBACK: REANSWER,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    DISCARDING: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: REFUSE,
        K.END_COMMIT: REFUSE,
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REFUSE,
        K.FORCE_ROLLBACK: REFUSE,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.DISCARD_WRITTEN: DISCARDED,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    DISCARDED: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: REFUSE,
        K.END_COMMIT: REFUSE,
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: COMMITTING,
        K.FORCE_ROLLBACK: ROLLING_BACK,
        K.RESUME: PREPARED,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.DUE: FORGOTTEN,  # at half_retention
        K.COMMIT_REPLAYED: PUBLISHING,
        K.ROLLBACK_REPLAYED: ROLLED_BACK,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: PREPARED,
    },
    UNKNOWN: {
        K.HALVES: PREPARED,
        K.HALVES_REFUSED: IGNORE,  # none landed
        K.END_COMMIT: REFUSE,
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REFUSE,
        K.FORCE_COMMIT: REFUSE,
        K.FORCE_ROLLBACK: REFUSE,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
    FORGOTTEN: {
        K.HALVES: REFUSE,
        K.HALVES_REFUSED: REFUSE,
        K.END_COMMIT: REFUSE,
        K.END_ROLLBACK: REFUSE,
        K.END_UNKNOWN: REANSWER,
        K.FORCE_COMMIT: REFUSE,
        K.FORCE_ROLLBACK: REFUSE,
        K.RESUME: REFUSE,
        K.CHECK_ANSWERED: IGNORE,
        K.CHECK_FAILED: IGNORE,
        K.COMMIT_REPLAYED: IGNORE,
        K.ROLLBACK_REPLAYED: IGNORE,
        K.DONE_REPLAYED: IGNORE,
        K.DISCARD_REPLAYED: IGNORE,
        K.CHECKED_REPLAYED: IGNORE,
        K.RESUME_REPLAYED: IGNORE,
    },
}
"""Where each event takes a transaction, by where it is: a state (or one of a set), or
`Stays`. A pair without a row is a bug in the caller. A request refused by admission (its
token, its group) and a check answer to another check than the one in flight change
nothing whatever the row names."""

WHERE: tuple[Where, ...] = (*TxnState, *Gone)

MOVES: dict[Kind, Move] = {
    K.HALVES: Moves.store_halves,
    K.HALVES_REFUSED: Moves.roll_back_refused,
    K.END_COMMIT: Moves.end,
    K.END_ROLLBACK: Moves.end,
    K.END_UNKNOWN: Moves.end,
    K.FORCE_COMMIT: Moves.force,
    K.FORCE_ROLLBACK: Moves.force,
    K.RESUME: Moves.resume,
    K.CHECK_ANSWERED: Moves.check_answered,
    K.CHECK_FAILED: Moves.check_failed,
    K.DUE: Moves.due,
    K.PUBLISHED: Moves.published,
    K.COMMIT_WRITTEN: Moves.commit_written,
    K.ROLLBACK_WRITTEN: Moves.rollback_written,
    K.DONE_WRITTEN: Moves.done_written,
    K.DISCARD_WRITTEN: Moves.discard_written,
    K.COMMIT_REPLAYED: Replay.commit_replayed,
    K.ROLLBACK_REPLAYED: Replay.rollback_replayed,
    K.DONE_REPLAYED: Replay.done_replayed,
    K.DISCARD_REPLAYED: Replay.discard_replayed,
    K.CHECKED_REPLAYED: Replay.checked_replayed,
    K.RESUME_REPLAYED: Replay.resume_replayed,
}
"""The work of a row that names where the transaction goes."""

STAYS: dict[tuple[Stays, Kind], Move] = {
    (REFUSE, K.HALVES): Moves.refuse_halves,
    (REFUSE, K.HALVES_REFUSED): Moves.refuse_roll_back,
    (IGNORE, K.HALVES_REFUSED): Moves.ignore,
    (REFUSE, K.END_COMMIT): Moves.refuse_end,
    (REFUSE, K.END_ROLLBACK): Moves.refuse_end,
    (REFUSE, K.END_UNKNOWN): Moves.refuse_end,
    (REANSWER, K.END_COMMIT): Moves.reanswer_end,
    (REANSWER, K.END_ROLLBACK): Moves.reanswer_end,
    (REANSWER, K.END_UNKNOWN): Moves.reanswer_end,
    (REFUSE, K.FORCE_COMMIT): Moves.refuse_force,
    (REFUSE, K.FORCE_ROLLBACK): Moves.refuse_force,
    (REANSWER, K.FORCE_COMMIT): Moves.reanswer_force,
    (REANSWER, K.FORCE_ROLLBACK): Moves.reanswer_force,
    (REFUSE, K.RESUME): Moves.refuse_resume,
    (IGNORE, K.CHECK_ANSWERED): Moves.unexpected_answer,
    (IGNORE, K.CHECK_FAILED): Moves.ignore,
    (IGNORE, K.PUBLISHED): Moves.ignore,
    (IGNORE, K.COMMIT_REPLAYED): Replay.skip_replayed,
    (IGNORE, K.ROLLBACK_REPLAYED): Replay.skip_replayed,
    (IGNORE, K.DONE_REPLAYED): Replay.skip_replayed,
    (IGNORE, K.DISCARD_REPLAYED): Replay.skip_replayed,
    (IGNORE, K.CHECKED_REPLAYED): Replay.skip_replayed,
    (IGNORE, K.RESUME_REPLAYED): Replay.skip_replayed,
}
"""The work of a row that leaves the transaction where it is."""


class Row(NamedTuple):
    """A pair of `TABLE` as the table runs it."""

    move: Move
    to: frozenset[Where]
    """Where the move may take the transaction (besides staying where it is)."""


def _row(kind: Kind, target: Target) -> Row:
    if isinstance(target, Stays):
        return Row(STAYS[target, kind], frozenset())
    return Row(MOVES[kind], target if isinstance(target, frozenset) else frozenset({target}))


ROWS: dict[tuple[Where, Kind], Row] = {
    (where, kind): _row(kind, target)
    for where, row in TABLE.items()
    for kind, target in row.items()
}
"""`TABLE` with each row's move, in one lookup a pair."""


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
        row = ROWS.get((where, kind))
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
        row = ROWS.get((where, kind))
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
