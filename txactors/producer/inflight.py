"""Transactions this producer is still working on, so that a check-back cannot overtake them.

The coordinator checks a transaction whose end has not come within its timeout, and it may do
so while the producer is still at work on it: the prepare's reply is on its way, or the local
transaction runs longer than the timeout. The user's checker would then read a database in
which the local transaction has not finished, and its answer could contradict the end that
follows (a COMMIT for a local transaction that then rolls back). For a transaction still in
flight here the only true answer is UNKNOWN: the coordinator asks again later, when the end
has arrived or this producer gave up on it.

A transaction is in flight from just before its first prepare is sent until its end was
answered (or failed), or it was abandoned: the `async with` block (which `send_in_transaction`
is too) was left by a cancellation, a timeout or any other interruption without an end, a
prepare was cancelled, or the transaction was dropped without an end. The first ones clear
the mark as they happen, even while a traceback still holds the transaction. The registry
holds its transactions weakly, so a dropped one (a `Transaction` is never part of a
reference cycle) stops being in flight at once and the checker answers for it again, unless
one of its sends failed: then the producer answers ROLLBACK (`failed_sends`, which outlives
this registry's entry).
"""

from __future__ import annotations

import weakref


class InFlight:
    """txid → the live transaction object, for the transactions still being worked on."""

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, txid: object) -> bool:
        return txid in self._open

    def add(self, txid: str, transaction: object) -> None:
        """`transaction` (any object that lives as long as the work on it) is at work."""
        self._open[txid] = transaction

    def discard(self, txid: str) -> None:
        """The transaction's end was answered or given up: the checker may answer now."""
        self._open.pop(txid, None)
