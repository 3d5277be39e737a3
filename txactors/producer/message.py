"""`TxMessage`: what a user hands to a transaction, checked before anything is sent.

Every name in a message ends up somewhere strict: the topic and tag in a NATS subject and a
stream name, the properties in NATS headers next to txactors' own, the keys in one
comma-separated header. Refusing a bad value at construction, with a message that says
which rule it broke, beats an `Error` reply (or a silently mangled header) after the
local transaction has already run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from txactors.errors import ConfigError, ConfigTypeError
from txactors.wire.layout import NO_TAG, RESERVED_HEADER_PREFIXES, validate_name
from txactors.wire.protocol import OutgoingMessage

# RFC 7230 token: what a header name may be made of (NATS headers follow HTTP's rules).
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_BODY_TYPES = (bytes, bytearray, memoryview, msgspec.Struct)

_VALID_TOPICS: set[str] = set()
"""Topics found valid: a producer sends to a few topics over and over, and checking one
costs as much as the rest of a message's checks. Emptied when it reaches `_KNOWN_TOPICS`."""
_KNOWN_TOPICS = 1024


@dataclass(frozen=True, slots=True)
class TxMessage:
    """One message of a transaction, delivered on `topic` only if the transaction commits.

    `body` is bytes (or bytes-like), or a msgspec Struct that is encoded with msgpack
    (consumers decode it with `msgspec.msgpack.decode(body, type=TheStruct)`, a checker
    with `view.messages[i].decode(TheStruct)`). `properties` are delivered as headers; names
    starting with `Nats-` or `Txn-` are reserved. `check_immunity` (seconds) leaves the
    transaction alone that long before the first check-back; the coordinator clamps it to
    [transaction timeout, 1 h].
    """

    topic: str
    body: bytes | bytearray | memoryview | msgspec.Struct
    keys: Sequence[str] = ()
    tag: str | None = None
    properties: Mapping[str, str] = field(default_factory=dict)
    check_immunity: float | None = None

    def __post_init__(self) -> None:
        if self.topic not in _VALID_TOPICS:
            _VALID_TOPICS.add(validate_name("topic", self.topic))
            if len(_VALID_TOPICS) > _KNOWN_TOPICS:
                _VALID_TOPICS.clear()
        if not isinstance(self.body, _BODY_TYPES):
            raise ConfigTypeError(
                f"body must be bytes or a msgspec.Struct, not {type(self.body).__name__}"
            )
        if isinstance(self.keys, str):
            raise ConfigTypeError("keys must be a list of strings, not one string")
        for key in self.keys:
            if not isinstance(key, str) or not key or "," in key or _has_line_break(key):
                raise ConfigError(
                    f"key {key!r} must be a non-empty string without commas or line breaks "
                    "(keys travel comma-separated in one header)"
                )
        if self.tag is not None:
            validate_name("tag", self.tag)
            if self.tag == NO_TAG:
                raise ConfigError(f"tag {NO_TAG!r} is reserved for messages without a tag")
        for name, value in self.properties.items():
            _check_property(name, value)
        if self.check_immunity is not None and not (
            math.isfinite(self.check_immunity) and self.check_immunity > 0
        ):
            raise ConfigError(
                f"check_immunity must be a positive number of seconds, not {self.check_immunity!r}"
            )

    def to_outgoing(self) -> OutgoingMessage:
        """The wire form the coordinator stores as a half message."""
        body = self.body
        if type(body) is bytes:  # the usual body, and no Struct (whose check costs more)
            data = body
        elif isinstance(body, msgspec.Struct):
            data = msgspec.msgpack.encode(body)
        else:
            data = bytes(body)
        return OutgoingMessage(
            topic=self.topic,
            body=data,
            keys=list(self.keys),
            tag=self.tag,
            properties=dict(self.properties),
            check_immunity=self.check_immunity,
        )


def _has_line_break(text: str) -> bool:
    return "\r" in text or "\n" in text


def _check_property(name: object, value: object) -> None:
    if not isinstance(name, str) or not _HEADER_NAME.match(name):
        raise ConfigError(
            f"property name {name!r} must be a header token: letters, digits and "
            "!#$%&'*+-.^_`|~ (it is delivered as a NATS header)"
        )
    reserved = [p for p in RESERVED_HEADER_PREFIXES if name.lower().startswith(p.lower())]
    if reserved:
        raise ConfigError(
            f"property {name!r} uses the reserved prefix {reserved[0]!r}; "
            f"txactors and NATS own headers starting with {' or '.join(RESERVED_HEADER_PREFIXES)}"
        )
    if not isinstance(value, str) or _has_line_break(value):
        raise ConfigError(f"property {name!r} must be a string without line breaks, not {value!r}")
