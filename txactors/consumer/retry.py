"""When a failed message is tried again, and when the consumer gives up on it.

Pure arithmetic on the JetStream delivery count, so it is tested without a server. The
defaults are RocketMQ's: 16 retries, waits growing from 1 s to 2 h (its delay levels), after
which the message is dead-lettered. The server keeps the count, so a consumer that restarts
between two attempts keeps the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from txactors.errors import ConfigError

MINUTE: Final = 60.0
HOUR: Final = 3600.0

DEFAULT_RETRY_DELAYS: Final[tuple[float, ...]] = (
    1.0,
    5.0,
    10.0,
    30.0,
    *(m * MINUTE for m in range(1, 11)),
    20 * MINUTE,
    30 * MINUTE,
    HOUR,
    2 * HOUR,
)
"""Seconds before retry 1, 2, 3, …; retries past the end wait as long as the last entry."""
DEFAULT_MAX_RECONSUME: Final = 16
"""Retries after the first delivery (RocketMQ's `maxReconsumeTimes`): at most 17 attempts."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How many times to retry a failing message, and how long to wait before each retry."""

    max_reconsume: int = DEFAULT_MAX_RECONSUME
    delays: tuple[float, ...] = DEFAULT_RETRY_DELAYS

    def __post_init__(self) -> None:
        if self.max_reconsume < 0:
            raise ConfigError(f"max_reconsume must be >= 0, got {self.max_reconsume}")
        if not self.delays:
            raise ConfigError("retry delays must not be empty")
        if any(d < 0 for d in self.delays):
            raise ConfigError(f"retry delays must be >= 0 seconds, got {list(self.delays)}")
        object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1 = the first retry)."""
        if retry < 1:
            raise ConfigError(f"retries are numbered from 1, got {retry}")
        return self.delays[min(retry, len(self.delays)) - 1]

    def after_failure(self, deliveries: int) -> float | None:
        """The delay before the next attempt after delivery number `deliveries` failed, or
        None when the retries are used up and the message goes to the dead-letter queue."""
        if deliveries < 1:
            raise ConfigError(f"deliveries are counted from 1, got {deliveries}")
        retry = deliveries  # the failed delivery n is followed by retry n
        if retry > self.max_reconsume:
            return None
        return self.delay(retry)
