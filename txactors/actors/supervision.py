"""What happens when an actor's handler raises: a small policy, not a framework.

The directive comes from a `decide` function of the error (as in Proto.Actor's
`directive.go`): RESUME keeps the instance and its state, RESTART replaces it with a fresh
one from the factory after an exponential backoff, STOP ends the actor, ESCALATE fails the
whole ActorSystem. Restarts are budgeted: more than `max_restarts` inside `within` seconds
means the failure is not transient, so the actor stops and reports instead of spinning.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from txactors.errors import ConfigError


class Directive(enum.Enum):
    RESUME = "resume"
    RESTART = "restart"
    STOP = "stop"
    ESCALATE = "escalate"


def always_restart(error: Exception) -> Directive:
    """The default: a failed handler may have left the state inconsistent, so start fresh."""
    return Directive.RESTART


@dataclass(frozen=True, slots=True)
class Supervisor:
    decide: Callable[[Exception], Directive] = always_restart
    max_restarts: int = 3
    within: float = 60.0
    backoff_initial: float = 0.05
    backoff_max: float = 5.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.within <= 0:
            raise ConfigError("Supervisor needs max_restarts >= 0 and within > 0")
        if not 0 <= self.backoff_initial <= self.backoff_max:
            raise ConfigError("Supervisor needs 0 <= backoff_initial <= backoff_max")


class RestartBudget:
    """Counts restarts in a sliding window; pure, the caller passes the time."""

    __slots__ = ("_policy", "_restarts")

    def __init__(self, policy: Supervisor) -> None:
        self._policy = policy
        self._restarts: deque[float] = deque()

    def next_delay(self, now: float) -> float | None:
        """Backoff before the next restart, or None when the budget is spent."""
        while self._restarts and now - self._restarts[0] > self._policy.within:
            self._restarts.popleft()
        if len(self._restarts) >= self._policy.max_restarts:
            return None
        delay = self._policy.backoff_initial * 2.0 ** len(self._restarts)
        self._restarts.append(now)
        return min(delay, self._policy.backoff_max)
