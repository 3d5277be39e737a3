"""What the coordinator writes to its streams, and reads back on recovery.

A `Half` describes one half message in `TXN_HALF` (the actor keeps the body; the state
machine only needs where it is and when it was born). An `OpRecord` is one decision in
`TXN_OP`; several of them can share one stream message (group commit). These Structs are
the durable format: they get new fields only with defaults (see msgspec's schema evolution).
An `OpRecord` is written without the fields at their default (`omit_defaults`): a `done` is
its txid and kind; records written in full by earlier versions read the same.
"""

from __future__ import annotations

import enum

import msgspec

from txactors.wire.protocol import Decision

__all__ = ["Decision", "DiscardReason", "Half", "OpKind", "OpRecord"]


class OpKind(enum.StrEnum):
    """The kinds of op record.

    `commit`, `rollback` and `discard` are decisions; `done` closes a commit once every half
    is published. `checked` (the count of inconclusive checks so far) and `resume` (an
    operator reset the count) are advisory: they keep the check count exact across restarts.
    """

    COMMIT = "commit"
    ROLLBACK = "rollback"
    DONE = "done"
    DISCARD = "discard"
    CHECKED = "checked"
    RESUME = "resume"


class DiscardReason(enum.StrEnum):
    """Why a transaction was discarded."""

    CHECK_MAX = "check_max"  # check_max check-backs, none conclusive
    RETENTION = "retention"  # still undecided at half_retention age


class Half(msgspec.Struct, frozen=True, kw_only=True):
    """One half message as stored in TXN_HALF."""

    index: int
    """Position in its transaction; with the txid it makes the published `Nats-Msg-Id`."""
    topic: str
    seq: int
    """Sequence in TXN_HALF."""
    born: float
    """Wall-clock seconds when the coordinator stored it (a header, so recovery knows it)."""
    immunity: float | None = None
    """Seconds the producer asks to be left alone before a check-back (None: the default)."""


class OpRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One entry of TXN_OP."""

    txid: str
    kind: OpKind
    half_seqs: tuple[int, ...] = ()
    """For a commit: exactly the halves to publish (recovery publishes these, no others)."""
    check_times: int = 0
    by_operator: bool = False
    reason: DiscardReason | None = None
