"""What the coordinator actor tells the table: facts that already happened.

Each event is a fact the actor observed (a stream write completed, a check-back answered, a
request arrived). The table never learns anything any other way, which is what lets tests
drive it with no I/O and recovery rebuild it by replaying the streams. `Kind` is the table's
alphabet: what one event (or one record of an op message, or one due deadline) means to one
transaction; `kind_of` and `record_kind` map events onto it.
"""

from __future__ import annotations

import enum

import msgspec

from txactors.coordinator.core.records import Decision, Half, OpKind, OpRecord
from txactors.wire.protocol import Resolution


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


class HalvesRefused(msgspec.Struct, frozen=True, kw_only=True):
    """JetStream refused halves of a prepare of this transaction for good (they are
    quarantined): nothing of it may ever be delivered, so what did land is rolled back."""

    txid: str
    token: str


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


class OperatorDecided(msgspec.Struct, frozen=True, kw_only=True):
    """Operator, without the token: `RESUME` puts a discarded or pending transaction back to
    PREPARED with a fresh check count; `COMMIT` / `ROLLBACK` force an undecided or discarded
    one. One event for the wire's one `OperatorDecision` path."""

    txid: str
    resolution: Resolution
    request_id: str


Event = (
    HalvesStored
    | HalvesRefused
    | End
    | OpPersisted
    | OpReplayed
    | Published
    | CheckAnswered
    | CheckFailed
    | OperatorDecided
)


class Kind(enum.StrEnum):
    """The columns of the transition table."""

    HALVES = "halves"  # HalvesStored
    HALVES_REFUSED = "halves_refused"
    END_COMMIT = "end_commit"  # End(COMMIT)
    END_ROLLBACK = "end_rollback"
    END_UNKNOWN = "end_unknown"
    FORCE_COMMIT = "force_commit"
    FORCE_ROLLBACK = "force_rollback"
    RESUME = "resume"
    CHECK_ANSWERED = "check_answered"
    CHECK_FAILED = "check_failed"
    PUBLISHED = "published"
    DUE = "due"  # its deadline came (`tick`)
    COMMIT_WRITTEN = "commit_written"  # one record of an OpPersisted
    ROLLBACK_WRITTEN = "rollback_written"
    DONE_WRITTEN = "done_written"
    DISCARD_WRITTEN = "discard_written"
    COMMIT_REPLAYED = "commit_replayed"  # one record of an OpReplayed
    ROLLBACK_REPLAYED = "rollback_replayed"
    DONE_REPLAYED = "done_replayed"
    DISCARD_REPLAYED = "discard_replayed"
    CHECKED_REPLAYED = "checked_replayed"
    RESUME_REPLAYED = "resume_replayed"


_END_KINDS = {
    Decision.COMMIT: Kind.END_COMMIT,
    Decision.ROLLBACK: Kind.END_ROLLBACK,
    Decision.UNKNOWN: Kind.END_UNKNOWN,
}
_OPERATOR_KINDS = {
    Resolution.RESUME: Kind.RESUME,
    Resolution.COMMIT: Kind.FORCE_COMMIT,
    Resolution.ROLLBACK: Kind.FORCE_ROLLBACK,
}
_WRITTEN_KINDS = {
    OpKind.COMMIT: Kind.COMMIT_WRITTEN,
    OpKind.ROLLBACK: Kind.ROLLBACK_WRITTEN,
    OpKind.DONE: Kind.DONE_WRITTEN,
    OpKind.DISCARD: Kind.DISCARD_WRITTEN,
}
_REPLAYED_KINDS = {
    OpKind.COMMIT: Kind.COMMIT_REPLAYED,
    OpKind.ROLLBACK: Kind.ROLLBACK_REPLAYED,
    OpKind.DONE: Kind.DONE_REPLAYED,
    OpKind.DISCARD: Kind.DISCARD_REPLAYED,
    OpKind.CHECKED: Kind.CHECKED_REPLAYED,
    OpKind.RESUME: Kind.RESUME_REPLAYED,
}

PerTxnEvent = (
    HalvesStored | HalvesRefused | End | Published | CheckAnswered | CheckFailed | OperatorDecided
)
"""Events about one transaction (`txid`), each one column of the table."""


_FIXED_KINDS: dict[type, Kind] = {
    HalvesStored: Kind.HALVES,
    HalvesRefused: Kind.HALVES_REFUSED,
    Published: Kind.PUBLISHED,
    CheckAnswered: Kind.CHECK_ANSWERED,
    CheckFailed: Kind.CHECK_FAILED,
}
"""The column of each event type that always goes to one, found by its exact type: each
class pattern that fails costs an `isinstance` through `type.__instancecheck__`."""


def kind_of(event: PerTxnEvent) -> Kind:
    kind = _FIXED_KINDS.get(type(event))
    if kind is not None:
        return kind
    match event:
        case End():
            return _END_KINDS[event.decision]
        case OperatorDecided():
            return _OPERATOR_KINDS[event.resolution]
        case HalvesStored():
            return Kind.HALVES
        case HalvesRefused():
            return Kind.HALVES_REFUSED
        case Published():
            return Kind.PUBLISHED
        case CheckAnswered():
            return Kind.CHECK_ANSWERED
        case CheckFailed():
            return Kind.CHECK_FAILED


def record_kind(record: OpRecord, *, replayed: bool) -> Kind | None:
    """The column of one op record; None for advisory records a live table ignores once
    written (`checked`, `resume`: only recovery reads them)."""
    return (_REPLAYED_KINDS if replayed else _WRITTEN_KINDS).get(record.kind)
