"""The retry schedule, with no server: RocketMQ's delays, growth, and when to dead-letter."""

from __future__ import annotations

import pytest

from txactors.consumer import DEFAULT_MAX_RECONSUME, DEFAULT_RETRY_DELAYS, RetryPolicy


def test_defaults_are_rocketmq_delay_levels() -> None:
    assert DEFAULT_MAX_RECONSUME == 16
    assert DEFAULT_RETRY_DELAYS[:5] == (1.0, 5.0, 10.0, 30.0, 60.0)
    assert DEFAULT_RETRY_DELAYS[-3:] == (1800.0, 3600.0, 7200.0)
    assert len(DEFAULT_RETRY_DELAYS) == 18


def test_default_schedule_grows_until_the_dlq() -> None:
    policy = RetryPolicy()
    waits = [policy.after_failure(n) for n in range(1, 18)]
    assert waits[-1] is None  # the 17th delivery (16th retry) failing dead-letters
    delays = [w for w in waits if w is not None]
    assert len(delays) == 16
    assert delays == sorted(delays) and len(set(delays)) == 16
    assert delays[:4] == [1.0, 5.0, 10.0, 30.0]
    assert delays[-1] == 1800.0  # 1 h and 2 h serve max_reconsume > 16


def test_retries_past_the_table_wait_the_last_delay() -> None:
    policy = RetryPolicy(max_reconsume=5, delays=[0.1, 0.2])
    assert [policy.after_failure(n) for n in range(1, 7)] == [0.1, 0.2, 0.2, 0.2, 0.2, None]
    assert policy.delay(100) == 0.2


def test_zero_retries_dead_letters_the_first_failure() -> None:
    assert RetryPolicy(max_reconsume=0).after_failure(1) is None


def test_delivery_count_beyond_the_maximum_still_dead_letters() -> None:
    # Redeliveries after a crash (ack_wait expiry) also count: never retry forever.
    assert RetryPolicy(max_reconsume=2).after_failure(50) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_reconsume": -1}, "max_reconsume"),
        ({"delays": ()}, "empty"),
        ({"delays": (1.0, -1.0)}, ">= 0"),
    ],
)
def test_invalid_policy_is_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_counts_start_at_one() -> None:
    policy = RetryPolicy()
    with pytest.raises(ValueError):
        policy.after_failure(0)
    with pytest.raises(ValueError):
        policy.delay(0)
