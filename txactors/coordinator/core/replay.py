"""The rows of recovery: what each replayed op record does to the transaction it names.

A record applies only from the state it was written in; any other state means a record of
an earlier, already finished incarnation (or a duplicate write), skipped and counted. The
table is in its RECOVERING phase meanwhile, which holds every effect back.
"""

from __future__ import annotations

from txactors.coordinator.core.moves import Moves
from txactors.coordinator.core.records import Decision, DiscardReason, OpRecord
from txactors.coordinator.core.states import TxnState, Where
from txactors.coordinator.core.transactions import Txn

S = TxnState


class Replay(Moves):
    """Replay moves, a base of `TransactionTable`."""

    def skip_replayed(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        """A record of an earlier, already finished incarnation (or a duplicate write)."""
        self.counters.replay_skipped += 1
        return None

    def commit_replayed(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        listed = set(record.half_seqs)
        txn.halves = {i: h for i, h in txn.halves.items() if h.seq in listed}
        self._decide(txn, Decision.COMMIT, None, by_operator=record.by_operator)
        return S.PUBLISHING  # finish_recovery publishes it again

    def rollback_replayed(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        self._decide(txn, Decision.ROLLBACK, None, by_operator=record.by_operator)
        return self._finish(txn, S.ROLLED_BACK)

    def done_replayed(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        txn.published = set(txn.halves)
        return self._finish(txn, S.COMMITTED)

    def discard_replayed(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        txn.check_times = max(txn.check_times, record.check_times)
        self._discard(txn, record.reason or DiscardReason.CHECK_MAX)
        return self.discard_written(txn, record, now)

    def checked_replayed(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        txn.check_times = max(txn.check_times, record.check_times)
        return None

    def resume_replayed(self, txn: Txn | None, record: OpRecord, now: float) -> Where | None:
        assert txn is not None
        return self._reset_checks(txn)
