"""What this producer decided but could not tell the coordinator.

When an end does not reach the coordinator (or a prepare fails, so the local transaction
never ran), the check-back will ask about the transaction later, usually this very
instance first. Remembering the decision lets it answer at once and with certainty,
instead of making the user's checker reconstruct something the producer already knew.
Bounded: the oldest entries are forgotten, and then the checker answers as usual.
"""

from __future__ import annotations

from collections import OrderedDict

from txactors.errors import ConfigError
from txactors.wire.protocol import Decision

DEFAULT_CAPACITY = 10_000


class UnconfirmedOutcomes:
    """txid → COMMIT or ROLLBACK decided locally, oldest forgotten first."""

    __slots__ = ("_capacity", "_decisions")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ConfigError("capacity must be at least 1")
        self._capacity = capacity
        self._decisions: OrderedDict[str, Decision] = OrderedDict()

    def __len__(self) -> int:
        return len(self._decisions)

    def remember(self, txid: str, decision: Decision) -> None:
        if decision is Decision.UNKNOWN:
            return  # nothing was decided: the checker must answer
        self._decisions[txid] = decision
        self._decisions.move_to_end(txid)
        while len(self._decisions) > self._capacity:
            self._decisions.popitem(last=False)

    def forget(self, txid: str) -> None:
        """The coordinator confirmed a later end: its answer is the truth now."""
        self._decisions.pop(txid, None)

    def get(self, txid: str) -> Decision | None:
        return self._decisions.get(txid)
