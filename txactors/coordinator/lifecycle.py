"""The states of a transaction and the only moves between them (h11's `_state.py` idea).

Transitions are data: `LEGAL_MOVES` lists, for each state, where it may go next. The
state machine in `state.py` moves a transaction only through `LEGAL_MOVES`, so a bug that
would (say) publish a rolled-back transaction fails loudly instead of corrupting state.

    HalvesStored ─► PREPARED ◄──────────► CHECKING          (check sent / inconclusive)
                     │  commit / rollback / discard decided (from either)
                     ▼
    COMMITTING ─op persisted─► PUBLISHING ─all acked─► FINISHING ─done persisted─► COMMITTED
    ROLLING_BACK ─op persisted─► ROLLED_BACK
    DISCARDING ─op persisted─► DISCARDED ─operator resume/commit/rollback─► PREPARED / …

COMMITTING, PUBLISHING and FINISHING together are DESIGN §3's "COMMITTING"; splitting it
shows exactly which write the transaction waits for.
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


S = TxnState

LEGAL_MOVES: dict[TxnState, frozenset[TxnState]] = {
    S.PREPARED: frozenset({S.CHECKING, S.COMMITTING, S.ROLLING_BACK, S.DISCARDING}),
    S.CHECKING: frozenset({S.PREPARED, S.COMMITTING, S.ROLLING_BACK, S.DISCARDING}),
    S.COMMITTING: frozenset({S.PUBLISHING}),
    S.PUBLISHING: frozenset({S.FINISHING}),
    S.FINISHING: frozenset({S.COMMITTED}),
    S.ROLLING_BACK: frozenset({S.ROLLED_BACK}),
    S.DISCARDING: frozenset({S.DISCARDED}),
    # Final for the checker; only an operator's resume / force-commit / force-rollback.
    S.DISCARDED: frozenset({S.PREPARED, S.COMMITTING, S.ROLLING_BACK}),
    S.COMMITTED: frozenset(),
    S.ROLLED_BACK: frozenset(),
}

OPEN = frozenset({S.PREPARED, S.CHECKING})
"""Undecided: an `end`, a check answer or the checker may still decide."""

FINAL = frozenset({S.COMMITTED, S.ROLLED_BACK})
"""Nothing ever leaves these; the transaction is dropped from memory."""

COMMIT_PATH = frozenset({S.COMMITTING, S.PUBLISHING, S.FINISHING, S.COMMITTED})
ROLLBACK_PATH = frozenset({S.ROLLING_BACK, S.ROLLED_BACK})
DISCARD_PATH = frozenset({S.DISCARDING, S.DISCARDED})
