"""Upgrading from the shared layout (0.2): every partition's log in TXN_HALF and TXN_OP.

The per-partition logs (TXN_LOG_<p>) take the same subjects (`txn.half.<p>`, `txn.op.<p>`), which
JetStream lets only one stream hold. So a coordinator that finds the old streams first moves
them off those subjects (`LegacyLog.find`: their messages stay, readable by their stored
subjects), and each partition, before its first recovery on the new layout, finishes what the
old streams hold for it (`LegacyLog.carry_over`): the old log is replayed into a scratch table,
exactly as recovery did in 0.2, and every transaction still in it (open, decided but not
finished, or discarded) is written to the partition's own streams: its halves as they were
(birth, token digest, immunity: the same transaction to the producer and to the checker), then
its decision or check count as an op record. The partition's recovery then reads them like any
other. A marker in the checkpoint bucket (`upgraded.<p>`) says a partition is done; until it is
written, a crash costs only a fresh start (the new streams are purged, the old log replayed
again), never a transaction lost or decided twice. Nothing is ever written to the old streams:
an operator deletes them once every partition logged `legacy_log_finished`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Final

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from txactors.coordinator.core.records import OpKind, OpRecord
from txactors.coordinator.core.states import TxnState
from txactors.coordinator.core.table import TransactionTable
from txactors.coordinator.core.transactions import TxnView
from txactors.coordinator.partition.checkpoints import (
    checkpoint_key,
    encode_ops,
    load_checkpoint,
)
from txactors.coordinator.partition.halves import StoredHalf
from txactors.coordinator.partition.packs import pack_appends, read_raw_halves
from txactors.coordinator.partition.recovery import recover
from txactors.nats.retry import retry_transient
from txactors.observe.logs import get_logger
from txactors.wire import layout
from txactors.wire.rules import CoordinatorConfig

log = get_logger(__name__)

RETIRED_SUBJECTS: Final = {
    layout.LEGACY_HALF_STREAM: "txn.legacy.half",
    layout.LEGACY_OP_STREAM: "txn.legacy.op",
}
"""What the old streams listen on once retired: a subject no one publishes to."""
PACK_BYTES: Final = 512 * 1024
"""Most bytes of halves carried over in one message (the server's default limit is 1 MiB)."""

_DECISIONS: Final = {
    TxnState.COMMITTING: OpKind.COMMIT,
    TxnState.PUBLISHING: OpKind.COMMIT,
    TxnState.FINISHING: OpKind.COMMIT,
    TxnState.ROLLING_BACK: OpKind.ROLLBACK,
    TxnState.DISCARDING: OpKind.DISCARD,
    TxnState.DISCARDED: OpKind.DISCARD,
}
"""The op record that puts a carried-over transaction back in its state (none: undecided)."""


def upgraded_key(partition: int) -> str:
    """The checkpoint bucket's marker of a partition whose old log was carried over."""
    return f"upgraded.{partition}"


@dataclass(frozen=True, slots=True)
class LegacyLog:
    """The shared layout's streams, found in this deployment (see the module docstring)."""

    js: JetStreamContext
    checkpoints: KeyValue
    config: CoordinatorConfig

    @classmethod
    async def find(
        cls, js: JetStreamContext, checkpoints: KeyValue, config: CoordinatorConfig
    ) -> LegacyLog | None:
        """The old log if its streams exist (None: a deployment that never had them),
        moved off the per-partition streams' subjects."""
        found = False
        for stream, retired in RETIRED_SUBJECTS.items():
            try:
                info = await retry_transient(js.stream_info, stream)
            except nats.js.errors.NotFoundError:
                continue
            found = True
            if info.config.subjects != [retired]:
                info.config.subjects = [retired]
                await retry_transient(js.update_stream, info.config)
                log.warning("legacy_stream_retired", stream=stream, subjects=[retired])
        return cls(js, checkpoints, config) if found else None

    async def carry_over(self, partition: int) -> None:
        """Write what the old log holds for `partition` to its own streams, once."""
        marker = upgraded_key(partition)
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            if (await retry_transient(self.checkpoints.get, marker)).value:
                return
        js = self.js
        # an interrupted carry-over's writes
        await retry_transient(js.purge_stream, layout.log_stream(partition))
        load = functools.partial(load_checkpoint, legacy=True)
        checkpoint = await retry_transient(load, self.checkpoints, partition)
        table = TransactionTable(self.config)
        kept: dict[str, dict[int, StoredHalf]] = {}

        def remember(stored: StoredHalf) -> None:
            kept.setdefault(stored.txid, {})[stored.half.index] = stored

        await recover(
            js,
            table,
            partition,
            checkpoint,
            remember,
            time.time(),
            streams=layout.LogStreams.legacy(),
        )
        carried = 0
        for view in table.transactions():
            # Only the halves the table still holds: a commit names the ones to publish.
            seqs = set(view.half_seqs)
            halves = {
                index: stored
                for index, stored in kept.get(view.txid, {}).items()
                if stored.half.seq in seqs
            } or await self._read_back(view.txid, view.half_seqs)
            if not halves:
                log.error("legacy_transaction_unreadable", partition=partition, txid=view.txid)
                continue
            await self._write(partition, view, halves)
            carried += 1
        # Tidy: the new log's checkpoint has a key of its own (`checkpoint_key`).
        await retry_transient(self.checkpoints.delete, checkpoint_key(partition, legacy=True))
        await retry_transient(self.checkpoints.put, marker, b"1")
        log.warning("legacy_log_finished", partition=partition, transactions=carried)

    async def _read_back(self, txid: str, seqs: tuple[int, ...]) -> dict[int, StoredHalf]:
        """The halves of `txid` in the old stream's messages at `seqs` (a discarded
        transaction the checkpoint parked was not replayed)."""
        found: dict[int, StoredHalf] = {}
        for seq in dict.fromkeys(seqs):
            try:
                raw = await retry_transient(self.js.get_msg, layout.LEGACY_HALF_STREAM, seq)
            except nats.js.errors.NotFoundError:
                continue
            found.update((h.half.index, h) for h in read_raw_halves(raw) if h.txid == txid)
        return found

    async def _write(self, partition: int, view: TxnView, halves: dict[int, StoredHalf]) -> None:
        """One transaction's halves on the new half stream, then what puts it back in its
        state on the new op stream."""
        ordered = [halves[index] for index in sorted(halves)]
        seqs: list[int] = []
        for append, count in pack_appends(partition, ordered, PACK_BYTES):
            publish = functools.partial(
                self.js.publish, stream=append.stream, headers=append.headers
            )
            ack = await retry_transient(publish, append.subject, append.payload)
            seqs.extend([ack.seq] * count)
        txid = ordered[0].txid
        kind, check_times = _DECISIONS.get(view.state), view.check_times
        records: list[OpRecord] = []
        if kind is OpKind.COMMIT:
            records.append(OpRecord(txid=txid, kind=kind, half_seqs=tuple(seqs)))
        elif kind is OpKind.DISCARD:
            reason = view.discard_reason
            records.append(OpRecord(txid=txid, kind=kind, check_times=check_times, reason=reason))
        elif kind is not None:
            records.append(OpRecord(txid=txid, kind=kind))
        elif check_times:
            records.append(OpRecord(txid=txid, kind=OpKind.CHECKED, check_times=check_times))
        if records:
            publish = functools.partial(self.js.publish, stream=layout.op_stream(partition))
            await retry_transient(publish, layout.op_subject(partition), encode_ops(records))
