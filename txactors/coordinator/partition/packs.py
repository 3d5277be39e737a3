"""The pack codec: the halves a partition stores at one moment go as one TXN_HALF message,
`Txn-Pack: 1`, its body a msgpack list of `PackedHalf`, so a round of prepares costs the server
one message, not one per half. Reading a TXN_HALF message (`read_halves`) takes a pack or a
half stored alone (halves.py). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import msgspec
from nats.js.api import RawStreamMsg
from nats.nuid import NUID

from txactors.coordinator.partition.halves import StoredHalf, read_half, stored_half
from txactors.nats.writer import Append
from txactors.wire import layout
from txactors.wire.copies import stored_headers
from txactors.wire.protocol import OutgoingMessage

PACK_VERSION: Final = "1"
"""The `Txn-Pack` header of today's packs; a pack of another version is unreadable here."""


class PackedHalf(msgspec.Struct, frozen=True, array_like=True):
    """One half in a pack: the fields a half stored alone carries as headers (`half_headers`),
    as a msgpack array in this order."""

    txid: str
    index: int
    token: str
    """The commit token's digest (`tokens.py`)."""
    group: str
    producer: str
    born: float
    topic: str
    body: bytes
    begins: bool = False
    keys: list[str] = []
    tag: str | None = None
    properties: dict[str, str] = {}
    immunity: float | None = None


_pack_encoder: Final = msgspec.msgpack.Encoder()
_pack_decoder: Final = msgspec.msgpack.Decoder(list[PackedHalf])
_pack_ids: Final = NUID()
_ARRAY_HEADER_MAX: Final = 5
"""Bytes of the longest msgpack array header (array 32)."""


def pack_appends(
    partition: int, halves: Sequence[StoredHalf], max_bytes: int
) -> list[tuple[Append, int]]:
    """The TXN_HALF appends that store `halves` (in order) as packs, each with how many of
    the halves it holds: as few packs as keep each body within `max_bytes`, a half too large
    for any pack alone in one of its own (the server judges it, as it would a half stored
    alone). Each half is encoded once, so the sizes are exact: a pack's body is the msgpack
    array of its entries, their encodings after the array's header."""
    appends: list[tuple[Append, int]] = []
    entries: list[bytes] = []
    size = _ARRAY_HEADER_MAX
    for stored in halves:
        entry = _pack_encoder.encode(_packed(stored))
        if entries and size + len(entry) > max_bytes:
            appends.append((_pack_append(partition, entries), len(entries)))
            entries, size = [], _ARRAY_HEADER_MAX
        entries.append(entry)
        size += len(entry)
    if entries:
        appends.append((_pack_append(partition, entries), len(entries)))
    return appends


def _packed(stored: StoredHalf) -> PackedHalf:
    message, half = stored.message, stored.half
    return PackedHalf(
        txid=stored.txid,
        index=half.index,
        token=stored.token,
        group=stored.group,
        producer=stored.producer,
        born=half.born,
        topic=message.topic,
        body=message.body,
        begins=stored.begins,
        keys=message.keys,
        tag=message.tag,
        properties=message.properties,
        immunity=message.check_immunity,
    )


def _pack_append(partition: int, entries: list[bytes]) -> Append:
    headers = {
        layout.MSG_ID_HEADER: layout.pack_message_id(_pack_ids.next().decode()),
        layout.PACK_HEADER: PACK_VERSION,
    }
    body = _array_header(len(entries)) + b"".join(entries)
    return Append(layout.half_subject(partition), body, headers, layout.half_stream(partition))


def _array_header(length: int) -> bytes:
    """The msgpack header of an array of `length` items (fixarray, array 16, array 32)."""
    if length < 16:
        return bytes((0x90 | length,))
    if length < 1 << 16:
        return b"\xdc" + length.to_bytes(2, "big")
    return b"\xdd" + length.to_bytes(4, "big")


def is_pack(headers: Mapping[str, str]) -> bool:
    """Whether a TXN_HALF message is a pack (else a half stored alone)."""
    return layout.PACK_HEADER in headers


def read_halves(seq: int, headers: Mapping[str, str], body: bytes) -> list[StoredHalf]:
    """The halves stored in the TXN_HALF message at `seq`, in order: a pack's, or the one
    half stored alone. ValueError, KeyError or msgspec.ValidationError if it is unreadable
    (a pack of an unknown version is)."""
    version = headers.get(layout.PACK_HEADER)
    if version is None:
        return [read_half(seq, headers, body)]
    if version != PACK_VERSION:
        raise ValueError(f"{layout.PACK_HEADER} {layout.shown(version)} is not a known version")
    return [_unpacked(entry, seq) for entry in _pack_decoder.decode(body)]


def read_raw_halves(raw: RawStreamMsg) -> list[StoredHalf]:
    return read_halves(raw.seq or 0, stored_headers(raw), raw.data or b"")


def _unpacked(entry: PackedHalf, seq: int) -> StoredHalf:
    message = OutgoingMessage(
        topic=entry.topic,
        body=entry.body,
        keys=entry.keys,
        tag=entry.tag,
        properties=entry.properties,
        check_immunity=entry.immunity,
    )
    return stored_half(
        txid=entry.txid,
        token_digest=entry.token,
        group=entry.group,
        producer=entry.producer,
        begins=entry.begins,
        index=entry.index,
        born=entry.born,
        message=message,
        seq=seq,
    )
