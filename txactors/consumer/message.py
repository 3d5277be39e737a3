"""What a consumer's handler sees of one committed message.

A read-only view built from the JetStream message, so a handler never touches acks (the
consumer owns them: returning acks, raising retries) and reads the transaction's headers by
name rather than by string keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from nats.aio.msg import Msg

from txactors.wire.copies import copied_headers
from txactors.wire.layout import (
    COMMITTED_AT_HEADER,
    KEYS_HEADER,
    MSG_ID_HEADER,
    NO_TAG,
    RESERVED_HEADER_PREFIXES,
    TXID_HEADER,
)
from txactors.wire.protocol import CONTENT_TYPE_HEADER, Encoding

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ConsumedMessage:
    """One delivery of a committed message."""

    topic: str
    tag: str | None
    keys: tuple[str, ...]
    txid: str | None
    msg_id: str
    """`<txid>:<index>` from `Nats-Msg-Id`; for a message published outside a transaction,
    `<stream>:<sequence>`. Stable across redeliveries: the key for idempotent handling."""
    body: bytes
    headers: Mapping[str, str]
    """The producer's properties and txactors' `Txn-*`: none of the server's `Nats-*` (a message
    committed in an atomic batch is stored with `Nats-Batch-*`); the id is `msg_id`."""
    deliveries: int
    """1 on the first delivery, 2 on the first retry, …"""
    stream_seq: int
    committed_at: float | None
    """Seconds since the epoch when the coordinator published the commit, if it said so."""
    subject: str

    @property
    def reconsume_times(self) -> int:
        """Retries before this delivery (RocketMQ's `reconsumeTimes`)."""
        return self.deliveries - 1

    @property
    def properties(self) -> dict[str, str]:
        """The user's properties: every header outside the `Nats-`/`Txn-` namespaces."""
        return {
            name: value
            for name, value in self.headers.items()
            if not name.startswith(RESERVED_HEADER_PREFIXES)
        }

    def decode(self, type_: type[T]) -> T:
        """The body as `type_` (e.g. a msgspec Struct): msgpack, or JSON when the producer
        marked it `Content-Type: application/json`. Raises msgspec.ValidationError if it
        does not fit; raised from a handler, that counts as a failure like any other."""
        if self.headers.get(CONTENT_TYPE_HEADER) == Encoding.JSON.value:
            return msgspec.json.decode(self.body, type=type_)
        return msgspec.msgpack.decode(self.body, type=type_)

    @classmethod
    def from_nats(cls, msg: Msg) -> ConsumedMessage:
        """Build the view of a message delivered by a JetStream consumer on a topic stream."""
        meta = msg.metadata
        stored = msg.headers or {}
        headers = copied_headers(stored)
        # topic.<topic>.<tag>; the subject, not a header, is what the consumer filtered on.
        _, topic, tag = msg.subject.split(".", 2)
        keys = headers.get(KEYS_HEADER, "")
        return cls(
            topic=topic,
            tag=None if tag == NO_TAG else tag,
            keys=tuple(k for k in keys.split(",") if k),
            txid=headers.get(TXID_HEADER),
            msg_id=stored.get(MSG_ID_HEADER) or f"{meta.stream}:{meta.sequence.stream}",
            body=msg.data,
            headers=headers,
            deliveries=meta.num_delivered,
            stream_seq=meta.sequence.stream,
            committed_at=_seconds(headers.get(COMMITTED_AT_HEADER)),
            subject=msg.subject,
        )


def _seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None
