"""Which orders get which fault (the fault kinds are shared: `apps.common.faults`).

A plan is drawn once, up front, from a seeded random generator: the run is reproducible, and
reconciliation knows no more than the databases tell it (the plan only decides what to
break, never what the right answer is).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from apps.common.faults import Fault


@dataclass(frozen=True)
class FaultPlan:
    """Order ids singled out for each fault; the other orders are simply paid."""

    declined: frozenset[str] = frozenset()
    end_lost: frozenset[str] = frozenset()
    killed_before_commit: frozenset[str] = frozenset()
    killed_after_commit: frozenset[str] = frozenset()
    lose_first_ack: frozenset[str] = frozenset()
    consumer_killed: bool = False

    @classmethod
    def draw(
        cls, order_ids: Sequence[str], faults: Iterable[Fault], rng: random.Random
    ) -> FaultPlan:
        faults = frozenset(faults)
        pool = list(order_ids)
        rng.shuffle(pool)
        n = len(pool)

        def take(enabled: bool, count: int) -> frozenset[str]:
            chosen = pool[:count] if enabled else []
            del pool[: len(chosen)]
            return frozenset(chosen)

        killed = Fault.PRODUCER_CRASH in faults
        declined = take(Fault.LOCAL_FAILURE in faults, max(1, n // 10))
        killed_before_commit = take(killed, 1)
        killed_after_commit = take(killed, 1)
        end_lost = take(Fault.LOST_END in faults, max(1, n // 20))
        # Duplicates only matter for orders that end up paid: pick them from the rest.
        lose_first_ack = take(Fault.DUPLICATE in faults, max(1, n // 10))
        return cls(
            declined=declined,
            end_lost=end_lost,
            killed_before_commit=killed_before_commit,
            killed_after_commit=killed_after_commit,
            lose_first_ack=lose_first_ack,
            consumer_killed=Fault.CONSUMER_CRASH in faults,
        )
