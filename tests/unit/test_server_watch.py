"""When a client leaves its server (`nats/watchdog.py`'s `Watch`), decided with no I/O: the
times are given, as a clock would give them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from txactors.errors import ConfigError
from txactors.nats.watchdog import Step, Watch, WatchPolicy, routed

POLICY = WatchPolicy(grace=3.0, probe_every=1.0, ping_every=2.0, signs_last=10.0, max_grace=20.0)


def failing_probes(watch: Watch, start: float, until: float) -> float:
    """Judge whenever the watch asks, every judgement failing, from `start` until it says
    LOOK_ELSEWHERE or `until`; the time it said so (or `until`)."""
    now = start
    while now < until:
        step = watch.step(now, elsewhere=True)
        if step is Step.LOOK_ELSEWHERE:
            return now
        if step is Step.PROBE:
            watch.probed(now, passed=False)
        now = max(watch.wake_at(now), now + 0.01)
    return until


def test_a_quiet_connection_is_only_pinged() -> None:
    watch = Watch(POLICY, now=0.0)
    assert watch.step(1.0, elsewhere=True) is Step.WAIT
    assert watch.wake_at(1.0) == 2.0
    assert watch.step(2.0, elsewhere=True) is Step.PING
    watch.pinged(2.1, answered=True)
    assert watch.step(3.0, elsewhere=True) is Step.WAIT
    assert watch.wake_at(3.0) == pytest.approx(4.1)


def test_a_sign_starts_the_probes_and_a_passing_probe_moves_nobody() -> None:
    watch = Watch(POLICY, now=0.0)
    watch.sign(0.5)
    assert watch.step(0.5, elsewhere=True) is Step.PROBE
    watch.probed(0.6, passed=True)
    assert watch.step(1.0, elsewhere=True) is Step.WAIT
    assert watch.step(1.6, elsewhere=True) is Step.PROBE  # signs stay fresh for signs_last
    for t in range(2, 30):  # a service nobody runs: signs go on, the probes pass
        watch.sign(float(t))
        if watch.step(float(t), elsewhere=True) is Step.PROBE:
            watch.probed(float(t), passed=True)
        assert watch.step(float(t), elsewhere=True) is not Step.LOOK_ELSEWHERE


def test_probes_failing_for_the_grace_make_the_client_leave() -> None:
    watch = Watch(POLICY, now=0.0)
    watch.sign(10.0)
    assert failing_probes(watch, 10.0, 60.0) == pytest.approx(10.0 + POLICY.grace)


def test_an_unanswered_ping_is_a_sign() -> None:
    watch = Watch(POLICY, now=0.0)
    assert watch.step(2.0, elsewhere=True) is Step.PING
    watch.pinged(3.0, answered=False)  # a paused server
    assert watch.step(3.0, elsewhere=True) is Step.PROBE
    assert failing_probes(watch, 3.0, 60.0) == pytest.approx(3.0 + POLICY.grace)


def test_one_passing_probe_in_the_run_starts_it_over() -> None:
    watch = Watch(POLICY, now=0.0)
    watch.sign(0.0)
    watch.probed(0.0, passed=False)
    watch.probed(1.0, passed=False)
    watch.probed(2.0, passed=True)  # an election ended
    watch.probed(3.0, passed=False)
    assert watch.step(5.9, elsewhere=True) is not Step.LOOK_ELSEWHERE
    assert failing_probes(watch, 4.0, 60.0) == pytest.approx(3.0 + POLICY.grace)


def test_one_failed_probe_is_not_enough_however_long_ago() -> None:
    watch = Watch(POLICY, now=0.0)
    watch.sign(0.0)
    watch.probed(0.0, passed=False)
    assert watch.step(100.0, elsewhere=True) is not Step.LOOK_ELSEWHERE


def test_a_client_with_nowhere_to_go_never_moves_nor_asks() -> None:
    """One server (an embedded one, a single node): no ping, no probe, no move."""
    watch = Watch(POLICY, now=0.0)
    for t in range(100):
        watch.sign(float(t))
        watch.probed(float(t), passed=False)
        assert watch.step(float(t), elsewhere=False) is Step.WAIT


def test_each_look_elsewhere_without_a_pass_doubles_the_grace_up_to_its_bound() -> None:
    """A cluster with no leader anywhere: no server passes, so the client stays, and looks
    again later and later; a move it made that no pass followed counts the same."""
    watch = Watch(POLICY, now=0.0)
    watch.sign(0.0)
    now, graces = 0.0, []
    for moved in (False, True, False, False, False):
        looked = failing_probes(watch, now, now + 100)
        graces.append(round(looked - now))
        watch.looked(looked, moved=moved)
        now = looked
    assert graces == [3, 6, 12, 20, 20]
    watch.probed(now, passed=True)  # a server that serves again
    assert watch.grace == POLICY.grace


def test_a_move_nats_py_made_itself_starts_the_run_over_and_judges_the_new_server() -> None:
    watch = Watch(POLICY, now=0.0)
    watch.sign(0.0)
    watch.probed(0.0, passed=False)
    watch.probed(1.0, passed=False)
    watch.moved(1.5)  # its server died: nats-py reconnected elsewhere
    assert watch.step(1.5, elsewhere=True) is Step.PROBE
    assert watch.grace == POLICY.grace
    assert failing_probes(watch, 1.5, 60.0) == pytest.approx(1.5 + POLICY.grace)


def test_a_move_it_made_judges_the_new_server_at_once() -> None:
    watch = Watch(POLICY, now=0.0)
    watch.sign(0.0)
    watch.probed(0.0, passed=False)
    watch.probed(0.5, passed=False)
    watch.looked(3.0, moved=True)
    assert watch.step(3.0, elsewhere=True) is Step.PROBE


@pytest.mark.parametrize(
    ("peers", "cluster_size", "majority"),
    [
        (3, 3, True),
        (2, 3, True),  # a node of three killed or cut: the other two still make a quorum
        (1, 3, False),  # the node cut off: it routes to nobody
        (2, 4, False),
        (3, 5, True),
        (None, 3, True),  # a server that tells of no peers (no_advertise): not judged by it
    ],
)
def test_a_server_is_routed_when_it_reaches_a_majority(
    peers: int | None, cluster_size: int, majority: bool
) -> None:
    assert routed(peers, cluster_size) is majority


@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 5.0),
            st.sampled_from(["sign", "ping_ok", "ping_lost", "pass", "fail", "moved", "stayed"]),
        ),
        max_size=60,
    )
)
def test_wake_at_is_never_now_when_the_watch_says_wait(
    events: list[tuple[float, str]],
) -> None:
    """The loop sleeps until `wake_at`: a WAIT with a wake time not ahead would spin it."""
    watch, now = Watch(POLICY, now=0.0), 0.0
    for delay, event in events:
        now += delay
        match event:
            case "sign":
                watch.sign(now)
            case "ping_ok" | "ping_lost":
                watch.pinged(now, answered=event == "ping_ok")
            case "pass" | "fail":
                watch.probed(now, passed=event == "pass")
            case "moved":
                watch.looked(now, moved=True)
            case "stayed":
                watch.looked(now, moved=False)
        if watch.step(now, elsewhere=True) is Step.WAIT:
            assert watch.wake_at(now) > now


@pytest.mark.parametrize(
    "bad",
    [
        {"grace": 0},
        {"probe_timeout": -1},
        {"probe_every": math.nan},
        {"ping_every": math.inf},
        {"grace": 10, "max_grace": 5},
    ],
)
def test_a_bad_policy_is_a_config_error(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        WatchPolicy(**bad)
