"""Unit tests of the coordinator's pure state machine: no I/O, a virtual clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import msgspec
import pytest

import txactors.coordinator as coordinator
from txactors.coordinator import (
    Acknowledge,
    Action,
    CheckAnswered,
    CheckFailed,
    CheckFailure,
    CheckTarget,
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
    OpReplayed,
    PersistOp,
    Publish,
    Published,
    Refuse,
    SendCheck,
    TransactionTable,
    TxnState,
)
from txactors.wire.protocol import ErrorCode, Resolution

START = 1_700_000_000.0


class Harness:
    """Plays the coordinator actor: stores halves and op records in lists, acks at will."""

    def __init__(self, config: CoordinatorConfig | None = None, *, seed: int = 7) -> None:
        self.config = config or CoordinatorConfig()
        self.table = TransactionTable(self.config, rng=random.Random(seed))
        self.now = START
        self.half_log: list[HalvesStored] = []
        self.op_log: list[OpReplayed] = []
        self._requests = itertools.count(1)

    def request_id(self) -> str:
        return f"req-{next(self._requests)}"

    def prepare(
        self,
        txid: str,
        topics: Sequence[str] = ("orders",),
        *,
        first_index: int = 0,
        token: str = "tok",
        group: str = "g",
        producer: str = "p1",
        immunity: float | None = None,
        append_refused: bool = False,
    ) -> list[Action]:
        """Append halves to the HALF log (unless refused: the actor asked first), tell the table."""
        halves = tuple(
            Half(
                index=first_index + i,
                topic=topic,
                seq=len(self.half_log) + i + 1,
                born=self.now,
                immunity=immunity,
            )
            for i, topic in enumerate(topics)
        )
        stored = HalvesStored(
            txid=txid,
            token=token,
            group=group,
            producer=producer,
            halves=halves,
            begins=first_index == 0,
        )
        actions = self.table.handle(
            msgspec.structs.replace(stored, request_id=self.request_id()), self.now
        )
        if append_refused or not any(isinstance(a, Refuse) for a in actions):
            for half in halves:  # one TXN_HALF message per half
                self.half_log.append(msgspec.structs.replace(stored, halves=(half,)))
        return actions

    def end(self, txid: str, decision: Decision, token: str = "tok") -> list[Action]:
        event = End(txid=txid, token=token, decision=decision, request_id=self.request_id())
        return self.feed(event)

    def feed(self, event: Event) -> list[Action]:
        return self.table.handle(event, self.now)

    def tick(self, seconds: float = 0.0) -> list[Action]:
        self.now += seconds
        return self.table.tick(self.now)

    def tick_at_next_deadline(self) -> list[Action]:
        deadline = self.table.next_deadline()
        assert deadline is not None, "nothing scheduled"
        self.now = max(self.now, deadline)
        return self.table.tick(self.now)

    def persist(self, action: PersistOp) -> list[Action]:
        seq = len(self.op_log) + 1
        self.op_log.append(OpReplayed(seq=seq, records=action.records))
        return self.feed(OpPersisted(op_id=action.op_id, seq=seq))

    def complete(self, actions: list[Action]) -> list[Action]:
        """Carry out writes and publishes until only replies, checks and discards remain."""
        leftover: list[Action] = []
        pending = list(actions)
        while pending:
            action = pending.pop(0)
            if isinstance(action, PersistOp):
                pending.extend(self.persist(action))
            elif isinstance(action, Publish):
                pending.extend(self.feed(Published(txid=action.txid, index=action.index)))
            else:
                leftover.append(action)
        return leftover


def of(kind: type[Action], actions: Sequence[Action]) -> list[Action]:
    return [a for a in actions if isinstance(a, kind)]


def only(actions: Sequence[Action]) -> Action:
    assert len(actions) == 1, actions
    return actions[0]


def the_write(actions: Sequence[Action]) -> PersistOp:
    """The one action, which must be a `PersistOp`."""
    action = only(actions)
    assert isinstance(action, PersistOp)
    return action


@pytest.fixture
def h() -> Harness:
    return Harness()


# ---------------------------------------------------------------- prepare


def test_prepare_acknowledges_and_shows_the_transaction(h: Harness) -> None:
    [ack] = h.prepare("t1", ["orders", "audit"])
    assert isinstance(ack, Acknowledge) and ack.state is TxnState.PREPARED
    view = h.table.show("t1")
    assert view is not None
    assert view.topics == ("audit", "orders") and view.half_seqs == (1, 2)
    assert view.next_check_at == START + 6.0 and view.check_times == 0


def test_later_prepares_add_halves_and_a_retried_one_adds_none(h: Harness) -> None:
    h.prepare("t1", ["a"])
    h.prepare("t1", ["b"], first_index=1)
    retried = HalvesStored(
        txid="t1",
        token="tok",
        group="g",
        producer="p1",
        halves=h.half_log[0].halves,
        request_id="r",
    )
    assert isinstance(only(h.feed(retried)), Acknowledge)
    assert h.table.counters.halves_stored == 2
    view = h.table.show("t1")
    assert view is not None and view.topics == ("a", "b")


@pytest.mark.parametrize(
    ("immunity", "first_check_after"),
    [(None, 6.0), (1.0, 6.0), (20.0, 20.0), (7200.0, 3600.0)],
)
def test_check_immunity_is_clamped(
    h: Harness, immunity: float | None, first_check_after: float
) -> None:
    h.prepare("t1", immunity=immunity)
    assert h.table.next_deadline() == START + first_check_after


def test_transaction_immunity_is_the_largest_of_its_halves(h: Harness) -> None:
    h.prepare("t1", immunity=30.0)
    h.prepare("t1", ["b"], first_index=1, immunity=None)
    assert h.table.next_deadline() == START + 30.0


def test_prepare_refusals(h: Harness) -> None:
    h.prepare("t1")
    [wrong] = h.prepare("t1", first_index=1, token="nope")
    assert isinstance(wrong, Refuse) and wrong.code is ErrorCode.FORBIDDEN
    [group] = h.prepare("t1", first_index=1, group="other")
    assert isinstance(group, Refuse) and group.code is ErrorCode.CONFLICT
    h.end("t1", Decision.ROLLBACK)
    [late] = h.prepare("t1", first_index=1)
    assert isinstance(late, Refuse) and late.code is ErrorCode.CONFLICT
    assert h.table.refuse_prepare("t2", "tok", "g", begins=True) is None
    [unknown] = h.prepare("t2", first_index=1)
    assert isinstance(unknown, Refuse) and unknown.code is ErrorCode.NOT_FOUND
    view = h.table.show("t1")
    assert view is not None and view.half_seqs == (1,)


def test_halves_stored_without_halves_is_a_bug(h: Harness) -> None:
    event = HalvesStored(txid="t", token="x", group="g", producer="p", halves=())
    with pytest.raises(CoordinatorStateError):
        h.feed(event)


# ---------------------------------------------------------------- end


def test_commit_persists_then_publishes_then_replies_then_finishes(h: Harness) -> None:
    h.prepare("t1", ["orders", "audit"])
    persist = only(h.end("t1", Decision.COMMIT))
    assert isinstance(persist, PersistOp)
    assert [(r.kind, r.half_seqs) for r in persist.records] == [(OpKind.COMMIT, (1, 2))]
    assert h.table.outcome("t1") is TxnState.COMMITTING

    publishes = h.persist(persist)
    assert [(p.topic, p.half_seq, p.msg_id) for p in publishes if isinstance(p, Publish)] == [
        ("orders", 1, "t1:0"),
        ("audit", 2, "t1:1"),
    ]
    assert len(publishes) == 2 and h.table.outcome("t1") is TxnState.PUBLISHING
    assert h.feed(Published(txid="t1", index=1)) == []
    reply, done = h.feed(Published(txid="t1", index=0))
    # Every message is on its topic: the producer hears "committed" before `done` is durable.
    assert reply == Acknowledge(request_id="req-2", txid="t1", state=TxnState.COMMITTED)
    assert isinstance(done, PersistOp) and done.records[0].kind is OpKind.DONE
    assert h.feed(Published(txid="t1", index=0)) == []  # a retried publish's ack
    again = only(h.end("t1", Decision.COMMIT))  # a repeated end while `done` is in flight
    assert isinstance(again, Acknowledge) and again.state is TxnState.COMMITTED

    assert h.persist(done) == []
    assert len(h.table) == 0 and h.table.outcome("t1") is TxnState.COMMITTED
    assert h.feed(Published(txid="t1", index=1)) == []
    assert h.table.counters.commits == 1


def test_rollback_persists_then_replies_and_never_publishes(h: Harness) -> None:
    h.prepare("t1")
    persist = only(h.end("t1", Decision.ROLLBACK))
    assert isinstance(persist, PersistOp) and persist.records[0].kind is OpKind.ROLLBACK
    reply = only(h.persist(persist))
    assert isinstance(reply, Acknowledge) and reply.state is TxnState.ROLLED_BACK
    assert len(h.table) == 0 and h.table.next_deadline() is None


def test_unknown_end_changes_nothing(h: Harness) -> None:
    h.prepare("t1")
    reply = only(h.end("t1", Decision.UNKNOWN))
    assert isinstance(reply, Acknowledge) and reply.state is TxnState.PREPARED
    assert h.table.next_deadline() == START + 6.0 and h.table.counters.unknown_ends == 1


@pytest.mark.parametrize(
    ("txid", "token", "code"),
    [("nope", "tok", ErrorCode.NOT_FOUND), ("t1", "wrong", ErrorCode.FORBIDDEN)],
)
def test_end_refusals_change_nothing(h: Harness, txid: str, token: str, code: ErrorCode) -> None:
    h.prepare("t1")
    before = h.table.show("t1")
    reply = only(h.end(txid, Decision.COMMIT, token=token))
    assert isinstance(reply, Refuse) and reply.code is code and reply.txid == txid
    assert h.table.show("t1") == before


def test_wrong_token_is_refused_after_completion_too(h: Harness) -> None:
    h.prepare("t1")
    h.complete(h.end("t1", Decision.COMMIT))
    reply = only(h.end("t1", Decision.COMMIT, token="wrong"))
    assert isinstance(reply, Refuse) and reply.code is ErrorCode.FORBIDDEN


def test_repeated_commit_waits_for_the_same_reply(h: Harness) -> None:
    h.prepare("t1")
    persist = h.end("t1", Decision.COMMIT)
    assert h.end("t1", Decision.COMMIT) == []  # attached, not persisted twice
    replies = h.complete(persist)
    assert [(a.request_id, a.state) for a in replies if isinstance(a, Acknowledge)] == [
        ("req-2", TxnState.COMMITTED),
        ("req-3", TxnState.COMMITTED),
    ]
    again = only(h.end("t1", Decision.COMMIT))  # after completion: acknowledged at once
    assert isinstance(again, Acknowledge) and again.state is TxnState.COMMITTED


@pytest.mark.parametrize("finish", [False, True])
def test_conflicting_end_is_refused(h: Harness, finish: bool) -> None:
    h.prepare("t1")
    persist = h.end("t1", Decision.COMMIT)
    if finish:
        h.complete(persist)
    reply = only(h.end("t1", Decision.ROLLBACK))
    assert isinstance(reply, Refuse) and reply.code is ErrorCode.CONFLICT
    assert h.table.outcome("t1") is (TxnState.COMMITTED if finish else TxnState.COMMITTING)


def test_decisions_of_one_step_are_group_committed(h: Harness) -> None:
    for txid in ("a", "b", "c"):
        h.prepare(txid)
    ends = [
        End(txid=txid, token="tok", decision=d, request_id=txid)
        for txid, d in [("a", Decision.COMMIT), ("b", Decision.ROLLBACK), ("c", Decision.COMMIT)]
    ]
    persist = only(h.table.handle_batch(ends, h.now))
    assert isinstance(persist, PersistOp)
    assert [(r.txid, r.kind) for r in persist.records] == [
        ("a", OpKind.COMMIT),
        ("b", OpKind.ROLLBACK),
        ("c", OpKind.COMMIT),
    ]
    replies = h.complete([persist])
    assert sorted(a.txid for a in replies if isinstance(a, Acknowledge)) == ["a", "b", "c"]


# ---------------------------------------------------------------- checks


def test_check_goes_to_the_instance_and_only_one_is_in_flight(h: Harness) -> None:
    h.prepare("t1")
    assert h.tick(5.9) == []
    check = only(h.tick(0.1))
    assert isinstance(check, SendCheck)
    assert (check.target, check.producer, check.group) == (CheckTarget.INSTANCE, "p1", "g")
    assert check.check_times == 0 and check.halves == h.half_log[0].halves
    assert h.tick(1.0) == []  # still in flight: no second check
    assert h.table.outcome("t1") is TxnState.CHECKING


def test_unknown_answer_counts_and_backs_off_with_jitter(h: Harness) -> None:
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck)
    answered = CheckAnswered(txid="t1", check_id=check.check_id, resolution=Decision.UNKNOWN)
    persist = only(h.feed(answered))
    assert isinstance(persist, PersistOp)
    assert [(r.kind, r.check_times) for r in persist.records] == [(OpKind.CHECKED, 1)]
    view = h.table.show("t1")
    assert view is not None and view.check_times == 1 and view.last_check == "unknown"
    assert view.next_check_at is not None
    assert 24.0 <= view.next_check_at - h.now <= 36.0  # 30 s ± 20 %


def test_check_answer_is_applied_like_an_end(h: Harness) -> None:
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck)
    answered = CheckAnswered(txid="t1", check_id=check.check_id, resolution=Decision.COMMIT)
    leftover = h.complete(h.feed(answered))
    assert leftover == [] and h.table.outcome("t1") is TxnState.COMMITTED
    assert h.tick(10_000.0) == []  # never a check after a final state


def test_end_during_a_check_makes_its_answer_unexpected(h: Harness) -> None:
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck)
    h.complete(h.end("t1", Decision.ROLLBACK))
    answered = CheckAnswered(txid="t1", check_id=check.check_id, resolution=Decision.COMMIT)
    assert h.feed(answered) == []
    assert h.table.counters.unexpected_check_answers == 1
    assert h.table.outcome("t1") is TxnState.ROLLED_BACK


def test_no_responders_at_the_instance_asks_the_group_at_once(h: Harness) -> None:
    h.prepare("t1")
    first = only(h.tick(6.0))
    assert isinstance(first, SendCheck)
    failed = CheckFailed(txid="t1", check_id=first.check_id, reason=CheckFailure.NO_RESPONDERS)
    second = only(h.feed(failed))
    assert isinstance(second, SendCheck) and second.target is CheckTarget.GROUP
    assert second.check_id != first.check_id and second.check_times == 0
    assert h.feed(failed) == []  # a stale report changes nothing
    no_group = CheckFailed(txid="t1", check_id=second.check_id, reason=CheckFailure.NO_RESPONDERS)
    h.complete(h.feed(no_group))
    view = h.table.show("t1")
    assert view is not None and view.check_times == 1 and view.state is TxnState.PREPARED


@pytest.mark.parametrize("reason", [CheckFailure.TIMEOUT, CheckFailure.ERROR])
def test_a_live_instance_that_fails_a_check_is_asked_again_never_the_group(
    h: Harness, reason: CheckFailure
) -> None:
    """Only *no responders* means the instance is gone. One that is slow (its database busy)
    or failed is asked again: another member would decide for it (with the log, claim it
    rolled back) what it is about to decide itself."""
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck) and check.target is CheckTarget.INSTANCE
    for times in (1, 2, 3):
        h.complete(h.feed(CheckFailed(txid="t1", check_id=check.check_id, reason=reason)))
        view = h.table.show("t1")
        assert view is not None and view.check_times == times and view.last_check == reason
        check = only(h.tick_at_next_deadline())
        assert isinstance(check, SendCheck) and check.target is CheckTarget.INSTANCE


@pytest.mark.parametrize(
    ("gone", "resolution", "counted"),
    [
        (True, Decision.ROLLBACK, 1),
        (True, Decision.COMMIT, 0),
        (False, Decision.ROLLBACK, 0),
    ],
)
def test_a_rollback_the_group_answered_is_counted(
    h: Harness, gone: bool, resolution: Decision, counted: int
) -> None:
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck)
    if gone:
        failed = CheckFailed(txid="t1", check_id=check.check_id, reason=CheckFailure.NO_RESPONDERS)
        check = only(h.feed(failed))
        assert isinstance(check, SendCheck) and check.target is CheckTarget.GROUP
    answered = CheckAnswered(txid="t1", check_id=check.check_id, resolution=resolution)
    h.complete(h.feed(answered))
    assert h.table.counters.group_check_rollbacks == counted


def test_an_unanswered_check_times_out_and_a_stale_answer_is_ignored(h: Harness) -> None:
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck)
    assert h.table.next_deadline() == h.now + h.config.check_answer_timeout
    h.complete(h.tick(h.config.check_answer_timeout))
    view = h.table.show("t1")
    assert view is not None and view.check_times == 1 and view.last_check == "timeout"
    # The instance is there but did not answer in time: the next check asks it again.
    nxt = only(h.tick_at_next_deadline())
    assert isinstance(nxt, SendCheck) and nxt.target is CheckTarget.INSTANCE
    # Now that a newer question is out, the first one's answer no longer counts.
    stale = CheckAnswered(txid="t1", check_id=check.check_id, resolution=Decision.COMMIT)
    assert h.feed(stale) == [] and h.table.counters.unexpected_check_answers == 1


def test_a_late_answer_to_the_last_timed_out_check_still_decides(h: Harness) -> None:
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck)
    h.complete(h.tick(h.config.check_answer_timeout))
    late = CheckAnswered(txid="t1", check_id=check.check_id, resolution=Decision.ROLLBACK)
    persist = only(h.feed(late))
    assert isinstance(persist, PersistOp) and persist.records[0].kind is OpKind.ROLLBACK
    assert h.table.counters.late_check_answers == 1
    assert h.table.counters.unexpected_check_answers == 0
    unknown = CheckAnswered(txid="t1", check_id=check.check_id, resolution=Decision.UNKNOWN)
    assert h.feed(unknown) == [], "a decided transaction takes no more answers"


def test_fifteen_inconclusive_checks_then_discard(h: Harness) -> None:
    h.prepare("t1", ["orders", "audit"])
    sent: list[SendCheck] = []
    discards: list[Discard] = []
    while h.table.outcome("t1") is not TxnState.DISCARDED:
        for action in h.complete(h.tick_at_next_deadline()):
            assert isinstance(action, SendCheck)
            sent.append(action)
            answer = CheckAnswered(txid="t1", check_id=action.check_id, resolution=Decision.UNKNOWN)
            for after in h.complete(h.feed(answer)):
                assert isinstance(after, Discard)
                discards.append(after)
    assert [c.check_times for c in sent] == list(range(15))
    assert len({c.check_id for c in sent}) == 15
    [discard] = discards
    assert (discard.reason, discard.check_times, len(discard.halves)) == (
        DiscardReason.CHECK_MAX,
        15,
        2,
    )
    assert h.op_log[-1].records[-1].kind is OpKind.DISCARD
    # Backoff: 30 s doubling to a 5 min cap, ±20 %: about an hour in all, never a storm.
    assert 3000 < h.now - START < 5000
    # DISCARDED is final for the checker and for producers.
    assert h.tick(3600.0) == []
    reply = only(h.end("t1", Decision.COMMIT))
    assert isinstance(reply, Refuse) and reply.code is ErrorCode.CONFLICT
    assert only(h.end("t1", Decision.UNKNOWN)) == Acknowledge(
        request_id="req-3", txid="t1", state=TxnState.DISCARDED
    )
    assert [v.txid for v in h.table.transactions({TxnState.DISCARDED})] == ["t1"]
    # Past retention it is forgotten (its halves stay in TXN_DISCARD).
    h.tick(h.config.half_retention)
    assert len(h.table) == 0 and h.table.outcome("t1") is TxnState.DISCARDED
    assert h.table.counters.forgotten == 1 and h.table.counters.discards == 1


def test_undecided_past_half_retention_is_discarded() -> None:
    config = CoordinatorConfig(half_retention=100.0, check_interval=60.0, check_interval_max=60.0)
    h = Harness(config)
    h.prepare("t1")
    while h.table.outcome("t1") in (TxnState.PREPARED, TxnState.CHECKING):
        for action in h.complete(h.tick_at_next_deadline()):
            if isinstance(action, SendCheck):
                answer = CheckAnswered(
                    txid="t1", check_id=action.check_id, resolution=Decision.UNKNOWN
                )
                h.complete(h.feed(answer))
    view = h.table.show("t1")
    assert view is not None and view.state is TxnState.DISCARDED
    assert view.discard_reason is DiscardReason.RETENTION
    assert h.now == START + 100.0


# ---------------------------------------------------------------- operators


def discard(h: Harness, txid: str) -> None:
    while h.table.outcome(txid) is not TxnState.DISCARDED:
        for action in h.complete(h.tick_at_next_deadline()):
            if isinstance(action, SendCheck):
                answer = CheckAnswered(
                    txid=txid, check_id=action.check_id, resolution=Decision.UNKNOWN
                )
                h.complete(h.feed(answer))


def test_resume_gives_a_discarded_transaction_a_fresh_check_count(h: Harness) -> None:
    h.prepare("t1")
    discard(h, "t1")
    ack, persist = h.feed(OperatorDecided(txid="t1", resolution=Resolution.RESUME, request_id="op"))
    assert isinstance(persist, PersistOp) and persist.records[0].kind is OpKind.RESUME
    assert ack == Acknowledge(request_id="op", txid="t1", state=TxnState.PREPARED)
    view = h.table.show("t1")
    assert view is not None and view.check_times == 0 and view.discard_reason is None
    check = only(h.complete(h.tick()))
    assert isinstance(check, SendCheck) and check.target is CheckTarget.INSTANCE


def test_resume_of_a_pending_transaction_resets_its_count(h: Harness) -> None:
    h.prepare("t1")
    check = only(h.tick(6.0))
    assert isinstance(check, SendCheck)
    h.complete(
        h.feed(CheckAnswered(txid="t1", check_id=check.check_id, resolution=Decision.UNKNOWN))
    )
    ack, persist = h.feed(OperatorDecided(txid="t1", resolution=Resolution.RESUME, request_id="op"))
    assert isinstance(persist, PersistOp) and persist.records[0].kind is OpKind.RESUME
    assert isinstance(ack, Acknowledge)
    assert h.table.next_deadline() == h.now


@pytest.mark.parametrize(
    ("command", "state", "publishes"),
    [(Resolution.COMMIT, TxnState.COMMITTED, 1), (Resolution.ROLLBACK, TxnState.ROLLED_BACK, 0)],
)
def test_operator_forces_a_discarded_transaction(
    h: Harness, command: Resolution, state: TxnState, publishes: int
) -> None:
    h.prepare("t1")
    discard(h, "t1")
    persist = only(h.feed(OperatorDecided(txid="t1", resolution=command, request_id="op")))
    assert isinstance(persist, PersistOp) and persist.records[0].by_operator
    actions = h.persist(persist)
    assert len(of(Publish, actions)) == publishes
    reply = only(h.complete(actions))
    assert reply == Acknowledge(request_id="op", txid="t1", state=state)


def test_operator_commands_on_unknown_or_final_transactions(h: Harness) -> None:
    refused = only(
        h.feed(OperatorDecided(txid="nope", resolution=Resolution.RESUME, request_id="op"))
    )
    assert isinstance(refused, Refuse) and refused.code is ErrorCode.NOT_FOUND
    h.prepare("t1")
    h.complete(h.end("t1", Decision.ROLLBACK))
    refused = only(
        h.feed(OperatorDecided(txid="t1", resolution=Resolution.RESUME, request_id="op"))
    )
    assert isinstance(refused, Refuse) and refused.code is ErrorCode.CONFLICT
    refused = only(
        h.feed(OperatorDecided(txid="t1", resolution=Resolution.COMMIT, request_id="op"))
    )
    assert isinstance(refused, Refuse) and refused.code is ErrorCode.CONFLICT
    again = only(
        h.feed(OperatorDecided(txid="t1", resolution=Resolution.ROLLBACK, request_id="op"))
    )
    assert isinstance(again, Acknowledge) and again.state is TxnState.ROLLED_BACK


def test_list_filters_by_state_oldest_first(h: Harness) -> None:
    h.prepare("old")
    h.now += 1
    h.prepare("new")
    h.end("new", Decision.COMMIT)
    assert [v.txid for v in h.table.transactions()] == ["old", "new"]
    assert [v.txid for v in h.table.transactions({TxnState.PREPARED})] == ["old"]
    assert h.table.show("nope") is None


# ---------------------------------------------------------------- recovery


def recover(h: Harness, *, half_from: int = 1, op_from: int = 1) -> tuple[Harness, list[Action]]:
    """A fresh table replaying `h`'s streams from the given sequences."""
    fresh = Harness(h.config)
    fresh.now = h.now
    fresh.half_log, fresh.op_log = list(h.half_log), list(h.op_log)
    fresh.table.begin_recovery(half_from=half_from, op_from=op_from)
    for stored in h.half_log:
        if stored.halves[0].seq >= half_from:
            fresh.table.handle(stored, h.now)
    for replayed in h.op_log:
        if replayed.seq >= op_from:
            fresh.table.handle(replayed, h.now)
    return fresh, fresh.table.finish_recovery(h.now)


def test_recovery_rebuilds_exact_state_and_republishes_commits_without_done() -> None:
    h = Harness()
    h.prepare("committed")
    h.complete(h.end("committed", Decision.COMMIT))
    h.prepare("rolled-back")
    h.complete(h.end("rolled-back", Decision.ROLLBACK))
    h.prepare("no-done", ["orders", "audit"])
    h.persist(the_write(h.end("no-done", Decision.COMMIT)))  # crash before publishes are acked
    h.prepare("checked")
    h.prepare("discarded")
    h.prepare("resumed")
    h.now += 3600.0
    discard(h, "discarded")
    discard(h, "resumed")
    h.complete(
        h.feed(OperatorDecided(txid="resumed", resolution=Resolution.RESUME, request_id="op"))
    )
    # "checked" was checked along the way; its last answer was UNKNOWN.
    view = h.table.show("checked")
    assert view is not None and view.check_times > 0
    rolling = "rolling"
    h.prepare(rolling)
    h.end(rolling, Decision.ROLLBACK)  # decided, but the record never reached TXN_OP
    expected = {v.txid: (v.state, v.check_times, v.half_seqs) for v in h.table.transactions()}

    fresh, actions = recover(h)
    got = {v.txid: (v.state, v.check_times, v.half_seqs) for v in fresh.table.transactions()}
    expected[rolling] = (TxnState.PREPARED, 0, expected[rolling][2])  # not durable: undecided
    assert got == expected
    assert fresh.table.outcome("committed") is TxnState.COMMITTED
    assert fresh.table.outcome("rolled-back") is TxnState.ROLLED_BACK
    assert [(a.txid, a.msg_id) for a in actions if isinstance(a, Publish)] == [
        ("no-done", "no-done:0"),
        ("no-done", "no-done:1"),
    ]
    assert of(SendCheck, actions) == [] and of(Discard, actions) == []
    leftover = fresh.complete(actions)
    assert leftover == [] and fresh.table.outcome("no-done") is TxnState.COMMITTED


def test_recovered_checks_resume(h: Harness) -> None:
    h.prepare("t1")
    h.now += 60.0
    fresh, actions = recover(h)
    assert actions == []
    check = only(fresh.tick())
    assert isinstance(check, SendCheck) and check.txid == "t1"


def test_commit_record_lists_exactly_the_halves_to_publish() -> None:
    h = Harness()
    h.prepare("t1", ["a"])
    h.persist(the_write(h.end("t1", Decision.COMMIT)))
    # A half that landed after the decision (the actor broke its contract): not published.
    stray = Half(index=5, topic="b", seq=99, born=h.now)
    h.half_log.append(
        HalvesStored(txid="t1", token="tok", group="g", producer="p", halves=(stray,))
    )
    _, actions = recover(h)
    assert [a.half_seq for a in actions if isinstance(a, Publish)] == [1]


def test_a_late_half_of_a_transaction_finished_before_the_checkpoint_stays_dead() -> None:
    h = Harness()
    h.prepare("old")
    h.complete(h.end("old", Decision.ROLLBACK))
    h.prepare("open")
    h.prepare("old", first_index=1, append_refused=True)  # an actor that did not ask first
    assert h.half_log[-1].halves[0].seq == 3
    point = h.table.checkpoint()
    fresh, actions = recover(h, half_from=point.half_seq, op_from=point.op_seq)
    assert actions == [] and [v.txid for v in fresh.table.transactions()] == ["open"]


def test_replayed_records_of_finished_transactions_are_skipped(h: Harness) -> None:
    h.prepare("old")
    h.complete(h.end("old", Decision.COMMIT))
    h.prepare("open")
    fresh, _ = recover(h, half_from=2)
    assert [v.txid for v in fresh.table.transactions()] == ["open"]
    assert fresh.table.counters.replay_skipped == 2  # old's commit and done
    assert fresh.table.counters.commits == fresh.table.counters.halves_stored == 0


def test_recovery_protocol_errors(h: Harness) -> None:
    with pytest.raises(CoordinatorStateError):
        h.feed(OpReplayed(seq=1, records=()))
    with pytest.raises(CoordinatorStateError):
        h.table.finish_recovery(h.now)
    fresh = Harness()
    fresh.table.begin_recovery(half_from=1, op_from=1)
    with pytest.raises(CoordinatorStateError):
        fresh.tick()
    with pytest.raises(CoordinatorStateError):
        fresh.end("t1", Decision.COMMIT)
    h.prepare("t1")
    with pytest.raises(CoordinatorStateError):
        h.table.begin_recovery(half_from=1, op_from=1)


# ---------------------------------------------------------------- checkpoint


def test_checkpoint_follows_the_oldest_open_transaction(h: Harness) -> None:
    assert h.table.checkpoint() == coordinator.Checkpoint(1, 1)
    h.prepare("a")  # half 1
    h.prepare("b")  # half 2
    h.complete(h.end("b", Decision.COMMIT))  # ops 1, 2
    assert h.table.checkpoint() == coordinator.Checkpoint(1, 1)
    h.complete(h.end("a", Decision.ROLLBACK))  # op 3
    assert h.table.checkpoint() == coordinator.Checkpoint(3, 4)
    h.prepare("c")  # half 3, stored when the OP tail was 3
    h.prepare("d")  # half 4
    h.complete(h.end("d", Decision.COMMIT))  # ops 4, 5
    assert h.table.checkpoint() == coordinator.Checkpoint(3, 4)


def test_replaying_from_the_checkpoint_rebuilds_the_same_open_set() -> None:
    h = Harness()
    rng = random.Random(3)
    for i in range(300):
        h.prepare(f"t{i}", ["a"] * rng.randint(1, 3))
        h.now += rng.random()
        if rng.random() < 0.7:
            decided = f"t{rng.randrange(i + 1)}"
            if h.table.outcome(decided) is TxnState.PREPARED:
                h.complete(h.end(decided, rng.choice([Decision.COMMIT, Decision.ROLLBACK])))
        if i % 50 == 0:
            h.complete(h.tick(10.0))
    point = h.table.checkpoint()
    assert point.half_seq > 1 and point.op_seq > 1
    full, _ = recover(h)
    partial, _ = recover(h, half_from=point.half_seq, op_from=point.op_seq)
    assert durable(partial) == durable(full) == durable(h)


def durable(h: Harness) -> list[tuple[object, ...]]:
    """What recovery restores exactly: not the timing of the next check, nor the last
    answer, nor a check in flight (a restart forgets it and checks again)."""
    in_flight = {TxnState.CHECKING: TxnState.PREPARED}
    return [
        (
            v.txid,
            in_flight.get(v.state, v.state),
            v.half_seqs,
            v.topics,
            v.born,
            v.check_times,
            v.discard_reason,
        )
        for v in h.table.transactions()
    ]


def test_a_half_fed_out_of_order_pins_the_op_checkpoint(h: Harness) -> None:
    h.prepare("a")
    h.complete(h.end("a", Decision.COMMIT))
    late = Half(index=0, topic="x", seq=1, born=h.now)  # seq below what was already seen
    h.feed(HalvesStored(txid="late", token="t", group="g", producer="p", halves=(late,)))
    assert h.table.checkpoint().op_seq == 1


def test_transactions_of_one_pack_share_the_op_floor_of_the_first(h: Harness) -> None:
    h.prepare("x")  # half 1
    h.complete(h.end("x", Decision.COMMIT))  # ops 1, 2
    pack = [
        HalvesStored(
            txid=txid,
            token="tok",
            group="g",
            producer="p",
            halves=(Half(index=0, topic="orders", seq=2, born=h.now),),
            begins=True,
            request_id=h.request_id(),
        )
        for txid in ("a", "b")
    ]  # one pack at seq 2, known at one moment: when the OP tail was 2
    h.table.handle_batch(pack, h.now)
    h.complete(h.end("a", Decision.COMMIT))  # ops 3, 4
    assert h.table.checkpoint() == coordinator.Checkpoint(2, 3)


# ---------------------------------------------------------------- cost


def test_memory_and_tick_cost_do_not_grow_with_resolved_history() -> None:
    config = CoordinatorConfig(recent_outcomes=1000)
    h = Harness(config)
    for i in range(1000):
        h.prepare(f"open{i}")
    table, seqs = h.table, itertools.count(10_000)
    for i in range(100_000):  # the table's own events, without the harness's bookkeeping
        txid = f"done{i}"
        half = Half(index=0, topic="t", seq=next(seqs), born=h.now)
        table.handle(
            HalvesStored(txid=txid, token="k", group="g", producer="p", halves=(half,)), h.now
        )
        decision = Decision.ROLLBACK if i % 2 else Decision.COMMIT
        [write] = table.handle(End(txid=txid, token="k", decision=decision, request_id=""), h.now)
        assert isinstance(write, PersistOp)
        for action in table.handle(OpPersisted(op_id=write.op_id, seq=next(seqs)), h.now):
            if isinstance(action, Publish):
                *_, done = table.handle(Published(txid=txid, index=0), h.now)
                assert isinstance(done, PersistOp)
                table.handle(OpPersisted(op_id=done.op_id, seq=next(seqs)), h.now)
        if i % 10_000 == 0:
            assert table.tick(h.now) == []
    assert len(h.table) == 1000
    assert h.table.recent_count == 1000
    assert h.table.timer_heap_size <= 2 * 1000 + 64
    before = h.table.timer_entries_examined
    checks = h.tick(7.0)
    assert len(of(SendCheck, checks)) == 1000
    assert h.table.timer_entries_examined - before <= 2 * 1000 + 64
    assert h.table.outcome("done99999") is TxnState.ROLLED_BACK
    assert h.table.outcome("done0") is None  # evicted from the bounded memory


# ---------------------------------------------------------------- programming errors


def test_impossible_events_raise_and_change_nothing(h: Harness) -> None:
    h.prepare("t1")
    before = h.table.transactions()
    with pytest.raises(CoordinatorStateError):
        h.feed(OpPersisted(op_id=42, seq=1))
    with pytest.raises(CoordinatorStateError):
        h.feed(Published(txid="t1", index=0))
    persist = only(h.end("t1", Decision.COMMIT))
    assert isinstance(persist, PersistOp)
    h.persist(persist)
    with pytest.raises(CoordinatorStateError):
        h.feed(Published(txid="t1", index=7))
    assert h.table.outcome("t1") is TxnState.PUBLISHING
    assert before[0].half_seqs == h.table.transactions()[0].half_seqs


def test_actions_of_a_batch_survive_a_later_bad_event(h: Harness) -> None:
    h.prepare("t1")
    end = End(txid="t1", token="tok", decision=Decision.COMMIT, request_id="r")
    with pytest.raises(CoordinatorStateError):
        h.table.handle_batch([end, OpPersisted(op_id=99, seq=1)], h.now)
    persist = only(h.tick())
    assert isinstance(persist, PersistOp) and persist.records[0].kind is OpKind.COMMIT


# ---------------------------------------------------------------- config


def test_check_delay_backs_off_to_a_cap_with_deterministic_jitter() -> None:
    config = CoordinatorConfig(check_jitter=0.0)
    rng = random.Random(1)
    assert [config.check_delay(n, rng) for n in range(1, 8)] == [
        30.0,
        60.0,
        120.0,
        240.0,
        300.0,
        300.0,
        300.0,
    ]
    jittered = CoordinatorConfig()
    first = [jittered.check_delay(3, random.Random(5)) for _ in range(2)]
    assert first[0] == first[1] and 96.0 <= first[0] <= 144.0
    huge = CoordinatorConfig(check_backoff=1e300, check_interval_max=1e9, check_max=10_000)
    assert huge.check_delay(10_000, rng) <= 1.2e9


@pytest.mark.parametrize(
    "bad",
    [
        {"transaction_timeout": 0},
        {"max_immunity": 1.0},
        {"check_backoff": 0.5},
        {"check_interval_max": 1.0},
        {"check_jitter": 1.0},
        {"check_max": 0},
        {"recent_outcomes": -1},
    ],
)
def test_config_rejects_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, CoordinatorConfig)


def test_config_defaults_follow_rocketmq() -> None:
    config = CoordinatorConfig()
    assert (config.transaction_timeout, config.check_interval, config.check_max) == (6.0, 30.0, 15)
    assert (config.half_retention, config.max_immunity) == (72 * 3600.0, 3600.0)


def test_exports_are_complete() -> None:
    public = {
        name
        for name, value in vars(coordinator).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith("txactors.coordinator.")
    }
    assert public <= set(coordinator.__all__)
