"""How quickly a demo's faults resolve: short check-backs and redeliveries, the same in both
demos (and shrunk further by their tests), so a run with every fault takes seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from txactors.wire.rules import CoordinatorConfig


@dataclass(frozen=True, slots=True)
class Timing:
    coordinator: CoordinatorConfig = field(
        default_factory=lambda: CoordinatorConfig(
            transaction_timeout=0.5,
            check_interval=0.25,
            check_interval_max=0.5,
            check_answer_timeout=2.0,
            # Two minutes of asking: a transaction whose local work is still running is
            # answered UNKNOWN by the producer running it, and at --concurrency 500 a debit
            # can wait tens of seconds for SQLite's one writer on a loaded machine.
            # Discarding it then would leave a debit without its message. The faults are
            # settled by the first check that reaches the transaction log.
            check_max=240,
        )
    )
    ack_wait: float = 2.0
    """How long a delivered message may go unacked (its consumer died) before another
    consumer of the group gets it."""
    retry_delays: tuple[float, ...] = (0.2, 0.5, 1.0)
    drain_timeout: float = 60.0
    """How long to wait for the pipeline to empty before reconciling anyway."""
