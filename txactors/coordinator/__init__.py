"""The coordinator: owns transaction state, writes HALF/OP records, publishes commits.

`TransactionTable` is the pure core (no I/O); the actor that drives it against JetStream
feeds it `events` and carries out its `actions`.
"""

from txactors.coordinator.actions import (
    Acknowledge,
    Action,
    CheckTarget,
    Discard,
    PersistOp,
    Publish,
    Refuse,
    SendCheck,
)
from txactors.coordinator.config import CoordinatorConfig
from txactors.coordinator.events import (
    CheckAnswered,
    CheckFailed,
    CheckFailure,
    End,
    Event,
    ForceCommit,
    ForceRollback,
    HalvesStored,
    OpPersisted,
    OpReplayed,
    Published,
    Resume,
)
from txactors.coordinator.lifecycle import TxnState
from txactors.coordinator.options import CoordinatorOptions, DiscardedTransaction
from txactors.coordinator.records import Decision, DiscardReason, Half, OpKind, OpRecord
from txactors.coordinator.state import (
    Checkpoint,
    CoordinatorStateError,
    Counters,
    TransactionTable,
    TxnView,
)

__all__ = [
    "Acknowledge",
    "Action",
    "CheckAnswered",
    "CheckFailed",
    "CheckFailure",
    "CheckTarget",
    "Checkpoint",
    "CoordinatorConfig",
    "CoordinatorOptions",
    "CoordinatorStateError",
    "Counters",
    "Decision",
    "Discard",
    "DiscardReason",
    "DiscardedTransaction",
    "End",
    "Event",
    "ForceCommit",
    "ForceRollback",
    "Half",
    "HalvesStored",
    "OpKind",
    "OpPersisted",
    "OpRecord",
    "OpReplayed",
    "PersistOp",
    "Publish",
    "Published",
    "Refuse",
    "Resume",
    "SendCheck",
    "TransactionTable",
    "TxnState",
    "TxnView",
]
