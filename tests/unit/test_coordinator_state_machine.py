"""Hypothesis drives the coordinator's state machine through random histories.

The test plays a misbehaving world around it: requests with wrong tokens, check answers in
any order and late, writes and publishes acknowledged in any order or never (a crash), the
clock jumping, operators meddling, events only a buggy actor would send, and crashes that
rebuild a new table from the checkpoint by replaying the persisted records through the same
table. After every step the DESIGN §3 invariants must hold: nothing rolled back or discarded
is ever published, no persisted commit is lost, at most one check is in flight, and
`check_max` inconclusive checks end in a discard. A buggy move, one that goes to a state its
row does not list, is refused and changes nothing, however rich the history behind it.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import msgspec
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.table import astray, everything
from txactors.coordinator import (
    Acknowledge,
    Action,
    CheckAnswered,
    CheckFailed,
    CheckFailure,
    CoordinatorConfig,
    CoordinatorStateError,
    Decision,
    Discard,
    DiscardReason,
    End,
    Event,
    Half,
    HalvesStored,
    OperatorDecided,
    OpKind,
    OpPersisted,
    OpRecord,
    OpReplayed,
    PersistOp,
    Publish,
    Published,
    Refuse,
    SendCheck,
    TransactionTable,
    TxnState,
)
from txactors.coordinator.core.states import Where
from txactors.coordinator.core.table import WHERE
from txactors.wire.protocol import Resolution

CONFIG = CoordinatorConfig(
    transaction_timeout=1.0,
    max_immunity=5.0,
    check_interval=2.0,
    check_interval_max=8.0,
    check_max=2,
    check_answer_timeout=1.0,
    half_retention=300.0,
)
FINAL = {TxnState.COMMITTED, TxnState.ROLLED_BACK}
TOKEN = "tok"


class CoordinatorMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**32 - 1))
    def start(self, seed: int) -> None:
        self.seeds = itertools.count(seed)
        self.table = TransactionTable(CONFIG, rng=random.Random(next(self.seeds)))
        self.now = 1_000.0
        self.txids: list[str] = []
        self.ids = itertools.count()
        # The streams: what survives a restart.
        self.half_log: list[HalvesStored] = []
        self.op_log: list[OpReplayed] = []
        # Work the "actor" has not carried out yet (lost on a restart).
        self.pending_ops: list[PersistOp] = []
        self.pending_publishes: list[Publish] = []
        self.checks: dict[int, tuple[SendCheck, float]] = {}  # unreported, with send time
        self.reported_checks: list[SendCheck] = []
        # What the streams say, for the invariants.
        self.decision: dict[str, OpKind] = {}  # last persisted commit/rollback/discard/resume
        self.done: set[str] = set()
        self.final: dict[str, TxnState] = {}
        self.to_publish: dict[str, set[int]] = {}  # the topics survive restarts
        self.committed_halves: dict[str, set[int]] = {}  # TXN_HALF seqs of persisted commits
        self.published: dict[str, set[int]] = {}

    # ------------------------------------------------------------ plumbing

    def feed(self, event: Event) -> list[Action]:
        return self.take(self.table.handle(event, self.now))

    def take(self, actions: list[Action]) -> list[Action]:
        """Check every action against the invariants, then queue the work it asks for."""
        for action in actions:
            match action:
                case PersistOp():
                    self.pending_ops.append(action)
                case Publish():
                    # Only after a persisted commit; never for rolled back or discarded.
                    assert self.decision.get(action.txid) is OpKind.COMMIT, action
                    self.to_publish.setdefault(action.txid, set()).add(action.index)
                    self.pending_publishes.append(action)
                case SendCheck():
                    self.on_send_check(action)
                case Acknowledge(state=TxnState.COMMITTED):
                    event("commit acknowledged")
                    expected = self.to_publish.get(action.txid)
                    assert expected, "commit acknowledged before anything was published"
                    published = self.published.get(action.txid, set())
                    assert expected <= published, "commit acknowledged before all published"
                case Acknowledge(state=TxnState.ROLLED_BACK):
                    assert self.decision.get(action.txid) is OpKind.ROLLBACK
                case Discard():
                    event("discarded")
                    assert self.decision.get(action.txid) is OpKind.DISCARD
                    assert action.check_times <= CONFIG.check_max
                    if action.reason is DiscardReason.CHECK_MAX:
                        assert action.check_times == CONFIG.check_max
        return actions

    def on_send_check(self, check: SendCheck) -> None:
        assert self.decision.get(check.txid) not in (OpKind.COMMIT, OpKind.ROLLBACK)
        assert self.table.outcome(check.txid) is TxnState.CHECKING
        assert check.check_times < CONFIG.check_max
        for earlier, sent_at in self.checks.values():
            if earlier.txid == check.txid:  # unreported: only if the table gave up on it
                assert self.now >= sent_at + earlier.timeout, "two checks in flight"
        self.checks[check.check_id] = (check, self.now)

    def pick(self, index: int) -> str:
        return self.txids[index % len(self.txids)]

    # ------------------------------------------------------------ producers

    @rule(topics=st.integers(1, 3), immunity=st.sampled_from([None, 0.5, 3.0, 60.0]))
    def prepare(self, topics: int, immunity: float | None) -> None:
        txid = f"t{next(self.ids)}"
        self.txids.append(txid)
        self.store(txid, topics, immunity, first_index=0, begins=True)

    @precondition(lambda self: self.txids)
    @rule(index=st.integers(0, 99), topics=st.integers(1, 2))
    def prepare_more(self, index: int, topics: int) -> None:
        txid = self.pick(index)
        admissible = self.table.refuse_prepare(txid, TOKEN, "g", begins=False) is None
        reply = self.store(txid, topics, None, first_index=10 * len(self.half_log), begins=False)
        assert isinstance(reply, Acknowledge) == admissible

    def store(
        self, txid: str, topics: int, immunity: float | None, *, first_index: int, begins: bool
    ) -> Action:
        halves = tuple(
            Half(
                index=first_index + i,
                topic=f"topic{i}",
                seq=len(self.half_log) + i + 1,
                born=self.now,
                immunity=immunity,
            )
            for i in range(topics)
        )
        stored = HalvesStored(
            txid=txid, token=TOKEN, group="g", producer="p", halves=halves, begins=begins
        )
        # The actor appends first, then tells the table (which may refuse what it stored).
        self.half_log.extend(msgspec.structs.replace(stored, halves=(h,)) for h in halves)
        [reply] = self.feed(msgspec.structs.replace(stored, request_id="prep"))
        assert begins <= isinstance(reply, Acknowledge)
        return reply

    @precondition(lambda self: self.txids)
    @rule(
        index=st.integers(0, 99),
        decision=st.sampled_from(Decision),
        right_token=st.booleans(),
    )
    def end(self, index: int, decision: Decision, right_token: bool) -> None:
        txid = self.pick(index)
        before = self.table.show(txid)
        token = TOKEN if right_token else "forged"
        actions = self.feed(End(txid=txid, token=token, decision=decision, request_id="end"))
        if not right_token and self.table.outcome(txid) is not None:
            assert [type(a) for a in actions] == [Refuse]
            assert self.table.show(txid) == before

    # ------------------------------------------------------------ the actor's I/O

    @precondition(lambda self: self.pending_ops)
    @rule()
    def persist(self) -> None:
        op = self.pending_ops[0]  # TXN_OP appends in order
        seq = len(self.op_log) + 1
        actions = self.table.handle(OpPersisted(op_id=op.op_id, seq=seq), self.now)
        self.pending_ops.pop(0)
        self.op_log.append(OpReplayed(seq=seq, records=op.records))
        for record in op.records:
            if record.kind is OpKind.COMMIT:
                self.committed_halves[record.txid] = set(record.half_seqs)
            if record.kind is OpKind.DONE:
                self.done.add(record.txid)
            elif record.kind is not OpKind.CHECKED:
                self.decision[record.txid] = record.kind
        self.take(actions)

    @precondition(lambda self: self.pending_publishes)
    @rule(index=st.integers(0, 99), twice=st.booleans())
    def publish_acked(self, index: int, twice: bool) -> None:
        publish = self.pending_publishes[index % len(self.pending_publishes)]
        actions = self.table.handle(Published(txid=publish.txid, index=publish.index), self.now)
        self.pending_publishes.remove(publish)
        self.published.setdefault(publish.txid, set()).add(publish.index)
        self.take(actions)
        if twice:
            self.feed(Published(txid=publish.txid, index=publish.index))

    @precondition(lambda self: self.pending_ops or self.pending_publishes)
    @rule()
    def catch_up(self) -> None:
        """A healthy actor: every write and publish completes, in order."""
        while self.pending_ops or self.pending_publishes:
            if self.pending_publishes:
                self.publish_acked(0, twice=False)
            else:
                self.persist()

    @precondition(lambda self: self.checks)
    @rule(index=st.integers(0, 99), resolution=st.sampled_from(Decision))
    def check_answered(self, index: int, resolution: Decision) -> None:
        check = self.report(index)
        self.feed(CheckAnswered(txid=check.txid, check_id=check.check_id, resolution=resolution))

    @precondition(lambda self: self.checks)
    @rule(index=st.integers(0, 99), reason=st.sampled_from(CheckFailure))
    def check_failed(self, index: int, reason: CheckFailure) -> None:
        check = self.report(index)
        self.feed(CheckFailed(txid=check.txid, check_id=check.check_id, reason=reason))

    def report(self, index: int) -> SendCheck:
        check_id = list(self.checks)[index % len(self.checks)]
        check, _ = self.checks.pop(check_id)
        self.reported_checks.append(check)
        return check

    @precondition(lambda self: self.reported_checks)
    @rule(index=st.integers(0, 99), resolution=st.sampled_from(Decision))
    def stale_check_answer(self, index: int, resolution: Decision) -> None:
        check = self.reported_checks[index % len(self.reported_checks)]
        counters = self.table.counters
        unexpected, late = counters.unexpected_check_answers, counters.late_check_answers
        before = self.table.transactions()
        was = self.table.show(check.txid)
        actions = self.feed(
            CheckAnswered(txid=check.txid, check_id=check.check_id, resolution=resolution)
        )
        if counters.late_check_answers == late + 1:
            # The answer to the check that timed out last, with nothing newer asked: it
            # decides an undecided transaction, as an end would.
            assert was is not None and was.state is TxnState.PREPARED
            assert resolution is not Decision.UNKNOWN
            now = self.table.show(check.txid)
            assert now is not None
            assert now.state in (TxnState.COMMITTING, TxnState.ROLLING_BACK)
            assert [type(a) for a in actions] == [PersistOp]
        else:
            assert actions == []
            assert counters.unexpected_check_answers == unexpected + 1
            assert self.table.transactions() == before

    @rule(seconds=st.floats(0.0, 10.0, allow_nan=False))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.take(self.table.tick(self.now))

    @precondition(lambda self: self.table.next_deadline() is not None)
    @rule()
    def tick_at_next_deadline(self) -> None:
        deadline = self.table.next_deadline()
        assert deadline is not None
        self.now = max(self.now, deadline)
        self.take(self.table.tick(self.now))

    @rule()
    def restart(self) -> None:
        """Crash (unfinished writes, publishes and checks are lost) and recover."""
        point = self.table.checkpoint()
        self.table = TransactionTable(CONFIG, rng=random.Random(next(self.seeds)))
        self.pending_ops.clear()
        self.pending_publishes.clear()
        self.reported_checks.extend(check for check, _ in self.checks.values())
        self.checks.clear()
        self.table.begin_recovery(half_from=point.half_seq, op_from=point.op_seq)
        for stored in self.half_log:
            if stored.halves[0].seq >= point.half_seq:
                assert self.table.handle(stored, self.now) == []
        for replayed in self.op_log:
            if replayed.seq >= point.op_seq:
                assert self.table.handle(replayed, self.now) == []
        actions = self.take(self.table.finish_recovery(self.now))
        if any(isinstance(a, Publish) for a in actions):
            event("republished after a restart")
        # No commit is lost: every persisted commit without `done` is published again, all
        # of the halves its record lists, and nothing else.
        for txid, kind in self.decision.items():
            if kind is OpKind.COMMIT and txid not in self.done:
                again = {a.half_seq for a in actions if isinstance(a, Publish) and a.txid == txid}
                assert again == self.committed_halves[txid], (txid, again)

    # ------------------------------------------------------------ a buggy actor

    @rule(
        index=st.integers(0, 99),
        bug=st.sampled_from(["unknown op", "foreign record", "bad index", "replay", "no halves"]),
    )
    def buggy_event(self, index: int, bug: str) -> None:
        """An event only a bug could produce: it raises and changes nothing at all."""
        txid = self.pick(index) if self.txids else "nobody"
        bogus: Event
        if bug == "unknown op":
            bogus = OpPersisted(op_id=10**9, seq=len(self.op_log) + 1)
        elif bug == "foreign record":
            # A well-formed op whose record the table never asked for (nor waits for).
            waits_for_done = self.table.outcome(txid) is TxnState.FINISHING
            kind = OpKind.ROLLBACK if waits_for_done else OpKind.DONE
            self.table._ops_in_flight[10**9] = (OpRecord(txid=txid, kind=kind),)
            bogus = OpPersisted(op_id=10**9, seq=len(self.op_log) + 1)
        elif bug == "bad index":
            bogus = Published(txid=txid, index=10**6)
        elif bug == "replay":
            bogus = OpReplayed(seq=1, records=())
        else:
            bogus = HalvesStored(txid=txid, token=TOKEN, group="g", producer="p", halves=())
        before = self.snapshot()
        try:
            actions = self.table.handle(bogus, self.now)
        except CoordinatorStateError:
            assert self.snapshot() == before
            assert self.table.tick(self.now - 1e6) == []  # nothing of it comes out later
        else:
            # Only the publish ack of a finished (or finishing) commit is harmless.
            assert bug == "bad index" and actions == [], actions
            assert self.table.outcome(txid) in (TxnState.FINISHING, TxnState.COMMITTED)
        self.table._ops_in_flight.pop(10**9, None)

    @precondition(lambda self: self.txids)
    @rule(
        index=st.integers(0, 99),
        to=st.sampled_from(WHERE),
        step=st.sampled_from(["end", "operator", "persist", "publish"]),
        decision=st.sampled_from(Decision),
        resolution=st.sampled_from(Resolution),
    )
    def move_astray(
        self,
        index: int,
        to: Where,
        step: str,
        decision: Decision,
        resolution: Resolution,
    ) -> None:
        """Whatever a row does to one transaction, it then moves it `to` a state: where the
        row does not list it, the event raises and changes nothing at all, also in the
        other transactions an op's records finished before."""
        victim = self.pick(index)
        before = everything(self.table)
        with astray(victim, to):
            try:
                if step == "persist" and self.pending_ops:
                    self.persist()
                elif step == "publish" and self.pending_publishes:
                    self.publish_acked(index, twice=False)
                elif step == "operator":
                    self.feed(OperatorDecided(txid=victim, resolution=resolution, request_id="op"))
                else:
                    self.feed(End(txid=victim, token=TOKEN, decision=decision, request_id="end"))
            except CoordinatorStateError as error:
                event("a move astray refused")
                assert str(error).startswith(f"can't move {victim} from "), error
                assert str(error).split(" on ")[0].endswith(f" to {to}"), error
                assert everything(self.table) == before

    def snapshot(self) -> tuple[object, ...]:
        return (
            self.table.transactions(),
            [self.table.outcome(t) for t in self.txids],
            msgspec.structs.asdict(self.table.checkpoint()),
            dataclasses.astuple(self.table.counters),
            self.table.next_deadline(),
            self.table.recent_count,
        )

    # ------------------------------------------------------------ operators

    @precondition(lambda self: self.txids)
    @rule(index=st.integers(0, 99), resolution=st.sampled_from(Resolution))
    def operator(self, index: int, resolution: Resolution) -> None:
        txid = self.pick(index)
        self.feed(OperatorDecided(txid=txid, resolution=resolution, request_id="op"))

    # ------------------------------------------------------------ invariants

    @invariant()
    def final_states_absorb(self) -> None:
        for txid in self.txids:
            state = self.table.outcome(txid)
            if txid in self.final:
                # A restart may forget a finished transaction, never reopen or flip it.
                assert state in (self.final[txid], None), (txid, self.final[txid], state)
            elif state in FINAL:
                event(f"{state}")
                self.final[txid] = state

    @invariant()
    def check_counts_stay_within_the_maximum(self) -> None:
        for view in self.table.transactions():
            assert view.check_times <= CONFIG.check_max

    @invariant()
    def check_max_inconclusive_checks_end_in_a_discard(self) -> None:
        for view in self.table.transactions():
            if view.check_times >= CONFIG.check_max:
                assert view.state not in (TxnState.PREPARED, TxnState.CHECKING), view

    @invariant()
    def committed_means_done_persisted(self) -> None:
        for txid, state in self.final.items():
            expected = OpKind.COMMIT if state is TxnState.COMMITTED else OpKind.ROLLBACK
            assert self.decision[txid] is expected
            assert (txid in self.done) == (state is TxnState.COMMITTED)


TestCoordinatorMachine = CoordinatorMachine.TestCase
TestCoordinatorMachine.settings = settings(
    max_examples=100,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
