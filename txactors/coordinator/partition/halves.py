"""A half message as stored in TXN_HALF (`StoredHalf`) and its form alone, one stream message
with its fields as headers (`half_headers`, `read_half`): how halves stored before packs
(packs.py) are read, and what a discarded copy carries. Pure: no I/O."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import msgspec

from txactors.coordinator.core import tokens
from txactors.coordinator.core.events import HalvesStored
from txactors.coordinator.core.records import Half
from txactors.wire import layout
from txactors.wire.protocol import CheckedMessage, OutgoingMessage


class StoredHalf(msgspec.Struct, frozen=True, kw_only=True):
    """A half message as read back from TXN_HALF: enough to publish, check or recover it."""

    txid: str
    token: str
    """The commit token's digest (`tokens.py`)."""
    group: str
    producer: str
    begins: bool
    half: Half
    message: OutgoingMessage


def half_headers(stored: StoredHalf) -> dict[str, str]:
    """Every header of a half as stored: the user's properties, then ours (which win).

    Only what recovery, the checker or a discarded copy reads, each once: the txid and index
    are those of `Nats-Msg-Id` (`<txid>:<index>:half`), `Txn-Begins` is there only when set,
    the birth time is to the millisecond."""
    message, half, txid = stored.message, stored.half, stored.txid
    headers = dict(message.properties)
    headers.update(
        {
            layout.MSG_ID_HEADER: layout.half_message_id(txid, half.index),
            layout.TOKEN_HEADER: stored.token,
            layout.GROUP_HEADER: stored.group,
            layout.PRODUCER_HEADER: stored.producer,
            layout.TOPIC_HEADER: message.topic,
            layout.BORN_HEADER: seconds_text(half.born),
        }
    )
    if stored.begins:
        headers[layout.BEGINS_HEADER] = "1"
    if message.tag is not None:
        headers[layout.TAG_HEADER] = message.tag
    if message.keys:
        headers[layout.KEYS_HEADER] = ",".join(message.keys)
    if message.check_immunity is not None:
        headers[layout.IMMUNITY_HEADER] = repr(message.check_immunity)
    return headers


def seconds_text(seconds: float) -> str:
    """A time in seconds as a header value: to the millisecond, which is all any reader uses.
    Rounded down, never up: a half's birth read back a little later would put its first
    check-back after the transaction timeout instead of at it."""
    if 1.0 <= seconds < 1e12:  # any clock's reading: the same text, for half the cost
        return _fixed_seconds_text(seconds)
    rounded = round(seconds, 3)
    if rounded > seconds:
        rounded = round(rounded - 0.001, 3)
    return repr(rounded)


def _fixed_seconds_text(seconds: float) -> str:
    """`seconds_text` for 1 <= `seconds` < 1e12 with one shortest-repr conversion fewer.

    `f"{x:.3f}"` gives the digits `round(x, 3)` rounds to (the same correctly rounded
    conversion). With at most 15 significant digits they convert back to the float exactly,
    and no shorter text is as close (floats there are under 0.0002 apart), so `repr` of
    that float is those digits without trailing zeros."""
    text = f"{seconds:.3f}"
    if float(text) > seconds:
        text = f"{float(text) - 0.001:.3f}"
    text = text.rstrip("0")
    return text + "0" if text.endswith(".") else text


def half_identity(headers: Mapping[str, str]) -> tuple[str, int]:
    """(txid, index) of a stored half: from its `Nats-Msg-Id`, or from the `Txn-Id` and
    `Txn-Index` a half written by an earlier 0.x carries. KeyError or ValueError if
    neither is there whole."""
    txid, index = headers.get(layout.TXID_HEADER), headers.get(layout.INDEX_HEADER)
    if txid is not None and index is not None:
        return txid, int(index)
    return layout.half_of_message_id(headers[layout.MSG_ID_HEADER])


def read_half(seq: int, headers: Mapping[str, str], body: bytes) -> StoredHalf:
    """The half stored at `seq`, in today's form or an earlier 0.x's."""
    immunity = headers.get(layout.IMMUNITY_HEADER)
    keys = headers.get(layout.KEYS_HEADER)
    message = OutgoingMessage(
        topic=headers[layout.TOPIC_HEADER],
        body=body,
        keys=keys.split(",") if keys else [],
        tag=headers.get(layout.TAG_HEADER),
        properties=user_properties(headers),
        check_immunity=float(immunity) if immunity is not None else None,
    )
    txid, index = half_identity(headers)
    return stored_half(
        txid=txid,
        token_digest=tokens.stored_digest(headers[layout.TOKEN_HEADER]),
        group=headers[layout.GROUP_HEADER],
        producer=headers[layout.PRODUCER_HEADER],
        begins=headers.get(layout.BEGINS_HEADER) == "1",
        index=index,
        born=float(headers[layout.BORN_HEADER]),
        message=message,
        seq=seq,
    )


def stored_half(
    *,
    txid: str,
    token_digest: str,
    group: str,
    producer: str,
    begins: bool,
    index: int,
    born: float,
    message: OutgoingMessage,
    seq: int = 0,
) -> StoredHalf:
    """The half stored at `seq` (0: not written yet) with these fields: the one place a
    `StoredHalf` is made, whether about to be written (`pack_appends`) or read back
    (`read_halves`)."""
    return StoredHalf(
        txid=txid,
        token=token_digest,
        group=group,
        producer=producer,
        begins=begins,
        half=Half(
            index=index, topic=message.topic, seq=seq, born=born, immunity=message.check_immunity
        ),
        message=message,
    )


def halves_stored(stored: Sequence[StoredHalf], request_id: str | None = None) -> HalvesStored:
    """What the table learns from stored halves of one transaction (at least one; all from
    one prepare, or one read back): `request_id` is the prepare to answer, None when read
    back from TXN_HALF."""
    first = stored[0]
    return HalvesStored(
        txid=first.txid,
        token=first.token,
        group=first.group,
        producer=first.producer,
        halves=tuple([s.half for s in stored]),
        begins=first.begins,
        request_id=request_id,
    )


def by_transaction(halves: Sequence[StoredHalf]) -> list[list[StoredHalf]]:
    """`halves` (of one TXN_HALF message, say) in runs of one transaction each, in order:
    what `halves_stored` takes."""
    return [list(run) for _, run in itertools.groupby(halves, key=_txid)]


def _txid(stored: StoredHalf) -> str:
    return stored.txid


def half_in(halves: Sequence[StoredHalf], txid: str, index: int) -> StoredHalf:
    """Half `index` of `txid` among the halves of one TXN_HALF message; KeyError if absent
    (the message at that sequence is not the one recorded: unreadable)."""
    for stored in halves:
        if stored.half.index == index and stored.txid == txid:
            return stored
    raise KeyError(
        f"half {index} of {txid} is not in TXN_HALF message {halves[0].half.seq if halves else '?'}"
    )


def user_properties(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if not layout.is_reserved_header(k)}


def checked_message(stored: StoredHalf) -> CheckedMessage:
    message = stored.message
    return CheckedMessage(
        index=stored.half.index,
        topic=message.topic,
        body=message.body,
        keys=message.keys,
        tag=message.tag,
        properties=message.properties,
    )
