"""What the table asks the coordinator actor to do (its effects, also called actions).

The actor carries effects out in the order given and reports each completion back as an
event (`PersistOp` → `OpPersisted`, `Publish` → `Published`, `SendCheck` → `CheckAnswered`
or `CheckFailed`). Until it does, the table waits: that is how "decision before any
publish, `done` before the reply" is guaranteed without the table doing any I/O. A failed
write is the actor's to retry (with the same effect); the table never assumes a write
happened.
"""

from __future__ import annotations

import enum

import msgspec

from txactors.coordinator.core.records import DiscardReason, Half, OpRecord
from txactors.coordinator.core.states import TxnState
from txactors.wire.protocol import ErrorCode


class PersistOp(msgspec.Struct, frozen=True, kw_only=True):
    """Append these records to TXN_OP as one message (group commit), then `OpPersisted`."""

    op_id: int
    records: tuple[OpRecord, ...]


class Publish(msgspec.Struct, frozen=True, kw_only=True):
    """Publish half `half_seq` of TXN_HALF to `topic` with `Nats-Msg-Id: msg_id`."""

    txid: str
    index: int
    topic: str
    half_seq: int

    @property
    def msg_id(self) -> str:
        """The dedupe id: a re-publish after a crash is dropped by the topic stream."""
        return f"{self.txid}:{self.index}"


class CheckTarget(enum.StrEnum):
    INSTANCE = "instance"  # the producer instance that prepared the transaction
    GROUP = "group"  # any live member of the group (queue group `txn.check.<group>`)


class SendCheck(msgspec.Struct, frozen=True, kw_only=True):
    """Ask a producer about the transaction; report the outcome under `check_id`."""

    txid: str
    check_id: int
    target: CheckTarget
    group: str
    producer: str
    check_times: int
    """Inconclusive checks before this one."""
    halves: tuple[Half, ...]
    timeout: float
    """Give up (`CheckFailed(TIMEOUT)`) after this many seconds."""
    last: bool = False
    """The last check of `check_max`: an inconclusive outcome discards the transaction."""


class Discard(msgspec.Struct, frozen=True, kw_only=True):
    """The discard is persisted: copy the halves to TXN_DISCARD, log, count, call on_discard."""

    txid: str
    group: str
    producer: str
    halves: tuple[Half, ...]
    reason: DiscardReason
    check_times: int


class Acknowledge(msgspec.Struct, frozen=True, kw_only=True):
    """Reply success to request `request_id`: the transaction is now in `state`."""

    request_id: str
    txid: str
    state: TxnState


class Refuse(msgspec.Struct, frozen=True, kw_only=True):
    """Reply an error to request `request_id`; the table changed nothing."""

    request_id: str
    txid: str
    code: ErrorCode
    message: str


Effect = PersistOp | Publish | SendCheck | Discard | Acknowledge | Refuse
Action = Effect
"""The name the actor and the tests have always used for an effect."""
