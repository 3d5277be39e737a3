"""Every (state, event) pair of the coordinator's transition table, with no I/O.

For each place a transaction can be (`Where`) and each kind of event (`Kind`), the test
puts one transaction there through the public API, fires the event and checks what the
module's `TABLE` says of the pair: the state it goes to (`EFFECTS`: the effects' types), or
that it stays (refused, ignored or answered again), or, for a pair without a row, the one
precise `CoordinatorStateError` with the table exactly as it was and no effect handed out,
now or later. Replayed kinds are fired in the RECOVERING phase, where recovery meets them. The
table also holds its moves to their rows: a move that goes to a state its row does not list
raises, and whatever it had changed is put back.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import msgspec
import pytest

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
    SendCheck,
    TransactionTable,
    TxnState,
)
from txactors.coordinator.core.events import HalvesRefused, Kind
from txactors.coordinator.core.states import Gone, Phase, Where
from txactors.coordinator.core.table import IGNORE, REANSWER, REFUSE, ROWS, TABLE, WHERE
from txactors.wire.protocol import Resolution

S, G, K = TxnState, Gone, Kind
CONFIG = CoordinatorConfig(
    transaction_timeout=1.0,
    max_immunity=5.0,
    check_interval=2.0,
    check_interval_max=8.0,
    check_max=1,
    check_answer_timeout=1.0,
    half_retention=100.0,
)
TOKEN = "tok"
REPLAYED = [k for k in Kind if k.endswith("_replayed")]
LIVE = [k for k in Kind if k not in REPLAYED]
RECOVERABLE = [G.UNKNOWN, S.PREPARED, S.PUBLISHING, S.COMMITTED, S.ROLLED_BACK, S.DISCARDED]
"""Where a transaction can be while recovery replays (pending writes are lost in a crash)."""


class World:
    """The actor around the table: logs of what was stored, the work not yet done."""

    def __init__(self) -> None:
        self.table = TransactionTable(CONFIG, rng=random.Random(1))
        self.now = 1_000.0
        self.half_log: list[HalvesStored] = []
        self.op_log: list[OpReplayed] = []
        self.pending: list[PersistOp] = []
        self.check_id = 0
        self.seqs = itertools.count(1)
        self.table.tick(self.now)  # RUNNING

    def feed(self, event: Event) -> list[Action]:
        return self.take(self.table.handle(event, self.now))

    def take(self, effects: list[Action]) -> list[Action]:
        for effect in effects:
            if isinstance(effect, PersistOp):
                self.pending.append(effect)
            elif isinstance(effect, SendCheck):
                self.check_id = effect.check_id
        return effects

    def prepare(self) -> None:
        half = Half(index=0, topic="orders", seq=next(self.seqs), born=self.now)
        stored = HalvesStored(txid="t", token=TOKEN, group="g", producer="p", halves=(half,))
        self.half_log.append(stored)
        self.feed(msgspec.structs.replace(stored, request_id="prep"))

    def persist(self) -> None:
        op = self.pending.pop(0)
        self.op_log.append(OpReplayed(seq=len(self.op_log) + 1, records=op.records))
        self.feed(OpPersisted(op_id=op.op_id, seq=len(self.op_log)))

    def tick_to_deadline(self) -> list[Action]:
        deadline = self.table.next_deadline()
        assert deadline is not None
        self.now = max(self.now, deadline)
        return self.take(self.table.tick(self.now))

    def end(self, decision: Decision) -> None:
        self.feed(End(txid="t", token=TOKEN, decision=decision, request_id="end"))

    def crash(self) -> None:
        """A new table replaying both logs from their start; recovery left unfinished."""
        self.table = TransactionTable(CONFIG, rng=random.Random(2))
        self.pending.clear()
        self.table.begin_recovery(half_from=1, op_from=1)
        for event in [*self.half_log, *self.op_log]:
            assert self.table.handle(event, self.now) == []


def reach(where: Where) -> World:
    """A world whose transaction "t" is at `where`, through public events only."""
    w = World()
    if where is G.UNKNOWN:
        return w
    w.prepare()
    steps: dict[Where, list[Any]] = {
        S.PREPARED: [],
        S.CHECKING: [w.tick_to_deadline],
        S.COMMITTING: [lambda: w.end(Decision.COMMIT)],
        S.PUBLISHING: [lambda: w.end(Decision.COMMIT), w.persist],
        S.FINISHING: [
            lambda: w.end(Decision.COMMIT),
            w.persist,
            lambda: w.feed(Published(txid="t", index=0)),
        ],
        S.ROLLING_BACK: [lambda: w.end(Decision.ROLLBACK)],
        S.DISCARDING: [w.tick_to_deadline, w.tick_to_deadline],  # check_max=1: one timeout
        G.FORGOTTEN: [w.tick_to_deadline, w.tick_to_deadline, w.persist, w.tick_to_deadline],
    }
    steps[S.COMMITTED] = [*steps[S.FINISHING], w.persist]
    steps[S.ROLLED_BACK] = [*steps[S.ROLLING_BACK], w.persist]
    steps[S.DISCARDED] = [*steps[S.DISCARDING], w.persist]
    for step in steps[where]:
        step()
    assert w.table.where("t") == where
    return w


def event_of(w: World, kind: Kind) -> Event | None:
    """The public input that means `kind` to "t" (None: only a deadline, via `tick`)."""
    where = w.table.where("t")
    match kind:
        case K.HALVES:
            half = Half(index=1, topic="mail", seq=next(w.seqs), born=w.now)
            return HalvesStored(
                txid="t",
                token=TOKEN,
                group="g",
                producer="p",
                halves=(half,),
                begins=where is G.UNKNOWN,
                request_id="more",
            )
        case K.HALVES_REFUSED:
            return HalvesRefused(txid="t", token=TOKEN)
        case K.END_COMMIT | K.END_ROLLBACK | K.END_UNKNOWN:
            decision = Decision(kind.removeprefix("end_"))
            return End(txid="t", token=TOKEN, decision=decision, request_id="end2")
        case K.FORCE_COMMIT:
            return OperatorDecided(txid="t", resolution=Resolution.COMMIT, request_id="op")
        case K.FORCE_ROLLBACK:
            return OperatorDecided(txid="t", resolution=Resolution.ROLLBACK, request_id="op")
        case K.RESUME:
            return OperatorDecided(txid="t", resolution=Resolution.RESUME, request_id="op")
        case K.CHECK_ANSWERED:
            return CheckAnswered(txid="t", check_id=w.check_id, resolution=Decision.COMMIT)
        case K.CHECK_FAILED:
            return CheckFailed(txid="t", check_id=w.check_id, reason=CheckFailure.ERROR)
        case K.PUBLISHED:
            return Published(txid="t", index=0)
        case K.DUE:
            return None
    record = OpRecord(
        txid="t",
        kind=OpKind(kind.split("_")[0]),
        half_seqs=(1,),
        check_times=1,
        reason=DiscardReason.CHECK_MAX,
    )
    if kind in REPLAYED:
        return OpReplayed(seq=len(w.op_log) + 1, records=(record,))
    ours = [op for op in w.pending if any(r.kind is record.kind for r in op.records)]
    if ours:
        return OpPersisted(op_id=ours[0].op_id, seq=len(w.op_log) + 1)
    # Only a bug in the actor (a record it never got from the table) could report this one.
    w.table._ops_in_flight[999] = (record,)
    return OpPersisted(op_id=999, seq=len(w.op_log) + 1)


def snapshot(table: TransactionTable) -> dict[str, object]:
    return everything(table)


def fire(w: World, kind: Kind) -> tuple[Where, list[str]] | str:
    """Fire `kind` at "t": where it went and the effects' types, or the error's message."""
    event = event_of(w, kind)
    before = snapshot(w.table)
    try:
        if event is None:
            effects = w.table.tick(max(w.now, w.table.next_deadline() or w.now))
        else:
            effects = w.table.handle(event, w.now)
    except CoordinatorStateError as error:
        assert snapshot(w.table) == before, "a failed event changed the table"
        if w.table.phase is Phase.RUNNING:
            assert w.table.tick(w.now) == [], "a failed event left effects behind"
        return str(error)
    return w.table.where("t"), [type(e).__name__ for e in effects]


EFFECTS = """
where        event             effects
prepared     halves            Acknowledge
prepared     halves_refused    PersistOp
prepared     end_commit        PersistOp
prepared     end_rollback      PersistOp
prepared     force_commit      PersistOp
prepared     force_rollback    PersistOp
prepared     resume            Acknowledge PersistOp
prepared     due               SendCheck
checking     halves            Acknowledge
checking     halves_refused    PersistOp
checking     end_commit        PersistOp
checking     end_rollback      PersistOp
checking     force_commit      PersistOp
checking     force_rollback    PersistOp
checking     resume            Acknowledge PersistOp
checking     check_answered    PersistOp
checking     check_failed      PersistOp
checking     due               PersistOp
committing   commit_written    Publish
publishing   published         Acknowledge PersistOp
rolling_back rollback_written  Acknowledge
discarding   discard_written   Discard
discarded    force_commit      PersistOp
discarded    force_rollback    PersistOp
discarded    resume            Acknowledge PersistOp
unknown      halves            Acknowledge
"""
"""The effects of the rows of `TABLE` that name a state, as this test's events meet them (a
row not listed hands out none: a write done, a replayed record)."""

CHOSEN: dict[tuple[Where, Kind], Where] = {
    (S.PREPARED, K.DUE): S.CHECKING,
    (S.PREPARED, K.CHECK_ANSWERED): S.PREPARED,  # no check timed out: the answer is stale
    (S.CHECKING, K.CHECK_ANSWERED): S.COMMITTING,
    (S.CHECKING, K.CHECK_FAILED): S.DISCARDING,  # check_max=1
    (S.CHECKING, K.DUE): S.DISCARDING,
    (S.PUBLISHING, K.PUBLISHED): S.FINISHING,
}
"""Where this test's event goes, of the states its row names (or stays, on a guard)."""

WAITING = {S.COMMITTING, S.PUBLISHING, S.ROLLING_BACK}
"""A repeated decision is answered once its write is done, not at once."""


def expected(where: Where, kind: Kind) -> tuple[Where, list[str]]:
    """What `TABLE` says firing `kind` at `where` does, with this test's events."""
    target = TABLE[where][kind]
    if target is REFUSE:
        return where, [] if kind is K.HALVES_REFUSED else ["Refuse"]  # nobody to answer
    if target is IGNORE:
        return where, []
    if target is REANSWER:
        waits = where in WAITING and kind is not K.END_UNKNOWN
        return where, [] if waits else ["Acknowledge"]
    if isinstance(target, frozenset):
        chosen = CHOSEN[where, kind]
        assert chosen == where or chosen in target
        target = chosen
    for line in EFFECTS.strip().splitlines()[1:]:
        w, k, *effects = line.split()
        if (w, k) == (where, kind):
            return target, effects
    return target, []


@pytest.mark.parametrize("kind", LIVE)
@pytest.mark.parametrize("where", WHERE)
def test_every_live_pair(where: Where, kind: Kind) -> None:
    """A pair without a row raises; any other does what its row says."""
    w = reach(where)
    if kind not in TABLE[where]:
        if kind is K.DUE:  # only the states with a DUE row have a deadline: `tick` skips them
            assert w.table.next_deadline() is None
            assert fire(w, kind) == (where, [])
        else:
            assert fire(w, kind) == f"can't handle {kind} in state {where} for t"
        return
    assert fire(w, kind) == expected(where, kind)


@pytest.mark.parametrize("kind", REPLAYED)
@pytest.mark.parametrize("where", RECOVERABLE)
def test_every_replayed_pair(where: Where, kind: Kind) -> None:
    w = reach(where)
    w.crash()
    assert w.table.where("t") == where
    skipped = w.table.counters.replay_skipped
    assert fire(w, kind) == expected(where, kind)
    assert w.table.counters.replay_skipped == skipped + (TABLE[where][kind] is IGNORE)


def test_replayed_kinds_have_a_row_in_every_state() -> None:
    """A record that does not apply is skipped, never an error: streams hold history."""
    assert all(k in TABLE[w] for w in WHERE for k in REPLAYED)


@pytest.mark.parametrize("kind", [k for k in LIVE if k is not K.HALVES])
def test_live_events_are_refused_while_recovering(kind: Kind) -> None:
    w = reach(S.PREPARED)
    w.crash()
    name = "tick" if kind is K.DUE else type(event_of(w, kind)).__name__
    assert fire(w, kind) == f"can't handle {name} in phase recovering"


@pytest.mark.parametrize("kind", REPLAYED)
def test_replayed_events_are_refused_while_running(kind: Kind) -> None:
    w = reach(S.PREPARED)
    assert fire(w, kind) == "can't handle OpReplayed in phase running"


def test_the_phases_move_only_forward() -> None:
    w = World()
    assert w.table.phase is Phase.RUNNING
    with pytest.raises(CoordinatorStateError, match="can't begin recovery in phase running"):
        w.table.begin_recovery(half_from=1, op_from=1)
    with pytest.raises(CoordinatorStateError, match="can't finish recovery in phase running"):
        w.table.finish_recovery(w.now)
    w.crash()
    assert w.table.phase is Phase.RECOVERING
    w.table.finish_recovery(w.now)
    assert w.table.phase is Phase.RUNNING


def test_a_failing_record_keeps_the_whole_op_in_flight() -> None:
    """One op message is one unit: a bad record stops the good ones of the same op too."""
    w = reach(S.PREPARED)
    w.end(Decision.COMMIT)
    [op] = w.pending
    bad = OpRecord(txid="t", kind=OpKind.DONE)
    w.table._ops_in_flight[op.op_id] = (*op.records, bad)  # only a bug could send this
    before = snapshot(w.table)
    with pytest.raises(
        CoordinatorStateError, match="can't handle done_written in state publishing"
    ):
        w.table.handle(OpPersisted(op_id=op.op_id, seq=1), w.now)
    assert snapshot(w.table) == before
    w.table._ops_in_flight[op.op_id] = op.records
    effects = w.table.handle(OpPersisted(op_id=op.op_id, seq=1), w.now)
    assert [type(e) for e in effects] == [Publish]


LIVE_ROWS = [(where, kind) for where in WHERE for kind in LIVE if kind in TABLE[where]]
REPLAYED_ROWS = [(where, kind) for where in RECOVERABLE for kind in REPLAYED]


@pytest.mark.parametrize(("where", "kind"), [*LIVE_ROWS, *REPLAYED_ROWS])
def test_a_move_to_a_state_its_row_does_not_list_raises_and_changes_nothing(
    where: Where, kind: Kind
) -> None:
    """Every row, moved to every state it does not list after doing its usual work."""
    row = ROWS[where, kind]
    for target in WHERE:
        if target == where or target in row.to:
            continue
        w = reach(where)
        if kind in REPLAYED:
            w.crash()
        event = event_of(w, kind)
        before = snapshot(w.table)
        with astray("t", target), pytest.raises(CoordinatorStateError) as refused:
            if event is None:
                w.table.tick(max(w.now, w.table.next_deadline() or w.now))
            else:
                w.table.handle(event, w.now)
        assert str(refused.value) == f"can't move t from {where} to {target} on {kind}"
        assert refused.value.event is event
        if event is None:  # a due transaction whose move fails keeps no deadline
            before["_deadlines"] = {}
        assert snapshot(w.table) == before, (target, "a failed move changed the table")
        assert w.table.handle_batch((), w.now) == [], "a failed move left effects behind"


def test_a_move_astray_puts_back_every_record_of_its_op() -> None:
    """One op message is one unit: a transaction that an earlier record of the same op
    finished (and so took out of memory) is back as it was."""
    table = TransactionTable(CONFIG, rng=random.Random(1))
    now = 1_000.0
    table.tick(now)
    for seq, txid in enumerate(["t", "u"], start=1):
        half = Half(index=0, topic="orders", seq=seq, born=now)
        prepare = HalvesStored(txid=txid, token=TOKEN, group="g", producer="p", halves=(half,))
        table.handle(msgspec.structs.replace(prepare, request_id=f"prep-{txid}"), now)
    end_t = End(txid="t", token=TOKEN, decision=Decision.COMMIT, request_id="end-t")
    [commit] = table.handle(end_t, now)
    assert isinstance(commit, PersistOp)
    table.handle(OpPersisted(op_id=commit.op_id, seq=1), now)
    end_u = End(txid="u", token=TOKEN, decision=Decision.ROLLBACK, request_id="end-u")
    *_, both = table.handle_batch([Published(txid="t", index=0), end_u], now)
    assert isinstance(both, PersistOp)
    assert [r.kind for r in both.records] == [OpKind.DONE, OpKind.ROLLBACK]
    before = everything(table)
    with astray("u", S.PUBLISHING), pytest.raises(CoordinatorStateError, match="can't move u"):
        table.handle(OpPersisted(op_id=both.op_id, seq=2), now)
    assert everything(table) == before
    assert table.where("t") is S.FINISHING
    effects = table.handle(OpPersisted(op_id=both.op_id, seq=2), now)
    assert [type(e) for e in effects] == [Acknowledge]
    assert (table.where("t"), table.where("u")) == (S.COMMITTED, S.ROLLED_BACK)
