"""A handler that sends: each input applied once, and what it sends sent if and only if its
change commits (Kafka's consume-process-produce transaction, on the transaction log).

One local transaction, in the database of the producer's `TxLog`, holds the input's apply
record, the outgoing transaction's log row and the handler's change. The steps, in the one
order in which a crash or a redelivery at any of them still applies the input once and
publishes its messages once:

1. open the local transaction and record the input as applied by the group (already
   applied by an attempt that committed: roll back, send nothing, ack);
2. run the handler; its first `send` records the outgoing txid in the log, and each send's
   prepare goes out at once, while the handler goes on;
3. await the prepares: the halves are stored before the local commit;
4. commit the local transaction (shielded: its outcome is then known);
5. end the outgoing transaction with COMMIT;
6. return: the consumer acks the input.

Killed before 4, nothing is committed: halves already stored are rolled back by their
check-back, which finds no log row (the log's claim), and the redelivery runs the handler
again. Killed after 4, the redelivery finds the input applied and only acks, and the
check-back finds the row and commits: the messages go out once.

The outgoing txid is derived from the group, the input's id and its delivery number
(`chained_txid`), not from the input alone: a txid whose first attempt a check-back rolled
back can never commit (the log's claim holds its key, the coordinator refuses a decided
txid), and the coordinator keeps a commit token's digest only, so a second prepare of an
open txid could not be given the first one's token. So each delivery prepares a
transaction of its own, the same one whoever handles that delivery, and the apply record
lets at most one of them commit. A handler therefore need not be deterministic: what is
published is always what the attempt whose change committed sent.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import anyio

from txactors.consumer.message import ConsumedMessage
from txactors.errors import ConfigError
from txactors.faults import FaultPoint, crash_if_armed
from txactors.observe.logs import get_logger
from txactors.producer.message import TxMessage
from txactors.producer.producer import TransactionProducer
from txactors.producer.transaction import Transaction
from txactors.producer.txlog.decide import settle
from txactors.producer.txlog.log import TxLog
from txactors.producer.txlog.schema import MSG_ID_LENGTH
from txactors.wire.protocol import Decision

log = get_logger(__name__)

C = TypeVar("C")

TXID_DIGITS = 32
"""A chained txid is as long as a random one: 128 bits of SHA-256, as hex."""


def chained_txid(group: str, msg_id: str, deliveries: int) -> str:
    """The outgoing txid of `group`'s handling of delivery `deliveries` of input `msg_id`."""
    key = f"{group}\n{msg_id}\n{deliveries}".encode()
    return hashlib.sha256(key).hexdigest()[:TXID_DIGITS]


def applied_key(msg_id: str) -> str:
    """The input's key in the apply table: its id, or a digest of one too long for it."""
    if len(msg_id) <= MSG_ID_LENGTH:
        return msg_id
    return "sha256:" + hashlib.sha256(msg_id.encode()).hexdigest()


class Outbox(Generic[C]):
    """What a chained handler sends through: `await out.send(TxMessage(...))`. The messages
    of one handling are one transaction, committed with the handler's change."""

    def __init__(self, txlog: TxLog[C], connection: C, txn: Transaction) -> None:
        self._txlog = txlog
        self._connection = connection
        self._txn = txn
        self._sending: list[asyncio.Task[tuple[int, ...]]] = []
        self._recorded = False
        self._recording = asyncio.Lock()
        """Sends from several tasks of one handler record the txid once."""

    @property
    def txid(self) -> str:
        """The outgoing transaction's id (`chained_txid`), to keep beside the change."""
        return self._txn.txid

    @property
    def sent(self) -> int:
        """How many sends the handler made."""
        return len(self._sending)

    async def send(self, message: TxMessage | Sequence[TxMessage]) -> None:
        """Prepare `message` (one or several, any topics) as part of this handling; it is
        published if and only if the handler's local transaction commits. The prepare goes
        out now and is awaited before the commit; a failed one rolls the handling back."""
        if not self._recorded:  # in the local transaction before any half can be checked
            async with self._recording:
                if not self._recorded:
                    await self._txlog.record(self._connection, self._txn.txid)
                    self._recorded = True
                    crash_if_armed(FaultPoint.AFTER_TXLOG_RECORD)
        self._sending.append(self._txn.start_send(message))

    async def stored(self) -> None:
        """Wait until every send's halves are stored (`PrepareFailed` if one was not)."""
        for sending in self._sending:
            await sending


Work = Callable[[C, Outbox[C]], Awaitable[object]]
"""The handler's part: `work(connection, outbox)`, inside the local transaction. It must not
commit or roll back."""


async def apply_and_send(
    txlog: TxLog[C],
    producer: TransactionProducer,
    group: str,
    message: ConsumedMessage,
    work: Work[C],
) -> bool:
    """Handle `message` for consumer group `group` once: run `work(connection, outbox)` in
    one local transaction with the input's apply record and the log row of what it sends,
    then end the outgoing transaction. False, and nothing run, when the group had applied
    the input already. For a plain `Consumer`'s handler; `TxApp` does it with `sends=`.

    `producer` must answer its check-backs from `txlog` (`TransactionProducer(nc,
    txlog.group, txlog.check)`). An exception from `work` or a failed prepare rolls both
    back and propagates (the consumer retries the input); `RolledBackByCheck` if the last
    check-back decided the transaction first. A commit that raises is settled from the log,
    as `TxLog.send_in_transaction` does.
    """
    if producer.group != txlog.group:
        raise ConfigError(
            f"the log is for group {txlog.group!r}, the producer for {producer.group!r}"
        )
    txid = chained_txid(group, message.msg_id, message.deliveries)
    commit_error: Exception | None = None
    async with producer.begin(txid=txid) as txn:  # an exception rolls back, a crash ends nothing
        local_commit = txn.local_commit()  # the last check-back may claim it until begun
        async with txlog.local() as local:  # left uncommitted, it rolls back
            if not await txlog.mark_applied(local.connection, group, applied_key(message.msg_id)):
                log.info("already_applied", group=group, msg_id=message.msg_id)
                return False  # nothing sent: the block's end sends nothing either
            outbox = Outbox(txlog, local.connection, txn)
            await work(local.connection, outbox)
            crash_if_armed(FaultPoint.AFTER_LOCAL_WORK)
            await outbox.stored()
            if outbox.sent:
                crash_if_armed(FaultPoint.AFTER_PREPARE)
                local_commit.begin()  # RolledBackByCheck if the last check claimed it
            try:
                with anyio.CancelScope(shield=True):
                    await local.commit()
            except Exception as error:
                commit_error = error
        if commit_error is not None:
            if not outbox.sent:
                raise commit_error  # the redelivery's apply record tells what happened
            decision = await settle(txlog, txid)  # it may have committed all the same
            log.warning("local_commit_failed", error=repr(commit_error), settled=decision)
            await txn.end(decision)
            if decision is not Decision.COMMIT:
                raise commit_error
        crash_if_armed(FaultPoint.AFTER_LOCAL_COMMIT)
    crash_if_armed(FaultPoint.AFTER_END)
    return True


def check_sends(txlog: Any, producer: Any, where: str) -> None:
    """A chained handler's `idempotent=` and `sends=` checked at start, with what to fix."""
    if not isinstance(txlog, TxLog):
        raise ConfigError(
            f"{where}: sends= takes a TxLog (or a producer, with its TxLog as idempotent=): "
            "its database holds the apply record, the log row and the change; got "
            f"{type(txlog).__name__}"
        )
    if not isinstance(producer, TransactionProducer):
        raise ConfigError(
            f"{where}: sends= must be a TxLog or a TransactionProducer (or a function "
            f"returning one), got {type(producer).__name__}"
        )
    if producer.group != txlog.group:
        raise ConfigError(
            f"{where}: the TxLog is for group {txlog.group!r}, the producer for "
            f"{producer.group!r}; create the producer with the log's checker: "
            "TransactionProducer(nc, txlog.group, txlog.check)"
        )
