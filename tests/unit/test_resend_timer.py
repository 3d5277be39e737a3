"""When a request with no answer goes again: well before its timeout, never for mere slowness."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from txactors.producer.resend import FACTOR, FLOOR, START, ResendTimer


def test_before_any_answer_a_request_goes_again_after_the_floor() -> None:
    assert ResendTimer().after(5.0) == max(FACTOR * START, FLOOR)


def test_slow_answers_make_the_wait_longer_up_to_half_the_timeout() -> None:
    timer = ResendTimer()
    for _ in range(100):
        timer.observe(0.4)  # a loaded coordinator: everyone waits 0.4 s
    assert 1.5 < timer.after(5.0) <= 1.6, "four times what answers take now"
    for _ in range(100):
        timer.observe(10.0)
    assert timer.after(5.0) == 2.5, "never past half the timeout"


@given(st.lists(st.floats(min_value=0.0, max_value=60.0), max_size=50), st.floats(0.01, 60.0))
def test_the_wait_is_within_the_floor_and_half_the_timeout(
    answers: list[float], timeout: float
) -> None:
    timer = ResendTimer()
    for seconds in answers:
        timer.observe(seconds)
    wait = timer.after(timeout)
    assert wait <= timeout / 2
    assert wait >= min(FLOOR, timeout / 2)
