"""A transaction's rules (`CoordinatorConfig`): how long it may stay open and how hard the
coordinator asks about it, with RocketMQ 5.x defaults.

The coordinator enforces them and a producer's transaction log is sized by them (a row must
outlive the last check-back, `producer/txlog/retention.py`), so they sit here, below both
roles. How a coordinator process runs is `coordinator/options.py`; where a value comes from
(flags, environment, a TOML file) is `cli/settings.py`.

Every duration is in seconds. Demos and tests shrink them; nothing else in the coordinator
hard-codes a time. The backoff of the check-back schedule lives here too, because it is
nothing but arithmetic on these numbers (plus jitter drawn from a caller-supplied
`random.Random`, so a seeded test sees the same schedule every run).
"""

from __future__ import annotations

import random

import msgspec

from txactors.errors import ConfigError

HOUR = 3600.0


class CoordinatorConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How long a transaction may stay open and how hard the checker asks about it."""

    transaction_timeout: float = 6.0
    """Least time a transaction is left alone before its first check-back."""
    max_immunity: float = HOUR
    """Most time a message may ask to be left alone (its check immunity) before a check."""
    check_interval: float = 30.0
    """Delay after the first inconclusive check; later delays grow by `check_backoff`."""
    check_backoff: float = 2.0
    """Each further inconclusive check multiplies the delay by this (1.0 = fixed interval)."""
    check_interval_max: float = 300.0
    """Cap on the grown delay between two checks."""
    check_jitter: float = 0.2
    """Each delay is scaled by a uniform factor in [1 - jitter, 1 + jitter]: no check storms."""
    check_max: int = 15
    """Inconclusive checks (UNKNOWN, no answer, error) before the transaction is discarded."""
    check_answer_timeout: float = 5.0
    """How long one check-back may go unanswered before it counts as inconclusive."""
    half_retention: float = 72 * HOUR
    """Age at which an undecided transaction is discarded and a discarded one is forgotten."""
    recent_outcomes: int = 65_536
    """Finished transactions remembered so a repeated `end` still gets the right answer."""

    def __post_init__(self) -> None:
        positive = {
            "transaction_timeout": self.transaction_timeout,
            "check_interval": self.check_interval,
            "check_answer_timeout": self.check_answer_timeout,
            "half_retention": self.half_retention,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if self.max_immunity < self.transaction_timeout:
            raise ConfigError("max_immunity must be >= transaction_timeout")
        if self.check_backoff < 1.0:
            raise ConfigError("check_backoff must be >= 1.0 (delays never shrink)")
        if self.check_interval_max < self.check_interval:
            raise ConfigError("check_interval_max must be >= check_interval")
        if not 0.0 <= self.check_jitter < 1.0:
            raise ConfigError("check_jitter must be in [0, 1)")
        if self.check_max < 1:
            raise ConfigError("check_max must be >= 1")
        if self.recent_outcomes < 0:
            raise ConfigError("recent_outcomes must be >= 0")

    def immunity(self, requested: float | None) -> float:
        """A message's check immunity: its own wish, clamped to [transaction_timeout, max]."""
        wish = self.transaction_timeout if requested is None else requested
        return min(max(wish, self.transaction_timeout), self.max_immunity)

    def check_delay(self, checks_done: int, rng: random.Random) -> float:
        """Delay before the next check, after `checks_done` (>= 1) inconclusive ones."""
        base = self.backed_off_check_interval(checks_done)
        return base * rng.uniform(1.0 - self.check_jitter, 1.0 + self.check_jitter)

    def backed_off_check_interval(self, checks_done: int) -> float:
        """The check schedule: the delay after `checks_done` (>= 1) inconclusive checks,
        before jitter."""
        base = self.check_interval
        for _ in range(checks_done - 1):  # a loop, not `**`: a big exponent would overflow
            base = min(base * self.check_backoff, self.check_interval_max)
            if base == self.check_interval_max:
                break
        return base
