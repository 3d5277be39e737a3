"""How long the transaction log must keep a row: as long as the coordinator may still ask.

A row answers check-backs for its transaction; once no check can come, it is dead weight.
The coordinator asks about a transaction only while it is open, and it discards every
transaction still open at `half_retention` after its first prepare (the checked-first
test in its `due` move), however its check schedule went. A check sent just before that
is answered within `check_answer_timeout` or not at all. A row is written while the first
prepare is out (`TxLog.send_in_transaction`) or after it, so a row older than

    half_retention + check_answer_timeout + clock_margin

belongs to a transaction nobody can ask about any more. `clock_margin` covers the clocks of
the coordinator and the producers disagreeing, and the prepare's time on the way (its
request timeouts and retries: seconds).

The `check_max` schedule (first check after the transaction timeout, at most `max_immunity`;
then `check_max` checks spaced by the backed-off `check_interval`) usually ends much
earlier, but it cannot shorten the age: it counts checks, not time, and a coordinator that
is down asks nothing, so the schedule resumes where it stopped when it is back. Only
`half_retention` bounds it in wall-clock time. `schedule_span` says when the schedule ends
if the coordinator runs throughout, for an operator judging how long rows are usually
still consulted.
"""

from __future__ import annotations

from typing import Final

from txactors.wire.rules import CoordinatorConfig

CLOCK_MARGIN: Final = 3600.0
"""Seconds added for clock disagreement between the coordinator and the producers."""


def retention_age(config: CoordinatorConfig, clock_margin: float = CLOCK_MARGIN) -> float:
    """Seconds after which a log row can no longer be asked about, so it may be removed."""
    if clock_margin < 0:
        raise ValueError(f"clock_margin must be >= 0, not {clock_margin}")
    return config.half_retention + config.check_answer_timeout + clock_margin


def schedule_span(config: CoordinatorConfig) -> float:
    """Seconds from the first prepare to the last possible answer of the `check_max`
    schedule, with every check inconclusive, every delay at its longest (jitter included)
    and the coordinator never down; never more than the half retention allows."""
    span = config.max_immunity + config.check_answer_timeout
    for checks_done in range(1, config.check_max):
        delay = config.backed_off_check_interval(checks_done)
        span += delay * (1.0 + config.check_jitter) + config.check_answer_timeout
    return min(span, config.half_retention + config.check_answer_timeout)
