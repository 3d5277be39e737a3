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
from functools import partial


class InFlight:
    """txid → the live transaction object, for the transactions still being worked on.

    A dict of weak references whose callbacks drop their own entry, rather than a
    `WeakValueDictionary`: the same, without its Python-level reference class per entry."""

    __slots__ = ("__weakref__", "_open", "_self")

    def __init__(self) -> None:
        self._open: dict[str, weakref.ref[object]] = {}
        self._self = weakref.ref(self)

    def __len__(self) -> int:
        return sum(1 for ref in self._open.values() if ref() is not None)

    def __contains__(self, txid: object) -> bool:
        ref = self._open.get(txid)  # type: ignore[call-overload]
        return ref is not None and ref() is not None

    def add(self, txid: str, transaction: object) -> None:
        """`transaction` (any object that lives as long as the work on it) is at work."""
        self._open[txid] = weakref.ref(transaction, partial(_dropped, self._self, txid))

    def discard(self, txid: str) -> None:
        """The transaction's end was answered or given up: the checker may answer now."""
        self._open.pop(txid, None)


def _dropped(registry: weakref.ref[InFlight], txid: str, ref: weakref.ref[object]) -> None:
    """A transaction was dropped while in flight: its entry goes (unless replaced since)."""
    in_flight = registry()
    if in_flight is not None and in_flight._open.get(txid) is ref:
        del in_flight._open[txid]
