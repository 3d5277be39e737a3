"""The states a transaction and the table itself can be in (the table's row keys).

    HalvesStored ─► PREPARED ◄──────────► CHECKING          (check sent / inconclusive)
                     │  commit / rollback / discard decided (from either)
                     ▼
    COMMITTING ─op persisted─► PUBLISHING ─all acked─► FINISHING ─done persisted─► COMMITTED
    ROLLING_BACK ─op persisted─► ROLLED_BACK
    DISCARDING ─op persisted─► DISCARDED ─operator resume/commit/rollback─► PREPARED / …

COMMITTING, PUBLISHING and FINISHING together are DESIGN §3's "COMMITTING"; splitting it
shows exactly which write the transaction waits for. Which event moves which state where is
`table.TABLE`, the one place a transaction's state changes.
"""

from __future__ import annotations

import enum


class TxnState(enum.StrEnum):
    PREPARED = "prepared"
    CHECKING = "checking"
    COMMITTING = "committing"  # commit decided; its op record is being written
    PUBLISHING = "publishing"  # commit persisted; halves are being published
    FINISHING = "finishing"  # all published; the `done` record is being written
    COMMITTED = "committed"
    ROLLING_BACK = "rolling_back"  # rollback decided; its op record is being written
    ROLLED_BACK = "rolled_back"
    DISCARDING = "discarding"  # discard decided; its op record is being written
    DISCARDED = "discarded"


class Gone(enum.StrEnum):
    """Where a transaction is when it is not in the open table (and not recently final)."""

    UNKNOWN = "unknown"  # never seen, or aged out of the memory of recent outcomes
    FORGOTTEN = "forgotten"  # discarded, then dropped from memory at half_retention


Where = TxnState | Gone
"""A row key of the transition table: the state of a transaction, in memory or not."""


class Phase(enum.StrEnum):
    """The table's own state: recovery is a phase of the table, not a mode of the actor."""

    FRESH = "fresh"  # nothing fed yet: recovery may begin, or work may start at once
    RECOVERING = "recovering"  # replaying TXN_HALF then TXN_OP: effects are held back
    RUNNING = "running"


S = TxnState

# The members as module constants, which the table's per-event code reads: on Python 3.11
# every `TxnState.X` goes through `EnumType.__getattr__`'s lookup hook, ten times a global's
# cost (about 30 such reads a transaction in the coordinator).
PREPARED = S.PREPARED
CHECKING = S.CHECKING
COMMITTING = S.COMMITTING
PUBLISHING = S.PUBLISHING
FINISHING = S.FINISHING
COMMITTED = S.COMMITTED
ROLLING_BACK = S.ROLLING_BACK
ROLLED_BACK = S.ROLLED_BACK
DISCARDING = S.DISCARDING
DISCARDED = S.DISCARDED
UNKNOWN = Gone.UNKNOWN
FORGOTTEN = Gone.FORGOTTEN

OPEN = frozenset({S.PREPARED, S.CHECKING})
"""Undecided: an `end`, a check answer or the checker may still decide."""

FINAL = frozenset({S.COMMITTED, S.ROLLED_BACK})
"""Nothing ever leaves these; the transaction is dropped from memory."""

LEAVES_MEMORY: frozenset[Where] = frozenset({*FINAL, Gone.FORGOTTEN})
"""Targets after which a transaction is kept only among the recent outcomes."""
