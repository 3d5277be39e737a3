"""Carrying out a discard: copy the halves to TXN_DISCARD, say so, call the hook.

The discard decision is already durable in TXN_OP when this runs. The copies carry a
`Nats-Msg-Id`, so doing it again after a crash adds nothing.
"""

from __future__ import annotations

import anyio
from nats.js import JetStreamContext
from nats.js.api import PubAck

from txactors import layout
from txactors.coordinator.actions import Discard
from txactors.coordinator.options import DiscardedTransaction, OnDiscard
from txactors.coordinator.streams import read_raw_half, stored_headers
from txactors.coordinator.writers import Append, PipelinedWriter
from txactors.logs import get_logger

log = get_logger(__name__)


async def discard(
    js: JetStreamContext, writer: PipelinedWriter, action: Discard, on_discard: OnDiscard | None
) -> None:
    raws = [await js.get_msg(layout.HALF_STREAM, h.seq) for h in action.halves]
    appends = []
    for raw in raws:
        headers = stored_headers(raw)
        index = int(headers.get(layout.INDEX_HEADER, "0"))
        headers[layout.MSG_ID_HEADER] = f"{layout.message_id(action.txid, index)}:discard"
        headers[layout.DISCARD_REASON_HEADER] = action.reason.value
        headers[layout.CHECK_TIMES_HEADER] = str(action.check_times)
        appends.append(Append(layout.discard_subject(action.group), raw.data or b"", headers))
    copied = anyio.Event()

    async def report(_: list[PubAck]) -> None:
        copied.set()

    await writer.submit(appends, report)
    await copied.wait()
    log.warning(
        "transaction_discarded",
        txid=action.txid,
        group=action.group,
        producer=action.producer,
        reason=action.reason.value,
        check_times=action.check_times,
        halves=len(raws),
    )
    if on_discard is not None:
        await on_discard(
            DiscardedTransaction(
                txid=action.txid,
                group=action.group,
                producer=action.producer,
                reason=action.reason.value,
                check_times=action.check_times,
                messages=[read_raw_half(raw).message for raw in raws],
            )
        )
