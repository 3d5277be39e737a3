"""What a consumer's handler sees of one committed message.

A read-only view built from the JetStream message, so a handler never touches acks (the
consumer owns them: returning acks, raising retries) and reads the transaction's headers by
name rather than by string keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, TypeVar

import msgspec
from nats.aio.msg import Msg

from txactors.nats.acks import ack_fields
from txactors.wire.copies import is_server_header
from txactors.wire.layout import (
    COMMITTED_AT_HEADER,
    KEYS_HEADER,
    MSG_ID_HEADER,
    NO_TAG,
    RESERVED_HEADER_PREFIXES,
    TXID_HEADER,
)
from txactors.wire.protocol import decode_payload

T = TypeVar("T")

NAME_SETS_KEPT: Final = 1024
"""Sets of header names whose server headers `handler_headers` remembers (a bound: the
names are the producers')."""
_dropped: dict[tuple[str, ...], tuple[str, ...]] = {}


class ConsumedMessage(msgspec.Struct, frozen=True):
    """One delivery of a committed message.

    A frozen msgspec Struct rather than a frozen dataclass: built once per delivery, in C,
    where the dataclass set each of its 11 fields through `object.__setattr__` (20x the cost).
    """

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
        return decode_payload(self.body, self.headers, type_)

    @classmethod
    def from_nats(cls, msg: Msg) -> ConsumedMessage:
        """Build the view of a message delivered by a JetStream consumer on a topic stream."""
        return delivered(msg)[0]


def delivered(msg: Msg) -> tuple[ConsumedMessage, int]:
    """The handler's view of `msg` and the messages still pending behind it (the group's lag).

    Every header and metadata field a consumer reads is read here, once per delivery, and
    cheaply (it is most of what a consumer does per message beyond receiving and acking it):
    the ack subject is split once (nats-py's `metadata` also builds a timestamp we never use).
    """
    stream, seq, deliveries, pending = ack_fields(msg)
    stored = msg.headers or {}
    headers = handler_headers(stored) if stored else {}
    # topic.<topic>.<tag>; the subject, not a header, is what the consumer filtered on.
    _, topic, tag = msg.subject.split(".", 2)
    keys = headers.get(KEYS_HEADER)
    committed_at = headers.get(COMMITTED_AT_HEADER)
    message = ConsumedMessage(
        topic=topic,
        tag=None if tag == NO_TAG else tag,
        keys=tuple(k for k in keys.split(",") if k) if keys else (),
        txid=headers.get(TXID_HEADER),
        msg_id=stored.get(MSG_ID_HEADER) or f"{stream}:{seq}",
        body=msg.data,
        headers=headers,
        deliveries=deliveries,
        stream_seq=seq,
        committed_at=None if committed_at is None else _seconds(committed_at),
        subject=msg.subject,
    )
    return message, pending


def _seconds(value: str) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


def handler_headers(stored: Mapping[str, str]) -> dict[str, str]:
    """`copies.copied_headers(stored)` for a delivery's headers (names and values `str`, as a
    NATS client parses them): a copy less the server's. The names repeat from message to
    message, so which of them to drop is worked out once per set of names, not per header."""
    names = tuple(stored)
    dropped = _dropped.get(names)
    if dropped is None:
        dropped = tuple(name for name in names if is_server_header(name))
        if len(_dropped) < NAME_SETS_KEPT:
            _dropped[names] = dropped
    headers = dict(stored)
    for name in dropped:
        del headers[name]
    return headers
