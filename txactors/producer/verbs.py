"""How the producer's items travel to the coordinator: a prepare or an end alone as its single
verb (`Prepare`, `EndTransaction`), together as its batch (`PrepareBatch`, `EndBatch`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from txactors.wire.answers import item_answer_bytes
from txactors.wire.protocol import (
    Codec,
    EndBatch,
    Ended,
    EndedBatch,
    EndItem,
    EndTransaction,
    Error,
    Prepare,
    PrepareBatch,
    Prepared,
    PreparedBatch,
    PrepareItem,
    encode,
)

Item = TypeVar("Item", contravariant=True)


class Verb(Protocol[Item]):
    """How items of one kind travel: alone as the single verb, together as its batch."""

    replies: ClassVar[Codec[Any]]
    batch_reply: ClassVar[type[Any]]

    def encode(self, items: Sequence[Item], version: int) -> bytes: ...

    def answer_size(self, item: Item) -> int:
        """The bytes of the item's answer in a batch reply, at most."""
        ...


class PrepareVerb:
    """Prepares of one producer instance: `Prepare` alone, `PrepareBatch` together."""

    replies: ClassVar[Codec[Any]] = Codec(Prepared | PreparedBatch | Error)
    batch_reply: ClassVar[type[Any]] = PreparedBatch

    __slots__ = ("group", "producer")

    def __init__(self, group: str, producer: str) -> None:
        self.group = group
        self.producer = producer

    answer_size = staticmethod(item_answer_bytes)  # no frame of its own per item

    def encode(self, items: Sequence[PrepareItem], version: int) -> bytes:
        if len(items) == 1:
            [item] = items
            return encode(
                Prepare(
                    txid=item.txid,
                    group=self.group,
                    producer=self.producer,
                    messages=item.messages,
                    token=item.token,
                    version=version,
                )
            )
        return encode(
            PrepareBatch(
                group=self.group, producer=self.producer, items=list(items), version=version
            )
        )


class EndVerb:
    """Ends: `EndTransaction` alone, `EndBatch` together."""

    replies: ClassVar[Codec[Any]] = Codec(Ended | EndedBatch | Error)
    batch_reply: ClassVar[type[Any]] = EndedBatch

    __slots__ = ()

    answer_size = staticmethod(item_answer_bytes)  # no frame of its own per item

    def encode(self, items: Sequence[EndItem], version: int) -> bytes:
        if len(items) == 1:
            [item] = items
            return encode(
                EndTransaction(
                    txid=item.txid, token=item.token, decision=item.decision, version=version
                )
            )
        return encode(EndBatch(items=list(items), version=version))
