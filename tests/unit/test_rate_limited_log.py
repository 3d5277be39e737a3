"""The one rate limiter of log lines (one-way errors, refused reply subjects), without a server."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from txactors.observe.logs import LOG_EVERY, MAX_KINDS, RateLimited


@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, LOG_EVERY * 3)), max_size=60))
def test_one_line_per_kind_and_interval_and_every_line_held_back_is_reported(
    lines: list[tuple[str, float]],
) -> None:
    now = [0.0]
    limiter = RateLimited(clock=lambda: now[0])
    let_through: dict[str, float] = {}
    held: dict[str, int] = {}
    for kind, step in lines:
        now[0] += step
        suppressed = limiter.suppressed(kind)
        last = let_through.get(kind)
        if last is not None and now[0] - last < LOG_EVERY:
            assert suppressed is None
            held[kind] = held.get(kind, 0) + 1
        else:
            assert suppressed == held.pop(kind, 0)
            let_through[kind] = now[0]


def test_its_memory_is_bounded_however_many_kinds_a_client_makes_up() -> None:
    """Past MAX_KINDS kinds it starts over: an early kind is forgotten (let through again)."""
    limiter = RateLimited(clock=lambda: 0.0)
    assert limiter.suppressed("pattern-0") == 0
    assert limiter.suppressed("pattern-0") is None  # remembered: held back
    for index in range(1, MAX_KINDS + 1):
        assert limiter.suppressed(f"pattern-{index}") == 0
    assert limiter.suppressed("pattern-0") == 0
