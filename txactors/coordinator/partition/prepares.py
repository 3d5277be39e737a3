"""Prepares between their admission and their stored halves: what the table cannot know yet.

The table admits a prepare (`refuse_prepare`) before its halves are appended, but learns of
them only once they are stored. Meanwhile a second prepare of the same transaction (same
token, `begins=False`) must be admitted against the first, and numbered after it: this
keeps, per transaction with halves in flight, the token digest and the next half index.
"""

from __future__ import annotations

import msgspec
from nats.js.api import PubAck

from txactors.coordinator.core import tokens
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.partition.halves import StoredHalf, stored_half
from txactors.wire.protocol import ErrorCode, Prepare


class PreparesInFlight:
    def __init__(self) -> None:
        self._next: dict[str, tuple[str, int]] = {}  # txid -> (token digest, next index)

    def refusal(
        self, table: TransactionTable, prepare: Prepare, digest: str
    ) -> tuple[ErrorCode, str] | None:
        """Why the prepare is refused (None: admissible), its in-flight halves included."""
        begins = prepare.token is None
        in_flight = self._next.get(prepare.txid)
        if in_flight is None:
            return table.refuse_prepare(prepare.txid, digest, prepare.group, begins=begins)
        if begins or not tokens.same(in_flight[0], digest):
            return table.token_refusal(prepare.txid, begins=begins)
        return None

    def in_flight(self, txid: str) -> bool:
        """Halves of `txid` are being written (their acks are not back yet)."""
        return txid in self._next

    def start(
        self, table: TransactionTable, prepare: Prepare, digest: str, born: float
    ) -> list[StoredHalf]:
        """An admitted prepare's halves, not written yet (seq 0), numbered after those
        before it: what is written (`store.pack_appends`) and what the table is told."""
        in_flight = self._next.get(prepare.txid)
        if in_flight is not None:
            first = in_flight[1]
        else:
            view = table.show(prepare.txid)
            first = len(view.half_seqs) if view is not None else 0
        self._next[prepare.txid] = (digest, first + len(prepare.messages))
        return [
            stored_half(
                txid=prepare.txid,
                token_digest=digest,
                group=prepare.group,
                producer=prepare.producer,
                begins=prepare.token is None,
                index=first + offset,
                born=born,
                message=message,
            )
            for offset, message in enumerate(prepare.messages)
        ]

    def finish(
        self, prepare: Prepare, digest: str, halves: list[StoredHalf], acks: list[PubAck | None]
    ) -> tuple[list[StoredHalf], list[str]]:
        """The halves stored (each at its pack's sequence), and what JetStream refused for
        good (quarantined with its pack)."""
        txid = prepare.txid
        pairs = list(zip(halves, acks, strict=True))
        stored = [_at(half, ack.seq) for half, ack in pairs if ack]
        refused = (
            []
            if len(stored) == len(pairs)
            else [f"message {h.half.index}" for h, a in pairs if not a]
        )
        in_flight = self._next.get(txid)
        if in_flight is not None and tokens.same(in_flight[0], digest):
            last_index = max([s.half.index for s in stored], default=-1)
            if in_flight[1] <= last_index + 1 or refused:
                del self._next[txid]  # no later prepare of this txid in flight
        return stored, refused


def _at(half: StoredHalf, seq: int) -> StoredHalf:
    """`half` as stored at `seq`: what `store.read_halves` reads back from its pack."""
    return msgspec.structs.replace(half, half=msgspec.structs.replace(half.half, seq=seq))
