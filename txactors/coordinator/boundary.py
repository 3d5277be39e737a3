"""The coordinator's one input boundary: what it accepts from the bus, checked before it acts.

Every verb a coordinator serves (`Prepare`, `EndTransaction`, their batches `PrepareBatch`
and `EndBatch`, the admin commands) and every answer a producer sends back to a check-back
(`CheckResult`) passes through here, after msgspec has checked the types (protocol.Codec) and
before anything is written. What is not allowed is
refused with `bad_request`, the field's path (`$.messages[2].properties['a b']`) and what is
allowed; nothing is trimmed, clamped or rewritten. What a well-formed request may not do is
refused with `forbidden`: a prepare or end on another producer group's subject
(`txn.coord.<p>.prepare|end.<group>` names the group NATS permissions let the sender use), or,
under a tenant policy (`group_topics`), into a topic its group was not given. The limits are
chosen so that whatever passes can be stored, published, checked back and discarded without the
broker refusing it later (a record the broker refuses would stop a partition for good); the
table in docs/protocol.md lists them. A batch is checked as a whole first (its version, names,
subject, item count, and that its one answer fits in `max_payload` whatever each item's
answer turns out to be); then each item, as the `Prepare` or `EndTransaction` it stands for
(`prepares_of`, `ends_of`), goes through the same checks as a lone one and is refused alone,
an item that did not even decode (protocol.UnreadableItem) with its decoding error.
Pure, no I/O: tests/unit/test_coordinator_validation.py drives it with Hypothesis.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from txactors.actors.remote import REPLY_HEADROOM
from txactors.coordinator.core import tokens
from txactors.coordinator.core.states import TxnState
from txactors.coordinator.partition.halves import seconds_text
from txactors.errors import TxActorsError
from txactors.wire import layout
from txactors.wire.answers import BATCH_ANSWER_BASE, item_answer_bytes
from txactors.wire.framing import JETSTREAM_MAX_HEADER_BYTES, header_block_bytes
from txactors.wire.protocol import (
    BATCH_VERSION,
    OLDEST_VERSION,
    PROTOCOL_VERSION,
    CheckResult,
    Command,
    EndBatch,
    EndItem,
    EndTransaction,
    Error,
    ErrorCode,
    ListTransactions,
    OperatorDecision,
    OutgoingMessage,
    Prepare,
    PrepareBatch,
    PrepareItem,
    ShowTransaction,
    UnreadableItem,
    unsupported_version,
)

HEADER_RESERVE: Final = 1024
"""Bytes kept free, in the header block and in the whole message, for headers added after
the prepare: a discarded copy's reason, check count, txid and index, a dead-lettered copy's
error."""
MAX_HALF_HEADER_BYTES: Final = JETSTREAM_MAX_HEADER_BYTES - HEADER_RESERVE
MAX_KEY_LENGTH: Final = 256
MAX_PROPERTY_NAME_LENGTH: Final = 128
PROPERTY_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An RFC 7230 token: what nats-py (and the NATS header format) accepts as a header name."""
PROPERTY_NAME_GRAMMAR: Final = "letters, digits and !#$%&'*+-.^_`|~"
TEXT_GRAMMAR: Final = (
    "printable UTF-8 text (no control characters or line breaks) without leading or trailing blanks"
)

MAX_LIST_LIMIT: Final = 100_000
BATCH: Final = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
BATCH_GRAMMAR: Final = "1 to 64 of letters, digits, '_', '-', '.' and ':'"

# Worst cases for the header values only known when the half is written.
_WORST_BORN_BYTES: Final = len(seconds_text(-sys.float_info.max).encode())
"""The longest `seconds_text`: 24 characters, as long as any float's repr. Counted once here:
rounding a float that large to the millisecond takes 40 us (a 309-digit conversion), which
made it most of the boundary's cost per prepared message."""
_WORST_INDEX: Final = 2**63 - 1
_WORST_DIGEST: Final = tokens.digest("0" * 32)
_NO_HEADER_BYTES: Final = header_block_bytes({})
_HALF_HEADER_BYTES: Final = (
    header_block_bytes(
        {
            layout.MSG_ID_HEADER: layout.half_message_id("", _WORST_INDEX),  # after the txid
            layout.TOKEN_HEADER: _WORST_DIGEST,
            layout.GROUP_HEADER: "",
            layout.PRODUCER_HEADER: "",
            layout.TOPIC_HEADER: "",
            layout.BORN_HEADER: "",
            layout.BEGINS_HEADER: "1",
        }
    )
    + _WORST_BORN_BYTES
)
"""A half's header block less its txid, group, producer and topic: the headers it always has."""
_TAG_HEADER_BYTES: Final = header_block_bytes({layout.TAG_HEADER: ""}) - _NO_HEADER_BYTES
_KEYS_HEADER_BYTES: Final = header_block_bytes({layout.KEYS_HEADER: ""}) - _NO_HEADER_BYTES
_IMMUNITY_HEADER_BYTES: Final = header_block_bytes({layout.IMMUNITY_HEADER: ""}) - _NO_HEADER_BYTES


class _Refused(TxActorsError):
    """Private control flow: caught in `Boundary.refusal`, which answers with an `Error`."""

    def __init__(self, path: str, rule: str, code: ErrorCode = ErrorCode.BAD_REQUEST) -> None:
        super().__init__(f"{path}: {rule}")
        self.code = code


@dataclass(frozen=True, slots=True, kw_only=True)
class Boundary:
    """The checks of one partition's coordinator: its number, the partition count, and the
    limits it was configured with."""

    partition: int
    partitions: int
    max_messages: int
    max_immunity: float
    max_batch_items: int = 256
    group_topics: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The tenant policy (CoordinatorOptions.group_topics); empty: any group, any topic."""

    def refusal(
        self,
        command: Any,
        *,
        max_payload: int,
        subject: str | None = None,
        group_of: Callable[[str], str | None] = lambda txid: None,
    ) -> Error | None:
        """The `bad_request`, `forbidden` (or `unknown_command`) to answer `command` with, or
        None if it may go on.

        `max_payload` is the connected server's (it can change on a reconnect); `subject` the
        one the command arrived on (None: from this process); `group_of` the group of a known
        transaction (None: not known here). The version is checked first: another version's
        other fields may mean something else.
        """
        if isinstance(command, UnreadableItem):  # a batch's item that did not decode
            return command.error
        if isinstance(command, Command):
            unsupported = unsupported_version(command.version)
            if unsupported is not None:
                return unsupported
            if command.version < 1:
                rule = f"the protocol version, {OLDEST_VERSION} to {PROTOCOL_VERSION}"
                return Error(ErrorCode.BAD_REQUEST, f"$.version: {rule}, not {command.version}")
        try:
            match command:
                case Prepare():
                    self._check_prepare(command, max_payload)
                    self._check_tenant(command, subject)
                case EndTransaction():
                    self._check_txid(command.txid)
                    _check_token("$.token", command.token)
                    _check_end_group(command.txid, group_of(command.txid), subject)
                case PrepareBatch() | EndBatch():
                    self._check_batch(command, max_payload, subject)
                case ListTransactions():
                    _check_listing(command)
                case ShowTransaction():
                    self._check_txid(command.txid)
                case OperatorDecision():
                    self._check_txid(command.txid)
                    if command.batch is not None and not BATCH.fullmatch(command.batch):
                        raise _Refused("$.batch", f"null or {BATCH_GRAMMAR}")
                case _:
                    name = type(command).__name__
                    return Error(ErrorCode.UNKNOWN_COMMAND, f"{name} is not served here")
        except _Refused as refused:
            return Error(refused.code, str(refused))
        return None

    def _check_batch(
        self, batch: PrepareBatch | EndBatch, max_payload: int, subject: str | None
    ) -> None:
        """What holds for a batch as a whole (its items are checked one by one later)."""
        if batch.version < BATCH_VERSION:
            raise _Refused(
                "$.version",
                f"{BATCH_VERSION} or later: {type(batch).__name__} came with protocol version "
                f"{BATCH_VERSION}, not {batch.version}",
            )
        if isinstance(batch, PrepareBatch):
            _check_name("$.group", "group", batch.group)
            _check_name("$.producer", "producer", batch.producer)
            _check_sent_as(batch.group, subject)
        count = len(batch.items)
        if not 1 <= count <= self.max_batch_items:
            raise _Refused("$.items", f"1 to {self.max_batch_items} items per batch, not {count}")
        room = max_payload - REPLY_HEADROOM
        answerable = answerable_items(batch, self.max_messages, room)
        if answerable < count:
            raise _Refused(
                "$.items",
                f"the answer to {count} items could take more than the {room} bytes a reply "
                f"may carry here (the server's max_payload {max_payload} less "
                f"{REPLY_HEADROOM}); send at most the first {answerable} in one batch",
            )

    def _check_tenant(self, prepare: Prepare, subject: str | None) -> None:
        """The group the subject names (what NATS let the sender publish) is the prepare's,
        and the policy gives that group every topic the prepare names."""
        _check_sent_as(prepare.group, subject)
        if not self.group_topics:
            return
        allowed = self.group_topics.get(prepare.group)
        if allowed is None:
            raise _Refused(
                "$.group",
                f"group {_quoted(prepare.group)} may not prepare here: the coordinator's "
                "group_topics policy does not list it",
                ErrorCode.FORBIDDEN,
            )
        for i, message in enumerate(prepare.messages):
            if not topic_allowed(message.topic, allowed):
                raise _Refused(
                    f"$.messages[{i}].topic",
                    f"group {_quoted(prepare.group)} may not write to topic "
                    f"{_quoted(message.topic)}; the group_topics policy allows it "
                    f"{', '.join(allowed)}",
                    ErrorCode.FORBIDDEN,
                )

    def prefix_rules(self, group: str, topic: str) -> tuple[str, ...]:
        """The prefix rules (`orders-*`) by which the policy lets `group` write `topic`, when
        no rule names it outright: a new stream for it counts against `max_prefix_topics`.
        Empty: no policy, or the topic is named (its stream is not capped)."""
        allowed = self.group_topics.get(group, ())
        if topic in allowed:
            return ()
        return tuple(p for p in allowed if p.endswith("*") and topic.startswith(p[:-1]))

    def _check_txid(self, txid: str) -> None:
        _check_name("$.txid", "txid", txid)
        owner = layout.partition_of(txid, self.partitions)
        if owner != self.partition:
            raise _Refused(
                "$.txid",
                f"transaction {txid} belongs to partition {owner} (crc32 mod "
                f"{self.partitions}), not {self.partition}: use txn.coord.{owner}.*",
            )

    def _check_prepare(self, prepare: Prepare, max_payload: int) -> None:
        self._check_txid(prepare.txid)
        _check_name("$.group", "group", prepare.group)
        _check_name("$.producer", "producer", prepare.producer)
        if prepare.token is not None:
            _check_token("$.token", prepare.token)
        if not 1 <= len(prepare.messages) <= self.max_messages:
            raise _Refused("$.messages", f"1 to {self.max_messages} messages per prepare")
        for i, message in enumerate(prepare.messages):
            self._check_message(f"$.messages[{i}]", prepare, message, max_payload)

    def _check_message(
        self, path: str, prepare: Prepare, message: OutgoingMessage, max_payload: int
    ) -> None:
        _check_name(f"{path}.topic", "topic", message.topic)
        if message.tag is not None:
            _check_name(f"{path}.tag", "tag", message.tag)
            if message.tag == layout.NO_TAG:
                raise _Refused(f"{path}.tag", f"{layout.NO_TAG!r} means 'no tag': send null")
        for k, key in enumerate(message.keys):
            key_path = f"{path}.keys[{k}]"
            if not key or len(key) > MAX_KEY_LENGTH or "," in key:
                raise _Refused(key_path, f"1 to {MAX_KEY_LENGTH} characters, no ','")
            _check_text(key_path, key)
        for name, value in message.properties.items():
            property_path = f"{path}.properties[{layout.shown(name)}]"
            _check_property_name(property_path, name)
            _check_text(property_path, value)
        immunity = message.check_immunity
        if immunity is not None and not (
            math.isfinite(immunity) and 0 <= immunity <= self.max_immunity
        ):
            raise _Refused(
                f"{path}.check_immunity",
                f"null or a number of seconds from 0 to {self.max_immunity:g}, not {immunity!r}",
            )
        header_bytes = half_header_bytes(prepare, message)
        if header_bytes > MAX_HALF_HEADER_BYTES:
            raise _Refused(
                path,
                f"its headers (properties, keys and the coordinator's own) take {header_bytes} "
                f"bytes; at most {MAX_HALF_HEADER_BYTES} (JetStream's header limit is "
                f"{JETSTREAM_MAX_HEADER_BYTES}, {HEADER_RESERVE} are kept for later headers)",
            )
        size = header_bytes + len(message.body)
        limit = max_payload - HEADER_RESERVE
        if size > limit:
            raise _Refused(
                path,
                f"body and headers take {size} bytes; at most {limit} (the server's "
                f"max_payload {max_payload} less {HEADER_RESERVE} kept for later headers)",
            )


def _sent_as(subject: str | None) -> str | None:
    """The group NATS let the sender publish as (None: from this process, or on a subject that
    names no group, which only a tenant policy polices)."""
    return layout.subject_group(subject) if subject is not None else None


def _check_sent_as(group: str, subject: str | None) -> None:
    """A prepare (or a batch of them) comes on the subject of its own group."""
    sent_as = _sent_as(subject)
    if sent_as is not None and sent_as != group:
        raise _Refused(
            "$.group",
            f"the prepare is for group {_quoted(group)} but came on the subject "
            f"of group {_quoted(sent_as)}: a group prepares only on "
            "txn.coord.<partition>.prepare.<its group>",
            ErrorCode.FORBIDDEN,
        )


def answerable_items(batch: PrepareBatch | EndBatch, max_messages: int, room: int) -> int:
    """How many of the batch's first items can be answered in one reply of `room` bytes, in
    either encoding, each answer counted at its longest by wire/answers.py's rule (an item with
    more than `max_messages` is answered with an error)."""
    items: Sequence[PrepareItem | EndItem] = batch.items
    size = BATCH_ANSWER_BASE
    for answered, item in enumerate(items):
        size += item_answer_bytes(item, max_messages)
        if size > room:
            return answered
    return len(batch.items)


def prepares_of(batch: PrepareBatch) -> list[Prepare | UnreadableItem]:
    """The `Prepare` each item stands for: checked and carried out as a lone one would be
    (an item that did not decode stays as it is: `refusal` answers it with its error)."""
    return [
        item
        if isinstance(item, UnreadableItem)
        else Prepare(
            version=batch.version,
            txid=item.txid,
            group=batch.group,
            producer=batch.producer,
            messages=item.messages,
            token=item.token,
        )
        for item in batch.items
    ]


def ends_of(batch: EndBatch) -> list[EndTransaction | UnreadableItem]:
    """The `EndTransaction` each item stands for (see `prepares_of`)."""
    return [
        item
        if isinstance(item, UnreadableItem)
        else EndTransaction(
            version=batch.version, txid=item.txid, token=item.token, decision=item.decision
        )
        for item in batch.items
    ]


def _check_end_group(txid: str, group: str | None, subject: str | None) -> None:
    """An end comes on its transaction's group's subject. The token proves the sender may end
    it already; the group NATS let the sender use must agree (without naming the other)."""
    sent_as = _sent_as(subject)
    if sent_as is not None and group not in (None, sent_as):
        raise _Refused(
            "$.txid",
            f"{txid} is a transaction of another group than {sent_as!r}",
            ErrorCode.FORBIDDEN,
        )


def topic_allowed(topic: str, patterns: tuple[str, ...]) -> bool:
    """Whether `topic` is one of `patterns`: a topic name, or a prefix ending in `*`."""
    return any(topic.startswith(p[:-1]) if p.endswith("*") else topic == p for p in patterns)


def _check_listing(command: ListTransactions) -> None:
    known = {s.value for s in TxnState}
    for i, state in enumerate(command.states):
        if state not in known:
            raise _Refused(f"$.states[{i}]", f"one of {', '.join(sorted(known))}")
    if command.group is not None:
        _check_name("$.group", "group", command.group)
    if command.topic is not None:
        _check_name("$.topic", "topic", command.topic)
    older_than = command.older_than
    if older_than is not None and not (math.isfinite(older_than) and older_than >= 0):
        raise _Refused(
            "$.older_than", f"null or a finite number of seconds >= 0, not {older_than!r}"
        )
    if command.limit is not None and not 1 <= command.limit <= MAX_LIST_LIMIT:
        raise _Refused("$.limit", f"null (no limit) or 1 to {MAX_LIST_LIMIT}")


def check_answer_problem(answer: CheckResult, *, txid: str, check_id: int) -> str | None:
    """Why a producer's answer to a check-back cannot decide it (None: it can)."""
    if answer.txid != txid:
        return f"$.txid: the answer is about {layout.shown(answer.txid)}, the check about {txid}"
    if answer.check_id != check_id:
        return f"$.check_id: the answer is to check {answer.check_id}, not {check_id}"
    return None


def half_header_bytes(prepare: Prepare, message: OutgoingMessage) -> int:
    """The size of the header block of `message`'s half, as NATS frames it, with the
    coordinator's own headers at their longest (index, birth time, token digest, begins):
    what `header_block_bytes(half_headers(...))` gives for such a half, counted from the
    lengths alone (the boundary asks it of every prepared message)."""
    size = _HALF_HEADER_BYTES + _utf8_len(prepare.txid, prepare.group, prepare.producer)
    size += _utf8_len(message.topic)
    if message.tag is not None:
        size += _TAG_HEADER_BYTES + _utf8_len(message.tag)
    if message.keys:
        size += _KEYS_HEADER_BYTES + _utf8_len(*message.keys) + len(message.keys) - 1
    if message.check_immunity is not None:
        size += _IMMUNITY_HEADER_BYTES + len(repr(message.check_immunity))
    if message.properties:
        size += header_block_bytes(message.properties) - _NO_HEADER_BYTES
    return size


def _utf8_len(*texts: str) -> int:
    return len("".join(texts).encode())


def _check_name(path: str, kind: str, name: str) -> None:
    problem = layout.name_problem(kind, name)
    if problem is not None:
        raise _Refused(path, problem)


def _check_token(path: str, token: str) -> None:
    if not tokens.TOKEN_PATTERN.fullmatch(token):
        raise _Refused(path, "the token a Prepared reply gave: 32 lowercase hex digits")


def _check_property_name(path: str, name: str) -> None:
    if not PROPERTY_NAME.fullmatch(name) or len(name) > MAX_PROPERTY_NAME_LENGTH:
        raise _Refused(
            path,
            f"a property name is 1 to {MAX_PROPERTY_NAME_LENGTH} of {PROPERTY_NAME_GRAMMAR} "
            "(it travels as a NATS header name)",
        )
    if layout.is_reserved_header(name):
        prefixes = " or ".join(layout.RESERVED_HEADER_PREFIXES)
        reserved = ", ".join(sorted(layout.RESERVED_HEADER_NAMES))
        raise _Refused(
            path,
            f"reserved: txactors and NATS own headers starting with {prefixes} and the "
            f"names {reserved}, in any case",
        )


def _check_text(path: str, text: str) -> None:
    """Keys and property values travel as header values: nats-py trims them and turns
    line breaks into spaces, so such a value would arrive altered (or end the header)."""
    if not text.isprintable() or text != text.strip():
        raise _Refused(path, TEXT_GRAMMAR)


def _quoted(name: str) -> str:
    return layout.shown(name).replace("'", '"') if name.isprintable() else layout.shown(name)
