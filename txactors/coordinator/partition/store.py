"""The coordinator's JetStream layout (DESIGN §4) and the encoding of what it stores there.

TXN_HALF holds the half messages as the producer sent them, with what lets recovery rebuild
the transaction without anything else: the halves a partition stores at one moment go as one
*pack* (one stream message, `Txn-Pack: 1`, its body a msgpack list of `PackedHalf`), so a
round of prepares costs the server one message, not one per half; halves stored before packs
(one message each, their fields as headers) are still read. TXN_OP holds msgpack-encoded
lists of `OpRecord`s (one stream message per group commit). Both are file-backed: a decision is
durable when JetStream acknowledged it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RawStreamMsg, StorageType, StreamConfig
from nats.js.kv import KeyValue
from nats.nuid import NUID

from txactors.coordinator.core import tokens
from txactors.coordinator.core.events import HalvesStored
from txactors.coordinator.core.records import Half, OpRecord
from txactors.coordinator.core.transactions import Checkpoint
from txactors.nats.topics import (
    DECLARE_DEADLINE,
    declare_stream,
    declaring,
    ensure_replicas,
    is_replicas_error,
    replicas_error,
)
from txactors.nats.writer import Append
from txactors.wire import layout
from txactors.wire.copies import stored_headers
from txactors.wire.protocol import CheckedMessage, OutgoingMessage

DEDUPE_WINDOW: Final = 120.0
"""Seconds JetStream remembers a `Nats-Msg-Id`: covers a retried append after a timeout."""

_HALF_ID_SUFFIX: Final = ":half"
"""A half's `Nats-Msg-Id` is `<txid>:<index>:half`: apart from its committed copy's."""
_PACK_ID_SUFFIX: Final = ":pack"
"""A pack's `Nats-Msg-Id` is `<nuid>:pack`: one per pack, the same when a write is retried."""
PACK_VERSION: Final = "1"
"""The `Txn-Pack` header of today's packs; a pack of another version is unreadable here."""
_op_encoder: Final = msgspec.msgpack.Encoder()
_op_decoder: Final = msgspec.msgpack.Decoder(list[OpRecord])
_checkpoint_decoder: Final = msgspec.json.Decoder(Checkpoint)


async def ensure_streams(
    js: JetStreamContext,
    *,
    half_retention: float,
    replicas: int = 1,
    deadline: float = DECLARE_DEADLINE,
) -> KeyValue:
    """Create (or widen, `topics.declare_stream`) TXN_HALF, TXN_OP, TXN_DISCARD and the
    checkpoint bucket, retrying transient answers for `deadline` seconds each."""
    retention = half_retention * 2  # halves must outlive the retention decision about them
    await declare_stream(
        js,
        StreamConfig(
            name=layout.HALF_STREAM,
            subjects=[layout.half_subject_filter()],
            max_age=retention,
            duplicate_window=DEDUPE_WINDOW,
            allow_direct=True,
            allow_atomic=True,  # halves queued meanwhile are written as one batch
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
    await declare_stream(
        js,
        StreamConfig(
            name=layout.OP_STREAM,
            subjects=[layout.op_subject_filter()],
            max_age=retention,
            duplicate_window=DEDUPE_WINDOW,
            allow_atomic=True,  # every partition's op records of a moment in one write
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
    await declare_stream(
        js,
        StreamConfig(
            name=layout.DISCARD_STREAM,
            subjects=[layout.discard_subject_filter()],
            duplicate_window=DEDUPE_WINDOW,
            discard=DiscardPolicy.OLD,
            storage=StorageType.FILE,
            num_replicas=replicas,
        ),
        deadline=deadline,
    )
    return await ensure_bucket(
        js,
        KeyValueConfig(
            bucket=layout.CHECKPOINT_BUCKET, history=1, storage=StorageType.FILE, replicas=replicas
        ),
        deadline=deadline,
    )


async def ensure_bucket(
    js: JetStreamContext, config: KeyValueConfig, *, deadline: float = DECLARE_DEADLINE
) -> KeyValue:
    """Open KV bucket `config.bucket`, creating it if absent; it gets `config.replicas` copies
    at least (an existing bucket keeps an operator's other settings). Transient answers are
    retried for `deadline` seconds (`declaring`)."""
    return await declaring(
        f"KV bucket {config.bucket}",
        lambda: _ensure_bucket(js, config),
        deadline=deadline,
        replicas=config.replicas,
    )


async def _ensure_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        kv = await js.key_value(config.bucket)
    except nats.js.errors.BucketNotFoundError:
        try:
            return await js.create_key_value(config)
        except nats.js.errors.APIError as error:
            if is_replicas_error(error):
                raise replicas_error(
                    f"KV bucket {config.bucket}", config.replicas, error
                ) from error
            raise
    await ensure_replicas(js, f"KV_{config.bucket}", config.replicas)
    return kv


# -- halves ---------------------------------------------------------------------------------


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
            layout.MSG_ID_HEADER: f"{layout.message_id(txid, half.index)}{_HALF_ID_SUFFIX}",
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
    msg_id = headers[layout.MSG_ID_HEADER]
    if not msg_id.endswith(_HALF_ID_SUFFIX):
        raise ValueError(f"{layout.MSG_ID_HEADER} {layout.shown(msg_id)} is not a half's")
    txid, _, index = msg_id.removesuffix(_HALF_ID_SUFFIX).rpartition(":")
    if not txid:
        raise ValueError(f"{layout.MSG_ID_HEADER} {layout.shown(msg_id)} names no txid")
    return txid, int(index)


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


# -- packs ----------------------------------------------------------------------------------


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
        layout.MSG_ID_HEADER: _pack_ids.next().decode() + _PACK_ID_SUFFIX,
        layout.PACK_HEADER: PACK_VERSION,
    }
    body = _array_header(len(entries)) + b"".join(entries)
    return Append(layout.half_subject(partition), body, headers, layout.HALF_STREAM)


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


# -- op records and checkpoints -------------------------------------------------------------


def encode_ops(records: list[OpRecord]) -> bytes:
    return _op_encoder.encode(records)


def decode_ops(data: bytes) -> list[OpRecord]:
    return _op_decoder.decode(data)


async def load_checkpoint(kv: KeyValue, partition: int) -> Checkpoint:
    with contextlib.suppress(nats.js.errors.KeyNotFoundError):
        entry = await kv.get(str(partition))
        if entry.value:
            return _checkpoint_decoder.decode(entry.value)
    return Checkpoint(1, 1)


async def save_checkpoint(kv: KeyValue, partition: int, checkpoint: Checkpoint) -> None:
    await kv.put(str(partition), msgspec.json.encode(checkpoint))
