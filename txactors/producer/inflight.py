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

UNKNOWN is no answer at the last check (`CheckTransaction.last`): the coordinator would
discard the transaction, and a local commit after it would be kept while the message is not
delivered. Where the producer makes the local commit itself (`TxLog.send_in_transaction`:
its `LocalCommit`), the last check decides instead. Before that commit begins, it claims the
transaction, ROLLBACK, and the commit is refused (`RolledBackByCheck`, as for a txid the log's
check claimed); once it began, the checker answers (the log waits for its outcome). A
transaction whose local commit is the caller's own (a `begin()` block) stays UNKNOWN, and
is discarded: an operator's `txn resume` asks again.
"""

from __future__ import annotations

import weakref
from functools import partial

from txactors.errors import RolledBackByCheck


class LocalCommit:
    """The local commit of a transaction in flight, made by the producer itself: the last
    check-back claims the transaction unless the commit has begun."""

    __slots__ = ("begun", "claimed", "txid")

    def __init__(self, txid: str) -> None:
        self.txid = txid
        self.claimed = False
        self.begun = False

    def claim(self) -> bool:
        """At the last check: whether the transaction is now rolled back (the commit had not
        begun; it will be refused). False once it began: its outcome is the log's."""
        if not self.begun:
            self.claimed = True
        return self.claimed

    def begin(self) -> None:
        """Just before the local commit: `RolledBackByCheck` if the last check claimed the
        transaction (roll the local transaction back), else no check can claim it now."""
        if self.claimed:
            raise RolledBackByCheck(
                f"transaction {self.txid} was still in flight at its last check-back, which "
                "rolled it back; roll the local transaction back",
                txid=self.txid,
            )
        self.begun = True


class InFlight:
    """txid → the live transaction object, for the transactions still being worked on, and
    the `LocalCommit` of those whose local commit the producer makes.

    A dict of weak references whose callbacks drop their own entry, rather than a
    `WeakValueDictionary`: the same, without its Python-level reference class per entry."""

    __slots__ = ("__weakref__", "_commits", "_open", "_self")

    def __init__(self) -> None:
        self._open: dict[str, weakref.ref[object]] = {}
        self._commits: dict[str, LocalCommit] = {}
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
        self._commits.pop(txid, None)

    def local_commit(self, txid: str) -> LocalCommit:
        """The producer will make `txid`'s local commit: the last check may claim it first."""
        commit = self._commits[txid] = LocalCommit(txid)
        return commit

    def claim(self, txid: str) -> bool | None:
        """At the last check of `txid`, in flight: True if it is now rolled back, False if
        its local commit began, None if that commit is not the producer's to refuse."""
        commit = self._commits.get(txid)
        return None if commit is None else commit.claim()


def _dropped(registry: weakref.ref[InFlight], txid: str, ref: weakref.ref[object]) -> None:
    """A transaction was dropped while in flight: its entry goes (unless replaced since)."""
    in_flight = registry()
    if in_flight is not None and in_flight._open.get(txid) is ref:
        del in_flight._open[txid]
        in_flight._commits.pop(txid, None)
