"""What the coordinator actor tells the state machine: facts that already happened.

Each event is a fact the actor observed (a stream write completed, a check-back answered, a
request arrived). The state machine never learns anything any other way, which is what lets
tests drive it with no I/O and recovery rebuild it by replaying the streams.
"""

from __future__ import annotations

import enum

import msgspec

from txactors.coordinator.records import Decision, Half, OpRecord


class HalvesStored(msgspec.Struct, frozen=True, kw_only=True):
    """Halves of one transaction were appended to TXN_HALF (a prepare, or recovery replay).

    A prepare with `begins` creates the transaction (or, retried, adds nothing new); later
    ones (same txid and token, `begins=False`) add halves. The flag is stored with each
    half, so that recovery cannot mistake a late half of a finished transaction, whose
    beginning lies before the checkpoint, for a new one. `request_id` is None during
    recovery, when nobody waits for a reply.
    """

    txid: str
    token: str
    group: str
    producer: str
    """The producer instance that prepared it: the first target of its check-backs."""
    halves: tuple[Half, ...]
    begins: bool = True
    request_id: str | None = None


class End(msgspec.Struct, frozen=True, kw_only=True):
    """A producer ends its transaction (`request_id` identifies whom to reply to)."""

    txid: str
    token: str
    decision: Decision
    request_id: str


class OpPersisted(msgspec.Struct, frozen=True, kw_only=True):
    """The `PersistOp` action with this `op_id` was written to TXN_OP at `seq`."""

    op_id: int
    seq: int


class OpReplayed(msgspec.Struct, frozen=True, kw_only=True):
    """Recovery read this TXN_OP message (after all halves were replayed)."""

    seq: int
    records: tuple[OpRecord, ...]


class Published(msgspec.Struct, frozen=True, kw_only=True):
    """The topic stream acknowledged the `Publish` action of half `index`."""

    txid: str
    index: int


class CheckAnswered(msgspec.Struct, frozen=True, kw_only=True):
    """A producer answered check-back `check_id`."""

    txid: str
    check_id: int
    resolution: Decision


class CheckFailure(enum.StrEnum):
    NO_RESPONDERS = "no_responders"  # nobody listens on the subject
    TIMEOUT = "timeout"
    ERROR = "error"  # the producer's checker raised or replied with an error


class CheckFailed(msgspec.Struct, frozen=True, kw_only=True):
    """Check-back `check_id` got no usable answer."""

    txid: str
    check_id: int
    reason: CheckFailure


class Resume(msgspec.Struct, frozen=True, kw_only=True):
    """Operator: back to PREPARED with a fresh check count (from DISCARDED or pending)."""

    txid: str
    request_id: str


class ForceCommit(msgspec.Struct, frozen=True, kw_only=True):
    """Operator: commit an undecided or discarded transaction, without its token."""

    txid: str
    request_id: str


class ForceRollback(msgspec.Struct, frozen=True, kw_only=True):
    """Operator: roll back an undecided or discarded transaction, without its token."""

    txid: str
    request_id: str


Event = (
    HalvesStored
    | End
    | OpPersisted
    | OpReplayed
    | Published
    | CheckAnswered
    | CheckFailed
    | Resume
    | ForceCommit
    | ForceRollback
)
