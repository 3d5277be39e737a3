"""Putting records aside in TXN_DISCARD: discarded transactions and quarantined records.

`discard` carries out a discard: copy the halves, say so, call the hook. The decision is
already durable in TXN_OP when it runs. Each half gets a copy of its own, however it was
stored. A copy of a half stored alone keeps its headers but the server's
(`copies.copied_headers`: a half written in an atomic batch keeps `Nats-Batch-*`, which
TXN_DISCARD would refuse); a copy of a half stored in a pack (with the halves of other
transactions, which stay where they are) has the headers it would have had stored alone
(`store.half_headers`). Each TXN_HALF message is read once. A copy carries a `Nats-Msg-Id`
of its own, so doing it again after a crash adds nothing.

A half stores its txid and index only in its `Nats-Msg-Id` (or a pack's entry), which a
copy does not keep: the copy says them in `Txn-Id` and `Txn-Index`.

`quarantine` keeps a record JetStream refused for good (too large, stream gone) or that
recovery could not read (a garbage record in the coordinator's own streams), so that one bad
record costs a log line, a metric and a copy for an operator, never a partition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from txactors.coordinator.core.effects import Discard
from txactors.coordinator.options import DiscardedTransaction, OnDiscard
from txactors.coordinator.partition.halves import StoredHalf, half_headers, half_in
from txactors.coordinator.partition.packs import is_pack, read_halves
from txactors.nats.link import ACK_TIMEOUT
from txactors.nats.retry import (
    LINK_TROUBLE,
    RETRY_INITIAL,
    RETRY_MAX,
    Fault,
    classify,
    describe,
    retry_transient,
)
from txactors.nats.writer import Append, PartitionWriter
from txactors.observe.logs import get_logger
from txactors.wire import layout
from txactors.wire.copies import copied_headers, stored_headers

log = get_logger(__name__)

QUARANTINE_ATTEMPTS = 5
"""Tries per copy of a quarantined record: keeping it must not become a retry forever."""
MAX_REASON_CHARS = 1024


async def discard(
    js: JetStreamContext,
    writer: PartitionWriter,
    action: Discard,
    on_discard: OnDiscard | None,
    stream: str,
) -> None:
    """Copy the action's halves (read from `stream`, their partition's) to TXN_DISCARD."""
    found = await _discarded_halves(js, action, stream)
    appends = []
    for stored, headers in found:
        index = stored.half.index
        headers[layout.MSG_ID_HEADER] = layout.discarded_message_id(action.txid, index)
        headers[layout.TXID_HEADER] = action.txid  # the half's own id is not copied
        headers[layout.INDEX_HEADER] = str(index)
        headers[layout.DISCARD_REASON_HEADER] = action.reason.value
        headers[layout.CHECK_TIMES_HEADER] = str(action.check_times)
        body = stored.message.body
        appends.append(Append(layout.discard_subject(action.group), body, headers))
    copied = anyio.Event()

    async def report(_: list[PubAck | None]) -> None:
        copied.set()

    writer.submit(appends, report)
    await copied.wait()
    log.warning(
        "transaction_discarded",
        txid=action.txid,
        group=action.group,
        producer=action.producer,
        reason=action.reason.value,
        check_times=action.check_times,
        halves=len(found),
    )
    if on_discard is not None:
        await on_discard(
            DiscardedTransaction(
                txid=action.txid,
                group=action.group,
                producer=action.producer,
                reason=action.reason.value,
                check_times=action.check_times,
                messages=[stored.message for stored, _ in found],
            )
        )


async def _discarded_halves(
    js: JetStreamContext, action: Discard, stream: str
) -> list[tuple[StoredHalf, dict[str, str]]]:
    """The action's halves still readable, in order, each with the headers its copy keeps;
    each TXN_HALF message read once. A half gone (purged by hand?) or unreadable has nothing
    left to copy."""
    messages: dict[int, tuple[list[StoredHalf], dict[str, str]]] = {}
    for seq in dict.fromkeys(h.seq for h in action.halves):
        try:
            raw = await retry_transient(js.get_msg, stream, seq)
            headers = stored_headers(raw)
            halves = read_halves(seq, headers, raw.data or b"")
        except (nats.errors.Error, ValueError, KeyError) as error:
            log.error("discarded_half_unreadable", txid=action.txid, seq=seq, error=describe(error))
            continue
        messages[seq] = (halves, headers)
    found = []
    for half in action.halves:
        if half.seq not in messages:
            continue
        halves, headers = messages[half.seq]
        try:
            stored = half_in(halves, action.txid, half.index)
        except KeyError as error:  # the message there is not the one recorded
            log.error(
                "discarded_half_unreadable", txid=action.txid, seq=half.seq, error=describe(error)
            )
            continue
        kept = half_headers(stored) if is_pack(headers) else headers
        found.append((stored, copied_headers(kept)))
    return found


async def quarantine(
    js: JetStreamContext,
    *,
    partition: int,
    subject: str,
    headers: Mapping[str, Any],
    body: bytes,
    reason: str,
    stream: str | None = None,
    seq: int | None = None,
) -> None:
    """Copy a record to TXN_DISCARD (`txn.discard.$quarantine`) with why, and log it.

    Tries a whole copy, then one without the original headers and body (when those are what
    JetStream refuses), each a few times; gives up with a log line rather than retry forever.
    """
    reason = " ".join(reason.split())[:MAX_REASON_CHARS]
    log.error(
        "record_quarantined",
        partition=partition,
        subject=subject,
        stream=stream,
        seq=seq,
        reason=reason,
    )
    ours = {
        layout.QUARANTINE_REASON_HEADER: reason,
        layout.ORIGIN_SUBJECT_HEADER: subject,
    }
    if stream is not None and seq is not None:
        ours[layout.ORIGIN_STREAM_HEADER] = stream
        ours[layout.ORIGIN_SEQ_HEADER] = str(seq)
        ours[layout.MSG_ID_HEADER] = f"{stream}:{seq}:quarantine"
    elif isinstance(msg_id := headers.get(layout.MSG_ID_HEADER), str):
        ours[layout.MSG_ID_HEADER] = f"{msg_id}:quarantine"
    kept = copied_headers(headers)
    copies = [
        ({**kept, **ours}, body),
        ({**ours, layout.BODY_DROPPED_HEADER: str(len(body))}, b""),
    ]
    failure = ""
    for copy_headers, copy_body in copies:
        delay = RETRY_INITIAL
        for _ in range(QUARANTINE_ATTEMPTS):
            try:
                await js.publish(
                    layout.quarantine_subject(),
                    copy_body,
                    timeout=ACK_TIMEOUT,
                    headers=copy_headers,
                )
                return
            except (*LINK_TROUBLE, ValueError) as error:
                failure = describe(error)
                if isinstance(error, ValueError) or classify(error) is Fault.PERMANENT:
                    break  # this copy will never fit: try the smaller one
                await anyio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
    log.error("quarantine_copy_failed", partition=partition, subject=subject, error=failure)
