"""What the table keeps per transaction, and what it shows of it: views, counters, checkpoint.

Plain data: `Txn` is mutated only by the table's rows (`moves.py`, `replay.py`), and its
`state` only by `table.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgspec

from txactors.coordinator.core.effects import CheckTarget
from txactors.coordinator.core.records import DiscardReason, Half
from txactors.coordinator.core.states import TxnState

MAX_PARKED = 1000
"""Most discarded transactions a checkpoint carries; any beyond pin the offsets as before."""


class ParkedTxn(msgspec.Struct, frozen=True, kw_only=True):
    """A DISCARDED transaction as the checkpoint keeps it: it may wait for an operator until
    retention, and carrying it here spares recovery from re-reading everything since it."""

    txid: str
    token: str
    group: str
    producer: str
    halves: tuple[Half, ...]
    check_times: int
    reason: DiscardReason
    last_check: str | None = None


class Checkpoint(msgspec.Struct, frozen=True):
    """First sequences of TXN_HALF and TXN_OP that recovery must read, and the discarded
    transactions it restores without reading (they do not hold the offsets back)."""

    half_seq: int
    op_seq: int
    discarded: tuple[ParkedTxn, ...] = ()


class TxnView(msgspec.Struct, frozen=True, kw_only=True):
    """What an operator sees of an open or discarded transaction."""

    txid: str
    state: TxnState
    group: str
    producer: str
    topics: tuple[str, ...]
    half_seqs: tuple[int, ...]
    born: float
    check_times: int
    last_check: str | None
    next_check_at: float | None
    discard_reason: DiscardReason | None


@dataclasses.dataclass
class Counters:
    """Monotonic counts for metrics (recovery replay is not counted). Without slots, like
    `Txn`: the table saves them before every event as one dict copy.

    `late_check_answers` counts answers that came after their check timed out here but
    before another check was sent: they still decide. `unexpected_check_answers` counts
    answers that could not (a newer check was out, or the transaction was decided
    meanwhile); it stays 0 in a healthy run.
    """

    halves_stored: int = 0
    commits: int = 0
    rollbacks: int = 0
    discards: int = 0
    forgotten: int = 0
    unknown_ends: int = 0
    checks_sent: int = 0
    checks_inconclusive: int = 0
    unexpected_check_answers: int = 0
    late_check_answers: int = 0
    group_check_rollbacks: int = 0
    """Rolled back by a check-back the group answered (the instance that prepared it had
    no responders): another member decided, with the log by claiming it."""
    refusals: int = 0
    replay_skipped: int = 0
    quarantined: int = 0
    """Records refused by JetStream for good, or unreadable in recovery (kept by the actor)."""


@dataclasses.dataclass(kw_only=True)
class Txn:
    """Without slots: `save` copies the instance dict in one C call, where reading 20 slots
    by name cost four times as much (four saves a transaction)."""

    txid: str
    token: str
    group: str
    producer: str
    state: TxnState
    halves: dict[int, Half]
    """Replaced, never changed in place: `save` shares it."""
    first_seq: int
    born: float
    """The oldest half's birth: retention counts from here."""
    op_floor: int
    """No op record of this or any later-stored transaction is below this TXN_OP sequence."""
    check_times: int = 0
    next_check_at: float = 0.0
    check_id: int | None = None
    timed_out_check_id: int | None = None
    """The last check that timed out here: its answer may still come, and still decide."""
    check_target: CheckTarget = CheckTarget.INSTANCE
    check_expires_at: float = 0.0
    instance_gone: bool = False
    last_check: str | None = None
    discard_reason: DiscardReason | None = None
    published: set[int] = dataclasses.field(default_factory=set)
    waiters: list[str] = dataclasses.field(default_factory=list)

    def ordered_halves(self) -> tuple[Half, ...]:
        halves = self.halves
        return tuple(map(halves.__getitem__, sorted(halves)))  # in C: no generator frame


SavedTxn = tuple[dict[str, Any], set[int] | None, list[str] | None]
"""A transaction's fields as they were, to put back if the event changing it fails: its
fields, `published` and `waiters`, None for an empty one (a plain tuple: a NamedTuple is
built in Python code)."""


def save(txn: Txn) -> SavedTxn:
    """The containers the moves change in place are copied; `halves` is replaced, never
    changed in place, so it is shared: a save per event costs O(published), not O(halves).
    An empty container is not copied (most are, at most of the four saves a transaction)."""
    published, waiters = txn.published, txn.waiters
    return (
        txn.__dict__.copy(),
        set(published) if published else None,
        list(waiters) if waiters else None,
    )


def put_back(txn: Txn, saved: SavedTxn) -> None:
    fields, published, waiters = saved
    txn.__dict__.update(fields)
    txn.published = set() if published is None else published
    txn.waiters = [] if waiters is None else waiters


def view(txn: Txn) -> TxnView:
    halves = txn.ordered_halves()
    return TxnView(
        txid=txn.txid,
        state=txn.state,
        group=txn.group,
        producer=txn.producer,
        topics=tuple(sorted({h.topic for h in halves})),
        half_seqs=tuple(h.seq for h in halves),
        born=txn.born,
        check_times=txn.check_times,
        last_check=txn.last_check,
        next_check_at=txn.next_check_at if txn.state is TxnState.PREPARED else None,
        discard_reason=txn.discard_reason,
    )


def parked(txn: Txn) -> ParkedTxn:
    return ParkedTxn(
        txid=txn.txid,
        token=txn.token,
        group=txn.group,
        producer=txn.producer,
        halves=txn.ordered_halves(),
        check_times=txn.check_times,
        reason=txn.discard_reason or DiscardReason.CHECK_MAX,
        last_check=txn.last_check,
    )


def unparked(parked: ParkedTxn, op_from: int) -> Txn:
    """A DISCARDED transaction restored from a checkpoint."""
    return Txn(
        txid=parked.txid,
        token=parked.token,
        group=parked.group,
        producer=parked.producer,
        state=TxnState.DISCARDED,
        halves={h.index: h for h in parked.halves},
        first_seq=min(h.seq for h in parked.halves),
        born=min(h.born for h in parked.halves),
        op_floor=op_from,
        check_times=parked.check_times,
        last_check=parked.last_check,
        discard_reason=parked.reason,
    )


def checkpoint(txns: Iterable[Txn], half_tail: int, op_tail: int) -> Checkpoint:
    """Where recovery must start reading so that it sees every transaction in memory.

    OP: no record of a transaction stored after the oldest open one can precede the OP
    tail we knew when that one was stored; older finished ones are not replayed at all.
    DISCARDED ones (up to MAX_PARKED) travel in the checkpoint instead of holding the
    offsets back: their records are final until an operator acts, and an operator's
    record comes after the checkpoint. Costs O(transactions in memory).
    """
    txns = list(txns)
    kept = [t for t in txns if t.state is TxnState.DISCARDED][:MAX_PARKED]
    kept_ids = {t.txid for t in kept}
    pinning = [t for t in txns if t.txid not in kept_ids]
    return Checkpoint(
        min((t.first_seq for t in pinning), default=half_tail + 1),
        min((t.op_floor for t in pinning), default=op_tail + 1),
        tuple(parked(t) for t in kept),
    )
