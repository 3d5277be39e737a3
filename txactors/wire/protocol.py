"""The wire protocol: how Structs cross process boundaries on NATS.

Every command and reply is a tagged msgspec Struct (the tag field is `type`, its value the
class name). A payload is msgpack by default; a client that cannot speak msgpack sends JSON
and says so with the `Content-Type: application/json` header, and gets JSON back. Decoders
are built once per message union, so bad input fails at the boundary with msgspec's
path-bearing message and becomes an `Error` reply with a stable code; it never reaches an
actor (but for a batch's item that does not decode: it comes as an `UnreadableItem`, to be
refused alone). docs/protocol.md describes the same rules for other-language clients.

Schema evolution follows msgspec's rules: new fields get defaults, a field never changes type.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, ClassVar, Final, Generic, TypeVar

import msgspec

from txactors.wire.layout import CONTENT_TYPE_HEADER

T = TypeVar("T")

PROTOCOL_VERSION: Final = 3
"""The protocol version this code speaks (docs/protocol.md#protocol-version): 2 added the
one-way end and the `version` field itself, 3 the batch verbs (`PrepareBatch`, `EndBatch`)."""
BATCH_VERSION: Final = 3
"""The first version with the batch verbs: a batch command must say at least this."""
OLDEST_VERSION: Final = 2
"""The oldest version this code serves. Version 1 (a command without `version`) was removed
in 0.x: it is refused with `unsupported_version`, so a client that predates the field learns
why instead of being read as a newer one."""


class Encoding(enum.StrEnum):
    """Payload encodings, named by the value of the `Content-Type` header."""

    MSGPACK = "application/msgpack"
    JSON = "application/json"


class ErrorCode(enum.StrEnum):
    """Stable error codes; clients branch on these, never on the message text."""

    BAD_REQUEST = "bad_request"  # malformed bytes, wrong types, a value outside the limits
    UNKNOWN_COMMAND = "unknown_command"  # a well-formed payload whose `type` nobody serves
    NOT_FOUND = "not_found"  # the thing named (e.g. a transaction) does not exist
    FORBIDDEN = "forbidden"  # the caller may not do this (e.g. wrong commit token)
    CONFLICT = "conflict"  # contradicts an earlier, final decision
    TIMEOUT = "timeout"  # the work did not finish in time
    INTERNAL = "internal"  # the server failed; the request may be retried
    UNSUPPORTED_VERSION = "unsupported_version"  # a `version` newer than the server speaks


class Message(msgspec.Struct, tag_field="type", tag=True):
    """Base of every protocol Struct: gives it the `type` tag."""


class Command(Message, kw_only=True):
    """Base of every request to the coordinator: it says which protocol version it speaks."""

    version: int
    """The client's protocol version, required: a command without it (version 1) or with a
    version the server does not speak is refused with `unsupported_version`."""


class Error(Message, omit_defaults=True):
    """The reply to any request that could not be carried out."""

    code: str
    message: str
    retry_after: float | None = None
    """Seconds to wait before trying again, when the failure is expected to pass (the
    coordinator cannot write now, a topic stream is being elected); absent otherwise."""


_MSGPACK, _JSON = Encoding.MSGPACK, Encoding.JSON
"""Read per message: `Encoding.X` goes through `EnumType.__getattr__`'s hook on Python 3.11."""
_msgpack_encoder: Final = msgspec.msgpack.Encoder()
_json_encoder: Final = msgspec.json.Encoder()


def encode(message: Any, encoding: Encoding = Encoding.MSGPACK) -> bytes:
    """Encode a Struct (or any msgspec-encodable value) for the wire."""
    if encoding is _JSON:
        return _json_encoder.encode(message)
    return _msgpack_encoder.encode(message)


def encoding_of(headers: Mapping[str, str] | None) -> Encoding | Error:
    """The encoding a request asked for; an unknown content type is a `bad_request`."""
    value = (headers or {}).get(CONTENT_TYPE_HEADER)
    if value is None:
        return _MSGPACK
    try:
        return Encoding(value.split(";", 1)[0].strip().lower())
    except ValueError:
        return Error(
            ErrorCode.BAD_REQUEST,
            f"unsupported {CONTENT_TYPE_HEADER} {value!r}; use "
            f"{Encoding.MSGPACK.value} (default) or {Encoding.JSON.value}",
        )


def payload_is_json(headers: Mapping[str, str]) -> bool:
    """Whether a user's payload is JSON (its producer marked it `Content-Type:
    application/json`) rather than msgpack: the one rule every reader of a payload follows."""
    return headers.get(CONTENT_TYPE_HEADER) == _JSON.value


def decode_payload(body: bytes, headers: Mapping[str, str], type_: type[T]) -> T:
    """A user's payload as `type_` (e.g. a msgspec Struct), JSON or msgpack as `headers` say
    (`payload_is_json`). Raises msgspec.ValidationError (or DecodeError) if it does not fit."""
    if payload_is_json(headers):
        return msgspec.json.decode(body, type=type_)
    return msgspec.msgpack.decode(body, type=type_)


def headers_for(encoding: Encoding) -> dict[str, str] | None:
    """Headers announcing `encoding`; msgpack is the default and needs none."""
    return None if encoding is _MSGPACK else {CONTENT_TYPE_HEADER: encoding.value}


def _tags_of(message_type: Any) -> frozenset[str]:
    info = msgspec.inspect.type_info(message_type)
    members = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return frozenset(
        str(member.tag) for member in members if isinstance(member, msgspec.inspect.StructType)
    )


def _all_commands(message_type: Any) -> bool:
    info = msgspec.inspect.type_info(message_type)
    members = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    return all(
        isinstance(member, msgspec.inspect.StructType) and issubclass(member.cls, Command)
        for member in members
    )


def unsupported_version(version: object) -> Error | None:
    """The `unsupported_version` error for a request that speaks a newer protocol than
    this code, or the removed version 1, or None (a version this code speaks, or no positive
    integer at all: other rules)."""
    if type(version) is not int or OLDEST_VERSION <= version <= PROTOCOL_VERSION:
        return None
    if version > PROTOCOL_VERSION:
        return Error(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} is newer than this server's ({OLDEST_VERSION} to "
            f"{PROTOCOL_VERSION}); send version {PROTOCOL_VERSION} or upgrade the server",
        )
    if version < 1:
        return None  # not a version at all: a `bad_request`
    return _removed_version(f"protocol version {version}")


def _removed_version(what: str) -> Error:
    return Error(
        ErrorCode.UNSUPPORTED_VERSION,
        f"{what} is no longer served (removed in 0.x; this server speaks {OLDEST_VERSION} to "
        f"{PROTOCOL_VERSION}); send version {PROTOCOL_VERSION}",
    )


_UNREADABLE: Final = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
"""What msgspec raises for bytes that are no payload at all: not msgpack/JSON, a string that
is not UTF-8, or nesting deeper than the decoder recurses."""


def _malformed(encoding: Encoding, exc: Exception) -> Error:
    if isinstance(exc, RecursionError):
        reason = "nested too deeply"
    elif isinstance(exc, UnicodeDecodeError):
        reason = f"a string is not valid UTF-8 ({exc.reason})"
    else:
        reason = _brief(str(exc))
    return Error(ErrorCode.BAD_REQUEST, f"malformed {encoding.name.lower()} payload: {reason}")


def _brief(text: str, limit: int = 500) -> str:
    """msgspec quotes the offending value: cut it short, a client may have sent megabytes."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


class Codec(Generic[T]):
    """Typed decoding of one message union, in both encodings, built once."""

    def __init__(self, message_type: Any) -> None:
        self.message_type = message_type
        self.tags = _tags_of(message_type)
        self.versioned = _all_commands(message_type)
        self._decoders: dict[Encoding, msgspec.msgpack.Decoder[T] | msgspec.json.Decoder[T]] = {
            Encoding.MSGPACK: msgspec.msgpack.Decoder(message_type),
            Encoding.JSON: msgspec.json.Decoder(message_type),
        }

    def decode(self, data: bytes, encoding: Encoding = Encoding.MSGPACK) -> T | Error:
        """The decoded message, or the `Error` to answer with: whatever the bytes, a
        `bad_request` or `unknown_command`, never an exception."""
        try:
            return self._decoders[encoding].decode(data)
        except msgspec.ValidationError as exc:
            return self._classify(data, encoding, exc)
        except _UNREADABLE as exc:
            return _malformed(encoding, exc)

    def _classify(self, data: bytes, encoding: Encoding, exc: msgspec.ValidationError) -> T | Error:
        # Only on the error path: decode untyped to tell an unknown tag from bad fields.
        try:
            raw = (msgspec.json if encoding is Encoding.JSON else msgspec.msgpack).decode(data)
        except _UNREADABLE:  # e.g. too deeply nested: the typed error says enough
            return Error(ErrorCode.BAD_REQUEST, _brief(str(exc)))
        versioned = self.versioned and isinstance(raw, dict)
        if versioned:
            unsupported = unsupported_version(raw.get("version"))
            if unsupported is not None:  # another version's fields may not fit our Structs
                return unsupported
        tag = raw.get("type") if isinstance(raw, dict) else None
        if not isinstance(tag, str):  # no tag, or a list or map (no `in self.tags` for those)
            return Error(ErrorCode.BAD_REQUEST, _brief(str(exc)))
        if tag not in self.tags:
            known = ", ".join(sorted(self.tags))
            return Error(
                ErrorCode.UNKNOWN_COMMAND, f"unknown command {tag[:64]!r}; expected {known}"
            )
        if versioned and "version" not in raw:  # a version 1 client's
            return _removed_version("a command without `version` (protocol version 1)")
        partly = self._partly_read(raw, tag, encoding)
        return Error(ErrorCode.BAD_REQUEST, _brief(str(exc))) if partly is None else partly

    def _partly_read(self, raw: dict[Any, Any], tag: str, encoding: Encoding) -> T | None:
        """A batch whose own fields decode but some of whose items do not (a field of the
        wrong type, not a map): the batch, each such item replaced by an `UnreadableItem`
        with the error it gets alone, so that it is refused alone as any bad item is. None
        for anything else (the batch's own fields are wrong: refused whole). Each item is
        decoded from its own bytes as its type, so it passes or fails as in the batch."""
        kinds = _BATCH_ITEMS.get(tag)
        items = raw.get("items")
        if kinds is None or not isinstance(items, list):
            return None
        item_type, stand_in = kinds
        codec = msgspec.json if encoding is Encoding.JSON else msgspec.msgpack
        try:
            batch: Any = self._decoders[encoding].decode(codec.encode({**raw, "items": []}))
        except msgspec.ValidationError:
            return None
        read: list[Any] = []
        for item in items:
            try:
                read.append(codec.decode(codec.encode(item), type=item_type))
            except msgspec.ValidationError as exc:
                read.append(stand_in(error=Error(ErrorCode.BAD_REQUEST, _brief(str(exc)))))
        if not any(isinstance(item, stand_in) for item in read):
            return None
        partly: T = msgspec.structs.replace(batch, items=read)
        return partly


# -- transactions: producer → coordinator (txn.coord.<partition>.prepare / .end) ---------------


class Decision(enum.StrEnum):
    """How a producer ends a transaction, or answers a check-back about it."""

    COMMIT = "commit"
    ROLLBACK = "rollback"
    UNKNOWN = "unknown"


class OutgoingMessage(msgspec.Struct, kw_only=True):
    """One message of a transaction, as the producer hands it to the coordinator."""

    topic: str
    body: bytes
    keys: list[str] = []
    tag: str | None = None
    properties: dict[str, str] = {}
    """Delivered as headers; names are header tokens outside `Nats-`/`Txn-` (docs/protocol.md)."""
    check_immunity: float | None = None
    """Seconds to leave the transaction alone before a check-back: at least the transaction
    timeout; more than the coordinator's `max_immunity` (1 h) is refused."""


class Prepare(Command, kw_only=True):
    """Store half messages. The first prepare of a transaction has no token; the coordinator
    answers with one, and later prepares of the same transaction (more messages) carry it."""

    txid: str
    group: str
    producer: str
    """The producer instance id: its check-backs go to `txn.check.<group>.<producer>` first."""
    messages: list[OutgoingMessage]
    token: str | None = None


class Prepared(Message, kw_only=True):
    """Receipt for a prepare: the halves are durable in the partition's log (`TXN_LOG_<p>`)
    at `seqs`."""

    txid: str
    token: str
    """Proof of ownership (128 random bits, hex): required by every later command."""
    seqs: list[int]


class EndTransaction(Command, kw_only=True):
    """Commit, roll back or leave to the check-back. Sent as a request it is answered with
    `Ended`; published without a reply subject (a one-way end) it is carried out the same
    way and never answered: the check-back settles an end that was lost."""

    txid: str
    token: str
    decision: Decision


class Ended(Message, kw_only=True):
    """The end was applied: `state` is where the transaction now is (e.g. `committed`)."""

    txid: str
    state: str


# -- batches: many transactions per NATS message (protocol version 3) ---------------------


class PrepareItem(msgspec.Struct, kw_only=True):
    """One transaction's prepare inside a `PrepareBatch`: a `Prepare` without what the batch
    says once for all its items (`version`, `group`, `producer`)."""

    txid: str
    messages: list[OutgoingMessage]
    token: str | None = None


class PrepareBatch(Command, kw_only=True):
    """Several prepares of one producer instance in one request, on the same subject as a
    `Prepare`. Each item is checked and carried out exactly as a `Prepare` with the batch's
    `group` and `producer` would be, on its own: a bad item is refused alone and the others
    go on. Answered with one `PreparedBatch`."""

    group: str
    producer: str
    items: list[PrepareItem]


class PreparedBatch(Message, kw_only=True):
    """The answer to a `PrepareBatch`: `results[i]` is what `items[i]` would have been
    answered alone (`Prepared` or `Error`)."""

    results: list[Prepared | Error]


class EndItem(msgspec.Struct, kw_only=True):
    """One transaction's end inside an `EndBatch`: an `EndTransaction` without `version`."""

    txid: str
    token: str
    decision: Decision


class EndBatch(Command, kw_only=True):
    """Several ends in one request (or, without a reply subject, one publish: one-way ends),
    on the same subject as an `EndTransaction`. Each item is checked and carried out on its
    own. Answered with one `EndedBatch`."""

    items: list[EndItem]


class EndedBatch(Message, kw_only=True):
    """The answer to an `EndBatch`: `results[i]` is what `items[i]` would have been answered
    alone (`Ended` or `Error`)."""

    results: list[Ended | Error]


class UnreadablePrepareItem(PrepareItem, kw_only=True):
    """In a decoded `PrepareBatch`, an item that did not decode as a `PrepareItem` (a field
    of the wrong type, or not a map at all): refused alone with `error`. Made by `Codec`,
    never sent; its other fields are empty."""

    txid: str = ""
    messages: list[OutgoingMessage] = []
    error: Error


class UnreadableEndItem(EndItem, kw_only=True):
    """In a decoded `EndBatch`, an item that did not decode as an `EndItem`: refused alone
    with `error` (see `UnreadablePrepareItem`)."""

    txid: str = ""
    token: str = ""
    decision: Decision = Decision.UNKNOWN
    error: Error


UnreadableItem = UnreadablePrepareItem | UnreadableEndItem

_BATCH_ITEMS: Final[dict[str, tuple[type[Any], type[UnreadableItem]]]] = {
    "PrepareBatch": (PrepareItem, UnreadablePrepareItem),
    "EndBatch": (EndItem, UnreadableEndItem),
}
"""By the tag of a batch: the type of its items, and the stand-in for one that does not
decode as it."""


# -- transactions: coordinator → producer group (txn.check.<group>[.<producer>]) -------------


class CheckedMessage(msgspec.Struct, kw_only=True):
    """What a checker sees of one half message, to decide what became of its transaction."""

    index: int
    topic: str
    body: bytes
    keys: list[str] = []
    tag: str | None = None
    properties: dict[str, str] = {}


class CheckTransaction(Message, kw_only=True):
    txid: str
    group: str
    check_id: int
    check_times: int
    """Inconclusive checks before this one."""
    messages: list[CheckedMessage]
    last: bool = False
    """One more inconclusive answer (UNKNOWN, an error, no answer) discards the transaction:
    a producer still at work on it decides now (see docs/protocol.md). False from a
    coordinator older than the field."""


class CheckResult(Message, kw_only=True):
    txid: str
    check_id: int
    resolution: Decision


# -- transactions: operators (txn.coord.<partition>.admin) ---------------------------------


class ListTransactions(Command, kw_only=True):
    """Open (prepared, checking, deciding) and discarded transactions, oldest first.

    Every filter given must hold: `states` (any of them), `group`, `topic` (one of its
    messages goes there), `older_than` (seconds since the first half, by the coordinator's
    clock). `limit` keeps the reply within `max_payload` on a big table; `TransactionList.more`
    says how many matched beyond it.
    """

    states: list[str] = []
    group: str | None = None
    topic: str | None = None
    older_than: float | None = None
    limit: int | None = None


class ShowTransaction(Command, kw_only=True):
    txid: str


class Resolution(enum.StrEnum):
    """What an operator decides about a transaction by hand (`txactors txn resume|commit|
    rollback`, one by one or in bulk), without its token."""

    RESUME = "resume"
    COMMIT = "commit"
    ROLLBACK = "rollback"


class OperatorDecision(Command, kw_only=True):
    """An operator's `Resolution` of one transaction. On the wire each resolution is its own
    command (the tag, `type`, is what other-language clients send); all have these fields and
    take one path through the coordinator."""

    resolution: ClassVar[Resolution]
    txid: str
    batch: str | None = None
    """Set by a bulk action, the same on each of its commands: the coordinator logs it."""


class ResumeTransaction(OperatorDecision, kw_only=True):
    """Back to PREPARED with a fresh check count (a discarded or pending transaction)."""

    resolution: ClassVar[Resolution] = Resolution.RESUME


class CommitTransaction(OperatorDecision, kw_only=True):
    """Operator: commit without the token (after checking the producer's database)."""

    resolution: ClassVar[Resolution] = Resolution.COMMIT


class RollbackTransaction(OperatorDecision, kw_only=True):
    """Operator: roll back without the token."""

    resolution: ClassVar[Resolution] = Resolution.ROLLBACK


OPERATOR_DECISIONS: Final[dict[Resolution, type[OperatorDecision]]] = {
    command.resolution: command
    for command in (ResumeTransaction, CommitTransaction, RollbackTransaction)
}
"""The command that carries each resolution."""


class TransactionInfo(Message, kw_only=True):
    txid: str
    state: str
    group: str
    producer: str
    topics: list[str]
    half_seqs: list[int]
    born: float
    """Seconds since the epoch when the first half was stored."""
    check_times: int
    last_check: str | None = None
    next_check_at: float | None = None
    discard_reason: str | None = None


class TransactionList(Message, kw_only=True):
    transactions: list[TransactionInfo]
    more: int = 0
    """Transactions that matched but were left out by the request's `limit`."""


CoordinatorCommand = Prepare | EndTransaction | PrepareBatch | EndBatch
AdminCommand = (
    ListTransactions | ShowTransaction | ResumeTransaction | CommitTransaction | RollbackTransaction
)
