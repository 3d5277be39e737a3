"""What recovery reads back: TXN_OP's messages, each a msgpack list of `OpRecord`s (one per
group commit), and a partition's checkpoint in its bucket, where its replay starts."""

from __future__ import annotations

import contextlib
from typing import Final

import msgspec
import nats.js.errors
from nats.js.kv import KeyValue

from txactors.coordinator.core.records import OpRecord
from txactors.coordinator.core.transactions import Checkpoint

_op_encoder: Final = msgspec.msgpack.Encoder()
_op_decoder: Final = msgspec.msgpack.Decoder(list[OpRecord])
_checkpoint_decoder: Final = msgspec.json.Decoder(Checkpoint)


def encode_ops(records: list[OpRecord]) -> bytes:
    return _op_encoder.encode(records)


def decode_ops(data: bytes) -> list[OpRecord]:
    return _op_decoder.decode(data)


def checkpoint_key(partition: int, *, legacy: bool = False) -> str:
    """The bucket key of `partition`'s checkpoint: `log.<p>`, positions in its own log. The
    shared layout of 0.2 kept them under `<p>`, positions in TXN_HALF and TXN_OP: a 0.2
    coordinator left running still writes there, and must not steer the new log's reads."""
    return str(partition) if legacy else f"log.{partition}"


async def load_checkpoint(kv: KeyValue, partition: int, *, legacy: bool = False) -> Checkpoint:
    with contextlib.suppress(nats.js.errors.KeyNotFoundError):
        entry = await kv.get(checkpoint_key(partition, legacy=legacy))
        if entry.value:
            return _checkpoint_decoder.decode(entry.value)
    return Checkpoint(1, 1)


async def save_checkpoint(
    kv: KeyValue, partition: int, checkpoint: Checkpoint, *, legacy: bool = False
) -> None:
    await kv.put(checkpoint_key(partition, legacy=legacy), msgspec.json.encode(checkpoint))
