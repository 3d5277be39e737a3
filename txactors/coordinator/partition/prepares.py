"""Prepares between their admission and their stored halves: what the table cannot know yet.

The table admits a prepare (`refuse_prepare`) before its halves are appended, but learns of
them only once they are stored. Meanwhile a second prepare of the same transaction (same
token, `begins=False`) must be admitted against the first, and numbered after it: this
keeps, per transaction with halves in flight, the token digest and the next half index.
"""

from __future__ import annotations

from nats.js.api import PubAck

from txactors.coordinator.core import tokens
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.partition.store import (
    StoredHalf,
    half_headers,
    half_identity,
    stored_half,
)
from txactors.nats.writer import Append
from txactors.wire import layout
from txactors.wire.protocol import ErrorCode, OutgoingMessage, Prepare


class PreparesInFlight:
    def __init__(self, partition: int) -> None:
        self._partition = partition
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
    ) -> list[Append]:
        """The appends of an admitted prepare's halves, numbered after those before it."""
        in_flight = self._next.get(prepare.txid)
        if in_flight is not None:
            first = in_flight[1]
        else:
            view = table.show(prepare.txid)
            first = len(view.half_seqs) if view is not None else 0
        self._next[prepare.txid] = (digest, first + len(prepare.messages))
        return [
            Append(
                layout.half_subject(self._partition),
                message.body,
                half_headers(
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
                ),
                layout.HALF_STREAM,
            )
            for offset, message in enumerate(prepare.messages)
        ]

    def finish(
        self, prepare: Prepare, digest: str, appends: list[Append], acks: list[PubAck | None]
    ) -> tuple[list[StoredHalf], list[str]]:
        """The halves stored, and what JetStream refused for good (quarantined)."""
        txid = prepare.txid
        triples = list(zip(prepare.messages, appends, acks, strict=True))
        stored = [_stored(prepare, digest, m, a, ack.seq) for m, a, ack in triples if ack]
        refused = [f"message {half_identity(a.headers)[1]}" for _, a, ack in triples if not ack]
        in_flight = self._next.get(txid)
        if in_flight is not None and tokens.same(in_flight[0], digest):
            last_index = max((s.half.index for s in stored), default=-1)
            if in_flight[1] <= last_index + 1 or refused:
                del self._next[txid]  # no later prepare of this txid in flight
        return stored, refused


def _stored(
    prepare: Prepare, digest: str, message: OutgoingMessage, append: Append, seq: int
) -> StoredHalf:
    """The half as `read_half` would read it back, built from what was written instead of
    parsing its headers again. Equal because the boundary refused reserved property names
    (the only ones `read_half` drops) and these headers never crossed the wire."""
    return stored_half(
        txid=prepare.txid,
        token_digest=digest,
        group=prepare.group,
        producer=prepare.producer,
        begins=prepare.token is None,
        index=half_identity(append.headers)[1],
        born=float(append.headers[layout.BORN_HEADER]),
        message=message,
        seq=seq,
    )
