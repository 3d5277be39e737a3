"""The bookkeeping of the producer's batched links (producer/link.py), without NATS: which
calls go out now, how a round is cut into requests, what each item is answered, and what a
refusal teaches about an older coordinator."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pytest

from txactors.errors import ActorDeadError, CommandError
from txactors.producer.batching import Coalescer, answers, chunks
from txactors.producer.dialect import RELEARN_AFTER, Dialect
from txactors.producer.timeouts import CallTimeouts
from txactors.producer.verbs import EndVerb, PrepareVerb
from txactors.wire.protocol import (
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    Decision,
    EndBatch,
    Ended,
    EndedBatch,
    EndItem,
    EndTransaction,
    Error,
    ErrorCode,
    OutgoingMessage,
    Prepare,
    PrepareBatch,
    Prepared,
    PreparedBatch,
    PrepareItem,
)

# -- Coalescer ----------------------------------------------------------------------------------


def test_a_call_opens_a_round_when_nothing_is_in_flight_and_queues_otherwise() -> None:
    link: Coalescer[str] = Coalescer()
    assert link.submit("a") is True
    assert link.opened() == ["a"]
    assert (link.submit("b"), link.submit("c")) == (False, False)
    assert (link.in_flight, len(link)) == (1, 2)
    assert link.finished() is True  # everything queued opens the next round
    assert link.opened() == ["b", "c"]
    assert (link.in_flight, len(link)) == (1, 0)
    assert link.finished() is False  # nothing queued: the link is idle
    assert link.in_flight == 0
    assert link.submit("d") is True


def test_calls_made_before_the_opened_round_is_taken_join_it() -> None:
    link: Coalescer[str] = Coalescer()
    assert [link.submit(x) for x in "abc"] == [True, False, False]
    assert (link.in_flight, len(link)) == (1, 0)
    assert link.opened() == ["a", "b", "c"]
    assert link.opened() == []  # taken once
    assert link.submit("d") is False  # the round is in flight now: d waits
    assert len(link) == 1


def test_calls_made_before_the_next_round_is_taken_join_it() -> None:
    link: Coalescer[str] = Coalescer()
    link.submit("a")
    link.opened()
    link.submit("b")
    assert link.finished() is True
    assert link.submit("c") is False  # made in the turn the answer came: joins b
    assert link.opened() == ["b", "c"]


def test_a_withdrawn_call_is_not_in_the_next_round() -> None:
    link: Coalescer[str] = Coalescer()
    link.submit("a")
    link.opened()
    link.submit("b")
    link.submit("c")
    assert link.withdraw("b") is True
    assert link.withdraw("b") is False  # no longer queued
    assert link.withdraw("a") is False  # sent: not queued at all
    assert link.finished() is True
    assert link.opened() == ["c"]


def test_a_call_withdrawn_before_its_round_is_taken_is_not_in_it() -> None:
    link: Coalescer[str] = Coalescer()
    link.submit("a")
    link.submit("b")
    assert link.withdraw("a") is True
    assert link.opened() == ["b"]
    link.submit("c")
    assert link.withdraw("c") is True
    assert link.finished() is False  # the round ends and nothing is left to send
    assert link.in_flight == 0


def test_a_wider_window_opens_that_many_rounds_before_queueing() -> None:
    link: Coalescer[str] = Coalescer(window=2)
    assert link.submit("a") is True
    assert link.opened() == ["a"]
    assert link.submit("b") is True  # a second round while the first is in flight
    assert link.opened() == ["b"]
    assert link.submit("c") is False
    assert link.finished() is True
    assert link.opened() == ["c"]
    assert link.in_flight == 2
    assert link.finished() is False
    assert link.submit("d") is True


def test_calls_queued_behind_a_wider_window_join_a_round_being_opened() -> None:
    link: Coalescer[str] = Coalescer(window=2)
    link.submit("a")
    link.opened()
    link.submit("b")
    link.opened()
    link.submit("c")  # both rounds in flight: c waits
    assert link.finished() is True  # a's round ended: c opens the next
    assert link.submit("d") is False
    assert link.finished() is False  # b's ended too: nothing queued, the opening one takes d
    assert link.opened() == ["c", "d"]
    assert link.in_flight == 1


# -- chunks -------------------------------------------------------------------------------------


def sized(items: Sequence[int]) -> bytes:
    """An item `n` takes n bytes; a request adds 10."""
    return b"x" * (10 + sum(items))


def small_answer(item: int) -> int:
    return 1


def test_a_round_is_cut_at_the_item_cap_in_order() -> None:
    parts = chunks(list(range(20)), 8, sized, 10_000, small_answer)
    assert [list(items) for items, _ in parts] == [
        list(range(8)),
        list(range(8, 16)),
        list(range(16, 20)),
    ]
    assert all(payload == sized(items) for items, payload in parts)


def test_a_round_too_large_is_halved_until_every_request_fits() -> None:
    items = [300] * 7
    parts = chunks(items, 256, sized, 1_000, small_answer)
    assert sum(len(part) for part, _ in parts) == 7
    assert all(len(payload) <= 1_000 for _, payload in parts)
    assert len(parts) == 3  # 7 → 3 + 4 → 3 + 2 + 2


def test_one_item_too_large_goes_alone_for_the_server_to_refuse() -> None:
    parts = chunks([5, 2_000, 5], 256, sized, 1_000, small_answer)
    assert [list(part) for part, _ in parts] == [[5], [2_000], [5]]


def test_a_request_carries_no_more_items_than_their_answers_fit() -> None:
    parts = chunks([1] * 10, 256, sized, 1_000, lambda item: 300)
    assert [len(part) for part, _ in parts] == [3, 3, 3, 1]


def test_the_answer_bound_is_no_looser_than_the_coordinators() -> None:
    """The coordinator counts an item's answer at its longest (an `Error` of 300 escaped
    characters, or a `Prepared` with a 128-character txid and 20-digit sequences) and refuses
    a batch whose answers could outgrow a reply: each item is counted at least that long."""
    longest_txid = "x" * 128
    error = Error("unsupported_version", "\x00" * 300, retry_after=1.7976931348623157e308)
    assert len(msgspec.json.encode(error)) < PrepareVerb("g", "p").answer_size(
        PrepareItem(txid=longest_txid, messages=[])
    )
    assert len(msgspec.json.encode(error)) < EndVerb().answer_size(
        EndItem(txid=longest_txid, token="0" * 32, decision=Decision.COMMIT)
    )
    messages = [OutgoingMessage(topic="t", body=b"")] * 1000
    prepared = Prepared(txid=longest_txid, token="0" * 32, seqs=[2**64 - 1] * 1000)
    assert len(msgspec.json.encode(prepared)) < PrepareVerb("g", "p").answer_size(
        PrepareItem(txid=longest_txid, messages=messages)
    )


# -- answers ------------------------------------------------------------------------------------


def prepared(txid: str) -> Prepared:
    return Prepared(txid=txid, token="t", seqs=[1])


def test_a_batch_reply_answers_each_item_its_own_result() -> None:
    refused = Error(ErrorCode.FORBIDDEN, "not yours", retry_after=2.0)
    got = answers(PreparedBatch(results=[prepared("a"), refused, prepared("c")]), 3, PreparedBatch)
    assert got[0] == prepared("a") and got[2] == prepared("c")
    assert isinstance(got[1], CommandError)
    assert (got[1].code, got[1].message, got[1].retry_after) == (
        ErrorCode.FORBIDDEN,
        "not yours",
        2.0,
    )


def test_an_error_for_the_whole_request_reaches_every_item_as_its_own_exception() -> None:
    got = answers(Error(ErrorCode.INTERNAL, "disk", retry_after=1.0), 3, PreparedBatch)
    assert all(isinstance(e, CommandError) and e.retry_after == 1.0 for e in got)
    assert len({id(e) for e in got}) == 3  # raised in three tasks: one each
    dead = answers(ActorDeadError("nobody"), 2, None)
    assert [type(e) for e in dead] == [ActorDeadError, ActorDeadError]
    assert dead[0] is not dead[1]


def test_a_single_reply_answers_a_single_request() -> None:
    assert answers(Ended(txid="a", state="committed"), 1, None) == [
        Ended(txid="a", state="committed")
    ]


@pytest.mark.parametrize(
    ("reply", "count", "batch"),
    [
        (PreparedBatch(results=[prepared("a")]), 2, PreparedBatch),  # too few results
        (EndedBatch(results=[]), 1, None),  # a batch answer to a single request
        (prepared("a"), 2, PreparedBatch),  # a single answer to a batch
    ],
)
def test_a_reply_that_does_not_fit_the_request_fails_every_item(
    reply: object, count: int, batch: type | None
) -> None:
    got = answers(reply, count, batch)
    assert len(got) == count
    assert all(isinstance(e, CommandError) and e.code == ErrorCode.INTERNAL for e in got)


# -- Dialect ------------------------------------------------------------------------------------


def test_a_batch_refused_as_unknown_turns_batches_off_and_keeps_the_version() -> None:
    dialect = Dialect()
    assert dialect.refused(ErrorCode.UNKNOWN_COMMAND, batch=True, version=PROTOCOL_VERSION)
    assert (dialect.batches, dialect.version) == (False, PROTOCOL_VERSION)


def test_a_batch_refused_whole_as_a_bad_request_goes_again_alone_and_batches_stay_on() -> None:
    """More items (or longer answers) than that coordinator takes: nothing was executed."""
    dialect = Dialect()
    assert dialect.refused(ErrorCode.BAD_REQUEST, batch=True, version=PROTOCOL_VERSION)
    assert (dialect.batches, dialect.version) == (True, PROTOCOL_VERSION)


def test_a_version_refused_steps_down_to_the_oldest_once() -> None:
    dialect = Dialect()
    assert dialect.refused(ErrorCode.UNSUPPORTED_VERSION, batch=False, version=PROTOCOL_VERSION)
    assert (dialect.batches, dialect.version) == (False, OLDEST_VERSION)
    # Refused again in the oldest version: a real refusal, for the caller.
    assert not dialect.refused(ErrorCode.UNSUPPORTED_VERSION, batch=False, version=OLDEST_VERSION)


@pytest.mark.parametrize(
    ("code", "batch"),
    [
        (ErrorCode.UNKNOWN_COMMAND, False),  # a single verb is no news about batches
        (ErrorCode.BAD_REQUEST, False),  # a lone command's refusal is its caller's
        (ErrorCode.FORBIDDEN, True),
        (ErrorCode.INTERNAL, True),
    ],
)
def test_other_refusals_are_the_callers(code: str, batch: bool) -> None:
    dialect = Dialect()
    assert not dialect.refused(code, batch=batch, version=PROTOCOL_VERSION)
    assert (dialect.batches, dialect.version) == (True, PROTOCOL_VERSION)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("code", "batch", "version"),
    [
        (ErrorCode.UNSUPPORTED_VERSION, False, OLDEST_VERSION),
        (ErrorCode.UNKNOWN_COMMAND, True, PROTOCOL_VERSION),
    ],
)
def test_a_downgrade_is_tried_again_after_the_interval_by_one_probe(
    code: str, batch: bool, version: int
) -> None:
    clock = Clock()
    dialect = Dialect(clock=clock)
    assert not dialect.probe_due() and not dialect.probe()  # nothing to relearn yet
    assert dialect.refused(code, batch=batch, version=PROTOCOL_VERSION)
    assert (dialect.batches, dialect.version) == (False, version)

    clock.now += RELEARN_AFTER - 0.001
    assert not dialect.probe_due() and not dialect.probe()
    clock.now += 0.001
    assert dialect.probe_due()
    assert dialect.probe()
    # One probe at a time: until it is answered, the others speak the older form.
    assert not dialect.probe_due() and not dialect.probe()
    assert (dialect.batches, dialect.version) == (False, version)

    dialect.answered(batch=False, probe=True)
    assert (dialect.batches, dialect.version) == (True, PROTOCOL_VERSION)
    assert not dialect.probe_due()


def test_a_probe_refused_stays_downgraded_for_another_interval() -> None:
    clock = Clock()
    dialect = Dialect(clock=clock)
    dialect.refused(ErrorCode.UNSUPPORTED_VERSION, batch=False, version=PROTOCOL_VERSION)
    clock.now += RELEARN_AFTER
    assert dialect.probe()
    clock.now += 1.0  # its answer takes a while
    assert dialect.refused(ErrorCode.UNSUPPORTED_VERSION, batch=True, version=PROTOCOL_VERSION)
    assert (dialect.batches, dialect.version) == (False, OLDEST_VERSION)
    clock.now += RELEARN_AFTER - 0.001
    assert not dialect.probe()
    clock.now += 0.001
    assert dialect.probe()


def test_a_probe_batch_refused_as_too_big_was_understood() -> None:
    """More items than that coordinator takes in one: it knows batches, so it is a new one."""
    clock = Clock()
    dialect = Dialect(clock=clock)
    dialect.refused(ErrorCode.UNSUPPORTED_VERSION, batch=False, version=PROTOCOL_VERSION)
    clock.now += RELEARN_AFTER
    assert dialect.probe()
    assert dialect.refused(
        ErrorCode.BAD_REQUEST, batch=True, version=PROTOCOL_VERSION, probe=True
    )  # its items go again alone
    assert (dialect.batches, dialect.version, dialect.served) == (True, PROTOCOL_VERSION, False)


def test_a_probe_never_answered_is_tried_again_an_interval_later() -> None:
    clock = Clock()
    dialect = Dialect(clock=clock, relearn_after=5.0)
    dialect.refused(ErrorCode.UNKNOWN_COMMAND, batch=True, version=PROTOCOL_VERSION)
    clock.now += 5.0
    assert dialect.probe()  # ... and lost
    clock.now += 4.999
    assert not dialect.probe()
    clock.now += 0.001
    assert dialect.probe()


def test_answers_that_are_no_probe_do_not_end_a_downgrade() -> None:
    """A request sent in the older form, or sent before the downgrade and answered late."""
    clock = Clock()
    dialect = Dialect(clock=clock)
    dialect.refused(ErrorCode.UNKNOWN_COMMAND, batch=True, version=PROTOCOL_VERSION)
    dialect.answered(batch=False, probe=False)
    dialect.answered(batch=True, probe=False)
    assert (dialect.batches, dialect.served) == (False, False)


def test_one_way_batches_wait_for_a_batch_answered_since_the_last_downgrade() -> None:
    clock = Clock()
    dialect = Dialect(clock=clock)
    dialect.answered(batch=False, probe=False)
    assert not dialect.served  # a single verb answered says nothing about batches
    dialect.answered(batch=True, probe=False)
    assert dialect.served

    dialect.refused(ErrorCode.UNSUPPORTED_VERSION, batch=False, version=PROTOCOL_VERSION)
    assert not dialect.served  # the coordinator may be an old one now
    clock.now += RELEARN_AFTER
    assert dialect.probe()
    dialect.answered(batch=False, probe=True)  # a lone probe: batches on, not yet served
    assert (dialect.batches, dialect.served) == (True, False)
    dialect.answered(batch=True, probe=False)
    assert dialect.served


def test_a_probe_answered_as_a_batch_serves_one_way_batches_at_once() -> None:
    clock = Clock()
    dialect = Dialect(clock=clock)
    dialect.refused(ErrorCode.UNKNOWN_COMMAND, batch=True, version=PROTOCOL_VERSION)
    clock.now += RELEARN_AFTER
    assert dialect.probe()
    dialect.answered(batch=True, probe=True)
    assert (dialect.batches, dialect.served, dialect.version) == (True, True, PROTOCOL_VERSION)


# -- the verbs ----------------------------------------------------------------------------------


def test_one_item_travels_as_the_single_verb_and_more_as_the_batch() -> None:
    message = OutgoingMessage(topic="orders", body=b"x")
    items = [PrepareItem(txid="a", messages=[message]), PrepareItem(txid="b", messages=[])]
    verb = PrepareVerb("shop", "p1")
    alone = msgspec.msgpack.decode(verb.encode(items[:1], 3), type=Prepare | PrepareBatch)
    assert alone == Prepare(
        txid="a", group="shop", producer="p1", messages=[message], token=None, version=3
    )
    both = msgspec.msgpack.decode(verb.encode(items, 2), type=Prepare | PrepareBatch)
    assert both == PrepareBatch(group="shop", producer="p1", items=items, version=2)

    ends = [EndItem(txid=t, token="k", decision=Decision.COMMIT) for t in "ab"]
    decode = msgspec.msgpack.Decoder(EndTransaction | EndBatch).decode
    assert decode(EndVerb().encode(ends[:1], 3)) == EndTransaction(
        txid="a", token="k", decision=Decision.COMMIT, version=3
    )
    assert decode(EndVerb().encode(ends, 3)) == EndBatch(items=ends, version=3)


# -- CallTimeouts -------------------------------------------------------------------------------


class Timer:
    def __init__(self, when: float, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when, self.callback, self.args, self.cancelled = when, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """The part of an event loop `CallTimeouts` uses; the test fires what is due."""

    def __init__(self) -> None:
        self.timers: list[Timer] = []
        self.now = 0.0

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> Timer:
        timer = Timer(when, callback, args)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[float]:
        return [t.when for t in self.timers if not t.cancelled]

    def fire(self, late: float = 0.0) -> float:
        """Run the earliest timer (`late` seconds after its time); its time."""
        timer = min((t for t in self.timers if not t.cancelled), key=lambda t: t.when)
        self.timers.remove(timer)
        self.now = timer.when + late
        timer.callback(*timer.args)
        return timer.when


class Answer:
    """A caller's future: answered or not."""

    def __init__(self) -> None:
        self.answered = False

    def done(self) -> bool:
        return self.answered


class Caller:
    def __init__(self, name: str) -> None:
        self.name, self.future = name, Answer()


def deadlines() -> tuple[CallTimeouts[Any], Loop, list[tuple[str, float]]]:
    expired: list[tuple[str, float]] = []

    def expire(caller: Any, timeout: float) -> None:
        assert not caller.future.done(), "only a caller still waiting expires"
        caller.future.answered = True  # failed with AskTimeout, in the link
        expired.append((caller.name, timeout))

    return CallTimeouts(expire), Loop(), expired


def test_each_caller_expires_at_its_own_deadline_on_one_timer() -> None:
    due, loop, expired = deadlines()
    a, b, c = Caller("a"), Caller("b"), Caller("c")
    due.add(loop, 5.0, a, 5.0)  # type: ignore[arg-type]
    due.add(loop, 5.5, b, 5.0)  # type: ignore[arg-type]
    due.add(loop, 6.0, c, 5.0)  # type: ignore[arg-type]
    assert loop.armed() == [5.0], "one timer, for the earliest deadline"

    b.future.answered = True  # answered in time: never expires
    assert loop.fire() == 5.0
    assert expired == [("a", 5.0)]
    assert loop.armed() == [6.0], "armed again for the next caller still waiting"
    assert loop.fire() == 6.0
    assert expired == [("a", 5.0), ("c", 5.0)]
    assert loop.armed() == [] and len(due) == 0


def test_a_shorter_timeout_arms_the_timer_sooner() -> None:
    due, loop, expired = deadlines()
    slow, quick = Caller("slow"), Caller("quick")
    due.add(loop, 10.0, slow, 10.0)  # type: ignore[arg-type]
    due.add(loop, 3.0, quick, 1.0)  # type: ignore[arg-type]
    assert loop.armed() == [3.0]
    assert loop.fire() == 3.0
    assert expired == [("quick", 1.0)]
    assert loop.armed() == [10.0]
    assert loop.fire() == 10.0
    assert expired == [("quick", 1.0), ("slow", 10.0)]


def test_callers_answered_are_let_go_when_the_next_deadline_is_added() -> None:
    due, loop, expired = deadlines()
    callers = [Caller(str(i)) for i in range(3)]
    for i, caller in enumerate(callers):
        due.add(loop, 5.0 + i, caller, 5.0)  # type: ignore[arg-type]
    for caller in callers:
        caller.future.answered = True
    due.add(loop, 9.0, Caller("next"), 5.0)  # type: ignore[arg-type]
    assert len(due) == 1, "the answered callers are not held until their deadlines"
    assert loop.armed() == [5.0]  # the timer armed before stays: it finds nothing due
    assert loop.fire() == 5.0 and expired == []
    assert loop.armed() == [9.0]


def test_a_timer_fired_late_expires_every_caller_overdue_by_then() -> None:
    due, loop, expired = deadlines()
    for name, deadline in (("a", 5.0), ("b", 5.5), ("c", 7.0)):
        due.add(loop, deadline, Caller(name), 5.0)  # type: ignore[arg-type]
    assert loop.fire(late=1.0) == 5.0  # the loop was busy until 6.0
    assert [name for name, _ in expired] == ["a", "b"]
    assert loop.armed() == [7.0]
