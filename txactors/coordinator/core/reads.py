"""What the table answers without changing: states, views, admission, the checkpoint."""

from __future__ import annotations

from collections.abc import Collection

from txactors.coordinator.core import admission
from txactors.coordinator.core.deadlines import Deadlines
from txactors.coordinator.core.recent import RecentOutcomes
from txactors.coordinator.core.states import DISCARDED, FORGOTTEN, UNKNOWN, TxnState, Where
from txactors.coordinator.core.transactions import Checkpoint, Txn, TxnView, checkpoint, view
from txactors.wire.protocol import ErrorCode


class Reads:
    """The read side of `TransactionTable`: the data below is the table's."""

    _open: dict[str, Txn]
    _recent: RecentOutcomes
    _deadlines: Deadlines
    _half_tail: int
    _op_tail: int

    def refuse_prepare(
        self, txid: str, token: str, group: str, *, begins: bool
    ) -> tuple[ErrorCode, str] | None:
        """Why halves for `txid` would be refused (None: admissible). Call before appending."""
        return admission.refuse_prepare(
            self._open.get(txid), self._recent.get(txid), txid, token, group, begins=begins
        )

    token_refusal = staticmethod(admission.token_refusal)

    def outcome(self, txid: str) -> TxnState | None:
        """State of an open transaction or a recently finished one (None: not known)."""
        txn = self._open.get(txid)
        if txn is not None:
            return txn.state
        finished = self._recent.get(txid)
        return None if finished is None else finished.state

    def where(self, txid: str) -> Where:
        """The transaction's row key in `TABLE`."""
        txn = self._open.get(txid)
        if txn is not None:
            return txn.state
        finished = self._recent.get(txid)
        if finished is None:
            return UNKNOWN
        return FORGOTTEN if finished.state is DISCARDED else finished.state

    def show(self, txid: str) -> TxnView | None:
        txn = self._open.get(txid)
        return None if txn is None else view(txn)

    def group_of(self, txid: str) -> str | None:
        """The producer group of an open transaction (None: not open here); cheaper than
        `show` for the tenant check every grouped end makes."""
        txn = self._open.get(txid)
        return None if txn is None else txn.group

    def transactions(self, states: Collection[TxnState] | None = None) -> list[TxnView]:
        """Open and discarded transactions (optionally only in `states`), oldest first."""
        views = [view(t) for t in self._open.values() if states is None or t.state in states]
        return sorted(views, key=lambda v: v.born)

    def checkpoint(self) -> Checkpoint:
        """Where recovery must start reading (see `transactions.checkpoint`)."""
        return checkpoint(self._open.values(), self._half_tail, self._op_tail)

    def op_floor(self) -> int:
        """The first TXN_OP sequence a record of a transaction whose halves are taken in now
        can have (as a new transaction's `op_floor`): nothing of it was decided before."""
        return self._op_tail + 1

    def next_deadline(self) -> float | None:
        """When `tick` next has work; the actor sleeps until then (or the next event)."""
        return self._deadlines.earliest()

    def __len__(self) -> int:
        """Transactions in memory: open, deciding, and discarded within retention."""
        return len(self._open)

    @property
    def recent_count(self) -> int:
        return len(self._recent)

    @property
    def timer_heap_size(self) -> int:
        return self._deadlines.heap_size

    @property
    def timer_entries_examined(self) -> int:
        return self._deadlines.examined
