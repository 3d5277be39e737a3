"""The rows' work: what each (state, event) pair of `table.TABLE` does besides moving state.

A row names where the transaction goes, or that it stays (`REFUSE`, `IGNORE`, `REANSWER`);
its move does that work and nothing else: the states a move picks from are its row's, the
refusal it words is one its row names. Each move takes the transaction (None when it is
not in memory), the event and `now`, and returns the state it moves to (None: it stays, as
it may on a guard its event fails: a wrong token, an answer to another check). It never
assigns `txn.state`; `table.py` does, the one place a transaction's state changes, and
only to a state the row names. A move checks everything that could make it fail before it
changes anything; should it fail all the same (or return a state its row does not name),
the table puts back what it changed.
Moves emit effects and op records into the current step (`_emit`, `_persist`); the table
hands them out only once the whole event succeeded.
"""

from __future__ import annotations

import operator
import random

from txactors.coordinator.core import admission
from txactors.coordinator.core.effects import (
    Acknowledge,
    CheckTarget,
    Discard,
    Effect,
    Publish,
    Refuse,
    SendCheck,
)
from txactors.coordinator.core.errors import CoordinatorStateError
from txactors.coordinator.core.events import (
    CheckAnswered,
    CheckFailed,
    CheckFailure,
    End,
    HalvesRefused,
    HalvesStored,
    OperatorDecided,
    Published,
)
from txactors.coordinator.core.reads import Reads
from txactors.coordinator.core.records import Decision, DiscardReason, OpKind, OpRecord
from txactors.coordinator.core.states import (
    CHECKING,
    COMMITTED,
    COMMITTING,
    DISCARDED,
    DISCARDING,
    FINAL,
    FINISHING,
    FORGOTTEN,
    PREPARED,
    PUBLISHING,
    ROLLED_BACK,
    ROLLING_BACK,
    TxnState,
    Where,
)
from txactors.coordinator.core.transactions import Counters, Txn
from txactors.wire.protocol import ErrorCode, Resolution
from txactors.wire.rules import CoordinatorConfig

_SEQ, _BORN = operator.attrgetter("seq"), operator.attrgetter("born")
_IMMUNITY = operator.attrgetter("immunity")
"""A half's fields, read in C by `map` (a generator resumes its frame per half)."""


_ANSWERED_NOW = frozenset({*FINAL, FINISHING})
"""States in which a repeated decision is acknowledged at once (FINISHING: all published)."""


def _forced(event: OperatorDecided) -> Decision:
    return Decision.COMMIT if event.resolution is Resolution.COMMIT else Decision.ROLLBACK


class Moves(Reads):
    """The live rows' moves, a base of `TransactionTable`: the data below is the table's."""

    config: CoordinatorConfig
    counters: Counters
    _rng: random.Random
    _next_check_id: int
    _replay_op_from: int | None
    _half_tail_floor: int
    """The op floor given when `_half_tail` was last raised (`_op_floor_for`)."""
    _step_effects: list[Effect]
    _step_records: list[OpRecord]

    # ------------------------------------------------------------ requests

    def store_halves(self, txn: Txn | None, event: HalvesStored, now: float) -> Where | None:
        refusal = admission.refuse_prepare(
            txn,
            self._recent.get(event.txid),
            event.txid,
            event.token,
            event.group,
            begins=event.begins,
        )
        if refusal is not None:
            self._refuse(event.request_id, event.txid, *refusal)
            return None
        first_seq = min(map(_SEQ, event.halves))
        target: Where | None = None
        if txn is None:
            txn = Txn(
                txid=event.txid,
                token=event.token,
                group=event.group,
                producer=event.producer,
                state=PREPARED,
                halves={},
                first_seq=first_seq,
                born=min(map(_BORN, event.halves)),
                op_floor=self._op_floor_for(first_seq),
            )
            self._open[txn.txid] = txn
            target = PREPARED
        elif first_seq < txn.first_seq:
            txn.first_seq = first_seq
            txn.op_floor = min(txn.op_floor, self._op_floor_for(first_seq))
        new = [h for h in event.halves if h.index not in txn.halves]  # a retried prepare adds none
        if new:  # replaced, not changed in place: the table's copy of the txn shares it
            txn.halves = {**txn.halves, **{h.index: h for h in new}}
        txn.born = min([txn.born, *map(_BORN, new)])
        self.counters.halves_stored += len(new)
        last_seq = max(map(_SEQ, event.halves))
        if last_seq > self._half_tail:  # known from now on: so is the rest of its pack
            self._half_tail_floor = self._op_floor_for(last_seq)
            self._half_tail = last_seq
        if txn.state is PREPARED and txn.check_times == 0:
            # The newest half is left alone for the longest immunity of any half.
            immunity = max(map(self.config.immunity, map(_IMMUNITY, txn.halves.values())))
            txn.next_check_at = max(map(_BORN, txn.halves.values())) + immunity
        if event.request_id is not None:
            self._emit(Acknowledge(request_id=event.request_id, txid=txn.txid, state=txn.state))
        return target

    def refuse_halves(self, txn: Txn | None, event: HalvesStored, now: float) -> None:
        refusal = admission.refuse_prepare(
            txn,
            self._recent.get(event.txid),
            event.txid,
            event.token,
            event.group,
            begins=event.begins,
        )
        assert refusal is not None  # a decided or finished one takes no halves
        self._refuse(event.request_id, event.txid, *refusal)

    def roll_back_refused(self, txn: Txn | None, event: HalvesRefused, now: float) -> Where | None:
        if self._refused_end(txn, event.txid, event.token, None):
            return None
        assert txn is not None  # admitted: an open one
        return self._decide(txn, Decision.ROLLBACK, None, by_operator=False)

    def refuse_roll_back(self, txn: Txn | None, event: HalvesRefused, now: float) -> None:
        """Decided meanwhile (it cannot be rolled back): counted as a refusal, to nobody."""
        if not self._refused_end(txn, event.txid, event.token, None):
            self._refuse_decision(event.txid, Decision.ROLLBACK, None)

    def end(self, txn: Txn | None, event: End, now: float) -> Where | None:
        if self._refused_end(txn, event.txid, event.token, event.request_id):
            return None
        assert txn is not None  # admitted: an open one
        return self._decide(txn, event.decision, event.request_id, by_operator=False)

    def reanswer_end(self, txn: Txn | None, event: End, now: float) -> None:
        if self._refused_end(txn, event.txid, event.token, event.request_id):
            return
        if event.decision is Decision.UNKNOWN:
            # Not a decision: the transaction waits for the checker as it was.
            self.counters.unknown_ends += 1
            state = self.outcome(event.txid)
            assert state is not None  # admitted: a known one
            self._emit(Acknowledge(request_id=event.request_id, txid=event.txid, state=state))
        else:
            self._reanswer(txn, event.txid, event.request_id)

    def refuse_end(self, txn: Txn | None, event: End, now: float) -> None:
        if not self._refused_end(txn, event.txid, event.token, event.request_id):
            self._refuse_decision(event.txid, event.decision, event.request_id)

    def force(self, txn: Txn | None, event: OperatorDecided, now: float) -> Where | None:
        assert txn is not None  # an undecided or discarded one
        return self._decide(txn, _forced(event), event.request_id, by_operator=True)

    def reanswer_force(self, txn: Txn | None, event: OperatorDecided, now: float) -> None:
        self._reanswer(txn, event.txid, event.request_id)

    def refuse_force(self, txn: Txn | None, event: OperatorDecided, now: float) -> None:
        self._refuse_decision(event.txid, _forced(event), event.request_id)

    def resume(self, txn: Txn | None, event: OperatorDecided, now: float) -> Where | None:
        assert txn is not None  # an undecided or discarded one
        txn.next_check_at = now
        target = self._reset_checks(txn)
        self._persist(OpRecord(txid=txn.txid, kind=OpKind.RESUME))
        # CHECKING keeps its check in flight; PREPARED is due now.
        self._emit(
            Acknowledge(request_id=event.request_id, txid=txn.txid, state=target or txn.state)
        )
        return target

    def refuse_resume(self, txn: Txn | None, event: OperatorDecided, now: float) -> None:
        state = self.outcome(event.txid)
        code = ErrorCode.NOT_FOUND if state is None else ErrorCode.CONFLICT
        message = f"transaction {event.txid} is {state or 'unknown'}; nothing to resume"
        self._refuse(event.request_id, event.txid, code, message)

    # ------------------------------------------------------------ check-backs

    def check_answered(self, txn: Txn | None, event: CheckAnswered, now: float) -> Where | None:
        assert txn is not None  # CHECKING, or PREPARED after a check timed out
        if txn.state is CHECKING and txn.check_id == event.check_id:
            txn.last_check = str(event.resolution)
            if event.resolution is Decision.UNKNOWN:
                return self._inconclusive(txn, now)
            return self._checked(txn, event.resolution)
        if (
            txn.state is PREPARED
            and txn.timed_out_check_id == event.check_id
            and event.resolution is not Decision.UNKNOWN
        ):
            # A slow producer's answer: nothing newer was asked, so it is still the truth.
            self.counters.late_check_answers += 1
            txn.last_check = str(event.resolution)
            return self._checked(txn, event.resolution)
        self.unexpected_answer(txn, event, now)
        return None

    def unexpected_answer(self, txn: Txn | None, event: CheckAnswered, now: float) -> None:
        """An answer that cannot decide (a newer check is out, or it was decided)."""
        self.counters.unexpected_check_answers += 1

    def _checked(self, txn: Txn, resolution: Decision) -> TxnState:
        """Decide as a check-back answered; a rollback answered by the group (another member
        than the instance that prepared it: with the log, its claim) is counted."""
        if resolution is Decision.ROLLBACK and txn.check_target is CheckTarget.GROUP:
            self.counters.group_check_rollbacks += 1
        return self._decide(txn, resolution, None, by_operator=False)

    def check_failed(self, txn: Txn | None, event: CheckFailed, now: float) -> Where | None:
        assert txn is not None  # CHECKING
        if txn.check_id != event.check_id:
            return None  # an earlier check's, timed out here already
        return self._check_failed(txn, event.reason, now)

    def due(self, txn: Txn | None, event: object, now: float) -> Where | None:
        assert txn is not None  # only open transactions have deadlines
        if txn.state is DISCARDED:
            self.counters.forgotten += 1
            return FORGOTTEN
        if now >= txn.born + self.config.half_retention:
            return self._discard(txn, DiscardReason.RETENTION)
        if txn.state is CHECKING:
            return self._check_failed(txn, CheckFailure.TIMEOUT, now)
        return self._send_check(txn, now)

    # ------------------------------------------------------------ writes done

    def published(self, txn: Txn | None, event: Published, now: float) -> Where | None:
        assert txn is not None
        if event.index not in txn.halves:
            raise CoordinatorStateError(f"Published for {event.txid} unknown index {event.index}")
        txn.published.add(event.index)
        if len(txn.published) < len(txn.halves):
            return None
        self._persist(OpRecord(txid=txn.txid, kind=OpKind.DONE))
        # Every message is durable on its topic, so the commit is visible: the producer
        # hears it now. `done` only spares recovery a (deduplicated) republish.
        for request_id in txn.waiters:
            self._emit(Acknowledge(request_id=request_id, txid=txn.txid, state=COMMITTED))
        txn.waiters.clear()
        return FINISHING

    def commit_written(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        self._publish_all(txn)
        return PUBLISHING

    def rollback_written(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        return self._finish(txn, ROLLED_BACK)

    def done_written(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        return self._finish(txn, COMMITTED)

    def discard_written(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
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
        return DISCARDED

    def ignore(self, txn: Txn | None, event: object, now: float) -> Where | None:
        """Nothing to do: e.g. the ack of a retried publish, after the first one counted."""
        return None

    # ------------------------------------------------------------ shared steps

    def _reanswer(self, txn: Txn | None, txid: str, request_id: str | None) -> None:
        """A decision repeated: acknowledged now if final (or all published), else once it
        is."""
        if request_id is None:
            return
        state = self.outcome(txid)
        if txn is not None and state not in _ANSWERED_NOW:
            txn.waiters.append(request_id)
        else:
            final = COMMITTED if state is FINISHING else state
            assert final is not None  # a known one
            self._emit(Acknowledge(request_id=request_id, txid=txid, state=final))

    def _refuse_decision(self, txid: str, decision: Decision, request_id: str | None) -> None:
        """The transaction cannot be decided so (DISCARDED is decided for producers)."""
        state = self.outcome(txid)
        if state is None:
            self._refuse(request_id, txid, ErrorCode.NOT_FOUND, f"no transaction {txid}")
        elif state is DISCARDED:
            message = f"transaction {txid} was discarded; an operator may resume or force it"
            self._refuse(request_id, txid, ErrorCode.CONFLICT, message)
        else:
            message = f"transaction {txid} is {state}; it cannot {decision}"
            self._refuse(request_id, txid, ErrorCode.CONFLICT, message)

    def _refused_end(self, txn: Txn | None, txid: str, token: str, request_id: str | None) -> bool:
        """Whether an end is refused for its token (or an unknown transaction); if so, the
        refusal is emitted."""
        refusal = admission.refuse_end(txn, self._recent.get(txid), txid, token)
        if refusal is not None:
            self._refuse(request_id, txid, *refusal)
        return refusal is not None

    def _decide(
        self, txn: Txn, decision: Decision, request_id: str | None, *, by_operator: bool
    ) -> TxnState:
        txn.check_id = None  # a late answer to an in-flight check is now unexpected
        txn.timed_out_check_id = None
        if request_id is not None:
            txn.waiters.append(request_id)
        if decision is Decision.COMMIT:
            seqs = tuple(map(_SEQ, txn.ordered_halves()))
            self._persist(
                OpRecord(txid=txn.txid, kind=OpKind.COMMIT, half_seqs=seqs, by_operator=by_operator)
            )
            return COMMITTING
        self._persist(OpRecord(txid=txn.txid, kind=OpKind.ROLLBACK, by_operator=by_operator))
        return ROLLING_BACK

    def _send_check(self, txn: Txn, now: float) -> TxnState:
        txn.check_id = self._next_check_id
        self._next_check_id += 1
        txn.timed_out_check_id = None  # only the newest question's answer may decide
        txn.check_target = CheckTarget.GROUP if txn.instance_gone else CheckTarget.INSTANCE
        txn.check_expires_at = now + self.config.check_answer_timeout
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
                last=txn.check_times + 1 >= self.config.check_max,
            )
        )
        return CHECKING

    def _check_failed(self, txn: Txn, reason: CheckFailure, now: float) -> TxnState:
        txn.last_check = str(reason)
        if reason is CheckFailure.TIMEOUT:
            txn.timed_out_check_id = txn.check_id
        if txn.check_target is CheckTarget.INSTANCE and reason is CheckFailure.NO_RESPONDERS:
            # The instance is gone: ask the group, at once and from now on; this check did
            # not happen. A timeout or an error is not that: the instance may be alive and
            # merely slow (its database busy), and another member would then decide for it
            # what it is about to decide itself (with the log: claim it, rolled back).
            txn.instance_gone = True
            return self._send_check(txn, now)
        return self._inconclusive(txn, now)

    def _inconclusive(self, txn: Txn, now: float) -> TxnState:
        txn.check_id = None
        txn.check_times += 1
        self.counters.checks_inconclusive += 1
        self._persist(OpRecord(txid=txn.txid, kind=OpKind.CHECKED, check_times=txn.check_times))
        if txn.check_times >= self.config.check_max:
            return self._discard(txn, DiscardReason.CHECK_MAX)
        txn.next_check_at = now + self.config.check_delay(txn.check_times, self._rng)
        return PREPARED

    def _discard(self, txn: Txn, reason: DiscardReason) -> TxnState:
        txn.check_id = None
        txn.discard_reason = reason
        self._persist(
            OpRecord(
                txid=txn.txid,
                kind=OpKind.DISCARD,
                half_seqs=tuple(map(_SEQ, txn.ordered_halves())),
                check_times=txn.check_times,
                reason=reason,
            )
        )
        return DISCARDING

    def _reset_checks(self, txn: Txn) -> TxnState | None:
        txn.check_times = 0
        txn.instance_gone = False
        txn.discard_reason = None
        return PREPARED if txn.state is DISCARDED else None

    def _finish(self, txn: Txn, state: TxnState) -> TxnState:
        if state is COMMITTED:
            self.counters.commits += 1
        else:
            self.counters.rollbacks += 1
        for request_id in txn.waiters:
            self._emit(Acknowledge(request_id=request_id, txid=txn.txid, state=state))
        return state

    def _publish_all(self, txn: Txn) -> None:
        for half in txn.ordered_halves():
            self._emit(
                Publish(txid=txn.txid, index=half.index, topic=half.topic, half_seq=half.seq)
            )

    # ------------------------------------------------------------ plumbing

    def _op_floor_for(self, first_seq: int) -> int:
        """The first TXN_OP sequence that can hold a record of a transaction whose first half
        is at `first_seq`. Halves sharing a sequence (one pack) were known at one moment:
        the floor given when `_half_tail` reached it holds for each of them."""
        if self._replay_op_from is not None:
            return self._replay_op_from  # the saved checkpoint already covered it
        if first_seq > self._half_tail:
            return self._op_tail + 1
        if first_seq == self._half_tail:
            return self._half_tail_floor
        return 1  # fed out of TXN_HALF order: only the stream start is surely early enough

    def _emit(self, effect: Effect) -> None:
        self._step_effects.append(effect)

    def _persist(self, record: OpRecord) -> None:
        self._step_records.append(record)

    def _refuse(self, request_id: str | None, txid: str, code: ErrorCode, message: str) -> None:
        self.counters.refusals += 1
        if request_id is not None:
            self._emit(Refuse(request_id=request_id, txid=txid, code=code, message=message))
