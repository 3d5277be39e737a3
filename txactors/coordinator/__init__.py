"""The coordinator: owns transaction state, writes HALF/OP records, publishes commits.

`TransactionTable` (`core/table.py`) is the pure core, one transition table with no I/O;
the actor that drives it against JetStream feeds it events and carries out its effects.
"""

from txactors.coordinator.core.effects import (
    Acknowledge,
    Action,
    CheckTarget,
    Discard,
    Effect,
    PersistOp,
    Publish,
    Refuse,
    SendCheck,
)
from txactors.coordinator.core.errors import CoordinatorStateError
from txactors.coordinator.core.events import (
    CheckAnswered,
    CheckFailed,
    CheckFailure,
    End,
    Event,
    HalvesRefused,
    HalvesStored,
    OperatorDecided,
    OpPersisted,
    OpReplayed,
    Published,
)
from txactors.coordinator.core.records import Decision, DiscardReason, Half, OpKind, OpRecord
from txactors.coordinator.core.states import TxnState
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.core.transactions import Checkpoint, Counters, TxnView
from txactors.coordinator.options import CoordinatorOptions, DiscardedTransaction
from txactors.wire.rules import CoordinatorConfig

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
    "Effect",
    "End",
    "Event",
    "Half",
    "HalvesRefused",
    "HalvesStored",
    "OpKind",
    "OpPersisted",
    "OpRecord",
    "OpReplayed",
    "OperatorDecided",
    "PersistOp",
    "Publish",
    "Published",
    "Refuse",
    "SendCheck",
    "TransactionTable",
    "TxnState",
    "TxnView",
]
