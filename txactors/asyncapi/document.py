"""The wire protocol as an AsyncAPI 3.0 document, generated from the code that speaks it.

The payload schemas are msgspec's JSON Schemas of the Structs in `protocol.py`; the subjects
and header names come from `layout.py`; the limits the coordinator enforces
(`coordinator/validation.py`) are added to the schemas as patterns, lengths and ranges. So the
document cannot drift from the code: `docs/asyncapi.json` is this module's output
(`txactors protocol asyncapi -o docs/asyncapi.json`), and tests/test_asyncapi.py fails when the
checked-in copy differs from a fresh one. What a schema cannot say (the check-back's encoding,
base64 in JSON, id ranges, which errors are retriable) is in docs/protocol.md.

The operations are a client's: a producer *sends* prepares and ends and *receives* check-backs,
a consumer *receives* committed messages, an operator *sends* admin commands.
"""

from __future__ import annotations

import inspect
import json
from importlib.metadata import version
from typing import Any, Final

import msgspec

from txactors import layout, protocol
from txactors.coordinator import tokens, validation
from txactors.coordinator.config import CoordinatorConfig
from txactors.coordinator.lifecycle import TxnState
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.records import DiscardReason

ASYNCAPI_VERSION: Final = "3.0.0"
OUTPUT: Final = "docs/asyncapi.json"
REGENERATE: Final = f"txactors protocol asyncapi -o {OUTPUT}"

NAME_PATTERN: Final = "^[A-Za-z0-9_-]+$"
"""`layout.name_problem`'s grammar (tests/test_asyncapi.py checks that they agree)."""

KEY_PATTERN: Final = r"^[^\s,]([^,]*[^\s,])?$"
"""A key: no ',', no blank at either end (control characters are refused too)."""
VALUE_PATTERN: Final = r"^(\S(.*\S)?)?$"
"""A property value: may be empty, no blank at either end, no line break."""

_SCHEMAS: Final = "#/components/schemas/"
_PARTITION: Final[Any] = "{partition}"
"""The channel parameter, where layout's subject functions take a partition number."""
_STRUCTS: Final = (
    protocol.Prepare,
    protocol.Prepared,
    protocol.EndTransaction,
    protocol.Ended,
    protocol.CheckTransaction,
    protocol.CheckResult,
    protocol.ListTransactions,
    protocol.ShowTransaction,
    protocol.ResumeTransaction,
    protocol.CommitTransaction,
    protocol.RollbackTransaction,
    protocol.TransactionInfo,
    protocol.TransactionList,
    protocol.Error,
)


def name_schema(kind: str) -> dict[str, Any]:
    """A name of `kind` as JSON Schema: layout.name_problem's grammar and length."""
    return {"pattern": NAME_PATTERN, "minLength": 1, "maxLength": layout.NAME_MAX_LENGTH[kind]}


def _or_null(schema: dict[str, Any], extra: dict[str, Any]) -> None:
    """Put `extra` on the non-null branch of msgspec's `anyOf [T, null]`."""
    schema["anyOf"][0].update(extra)


def _limits() -> dict[tuple[str, str], dict[str, Any]]:
    """What validation.py refuses, as JSON Schema keywords per (schema, property)."""
    token = {"pattern": f"^{tokens.TOKEN_PATTERN.pattern}$", "minLength": 32, "maxLength": 32}
    text = {"description": validation.TEXT_GRAMMAR}
    states = {"enum": [s.value for s in TxnState]}
    options, config = CoordinatorOptions(), CoordinatorConfig()
    return {
        ("Prepare", "txid"): name_schema("txid"),
        ("Prepare", "group"): name_schema("group"),
        ("Prepare", "producer"): name_schema("producer"),
        ("Prepare", "token"): token,
        ("Prepare", "messages"): {
            "minItems": 1,
            "description": "At most the coordinator's max_messages_per_prepare "
            f"({options.max_messages_per_prepare} by default).",
        },
        ("OutgoingMessage", "topic"): name_schema("topic"),
        ("OutgoingMessage", "tag"): {**name_schema("tag"), "not": {"const": layout.NO_TAG}},
        ("OutgoingMessage", "keys"): {
            "items": {**text, "maxLength": validation.MAX_KEY_LENGTH, "pattern": KEY_PATTERN}
        },
        ("OutgoingMessage", "properties"): {
            "propertyNames": {
                "pattern": f"^{validation.PROPERTY_NAME.pattern}$",
                "maxLength": validation.MAX_PROPERTY_NAME_LENGTH,
                "description": "Not `Nats-*`, `Txn-*`, `Status`, `Description` or "
                "`KV-Operation`, in any case.",
            },
            "additionalProperties": {"type": "string", **text, "pattern": VALUE_PATTERN},
        },
        ("OutgoingMessage", "check_immunity"): {
            "minimum": 0,
            "description": "Seconds; at most the coordinator's max_immunity "
            f"({config.max_immunity:g} by default).",
        },
        ("Prepared", "token"): token,
        ("Prepared", "seqs"): {"items": {"minimum": 1}},
        ("EndTransaction", "txid"): name_schema("txid"),
        ("EndTransaction", "token"): token,
        ("Ended", "state"): states,
        ("CheckTransaction", "check_id"): {"minimum": 0},
        ("CheckTransaction", "check_times"): {"minimum": 0},
        ("CheckedMessage", "index"): {"minimum": 0},
        ("ListTransactions", "states"): {"items": states},
        ("ListTransactions", "group"): name_schema("group"),
        ("ListTransactions", "topic"): name_schema("topic"),
        ("ListTransactions", "older_than"): {"minimum": 0},
        ("ListTransactions", "limit"): {"minimum": 1, "maximum": validation.MAX_LIST_LIMIT},
        ("ShowTransaction", "txid"): name_schema("txid"),
        **{
            (verb, field): limit
            for verb in ("ResumeTransaction", "CommitTransaction", "RollbackTransaction")
            for field, limit in (
                ("txid", name_schema("txid")),
                ("batch", {"pattern": f"^{validation.BATCH.pattern}$"}),
            )
        },
        ("TransactionInfo", "state"): states,
        ("TransactionInfo", "discard_reason"): {"enum": [r.value for r in DiscardReason]},
        ("Error", "code"): {
            "description": "Stable; one of "
            + ", ".join(c.value for c in protocol.ErrorCode)
            + " (a client treats an unknown code like `internal`)."
        },
    }


def payload_schemas() -> dict[str, Any]:
    """msgspec's JSON Schemas of every protocol Struct, with the coordinator's limits."""
    _, schemas = msgspec.json.schema_components(_STRUCTS, ref_template=_SCHEMAS + "{name}")
    for (schema, field), extra in _limits().items():
        target = schemas[schema]["properties"][field]
        if "anyOf" in target:
            _or_null(target, extra)
        else:
            for keyword, value in extra.items():
                if isinstance(value, dict) and isinstance(target.get(keyword), dict):
                    target[keyword] = {**target[keyword], **value}
                else:
                    target[keyword] = value
    return schemas


# -- headers ------------------------------------------------------------------------------


def _header(description: str, **schema: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **schema}


def _number_header(description: str) -> dict[str, Any]:
    return _header(description, pattern="^[0-9]+$")


def _content_type() -> dict[str, Any]:
    return {
        protocol.CONTENT_TYPE_HEADER: _header(
            "The payload's encoding; absent means msgpack. The reply has the request's.",
            enum=[e.value for e in protocol.Encoding],
        )
    }


def _committed_headers() -> dict[str, Any]:
    return {
        layout.MSG_ID_HEADER: _header(
            "`<txid>:<index>`: the id for idempotent consumers", pattern="^[A-Za-z0-9_-]+:[0-9]+$"
        ),
        layout.TXID_HEADER: _header("The transaction id.", **name_schema("txid")),
        layout.GROUP_HEADER: _header("The producer group.", **name_schema("group")),
        layout.INDEX_HEADER: _number_header("The message's position in its transaction, from 0."),
        layout.COMMITTED_AT_HEADER: _header(
            "Seconds since the epoch (a float) when the coordinator published it."
        ),
        layout.TAG_HEADER: _header(
            "The tag; absent when the message has none.", **name_schema("tag")
        ),
        layout.KEYS_HEADER: _header("The keys, comma separated; absent when there are none."),
    }


_USER_PROPERTIES: Final = {
    "type": "string",
    "description": "The producer's properties, delivered as headers under their own names.",
}


def header_schemas() -> dict[str, Any]:
    """The header blocks of each kind of message, from layout.py's header names."""
    committed = _committed_headers()
    origin = {
        layout.ORIGIN_STREAM_HEADER: _header("Where the original is: `TOPIC_<topic>`."),
        layout.ORIGIN_SEQ_HEADER: _number_header("The original's sequence in that stream."),
    }
    half = {
        layout.TXID_HEADER: committed[layout.TXID_HEADER],
        layout.TOKEN_HEADER: _header(
            "`sha256:<hex>` of the commit token, never the token.",
            pattern="^sha256:[0-9a-f]{64}$",
        ),
        layout.GROUP_HEADER: committed[layout.GROUP_HEADER],
        layout.PRODUCER_HEADER: _header("The producer instance id.", **name_schema("producer")),
        layout.BEGINS_HEADER: _header("`1` on the first prepare's halves.", enum=["0", "1"]),
        layout.INDEX_HEADER: committed[layout.INDEX_HEADER],
        layout.TOPIC_HEADER: _header("The message's topic.", **name_schema("topic")),
        layout.BORN_HEADER: _header("Seconds since the epoch when the half was stored."),
        layout.TAG_HEADER: committed[layout.TAG_HEADER],
        layout.KEYS_HEADER: committed[layout.KEYS_HEADER],
        layout.IMMUNITY_HEADER: _header("The message's check_immunity, when it asked for one."),
    }
    return {
        "CommandHeaders": {
            "type": "object",
            "description": "Headers of a command or a reply (all optional).",
            "properties": _content_type(),
        },
        "CommittedHeaders": {
            "type": "object",
            "description": "Set by the coordinator on every message it publishes; a message "
            "someone else published on a topic subject may have none of them.",
            "properties": committed,
            "required": [
                layout.MSG_ID_HEADER,
                layout.TXID_HEADER,
                layout.GROUP_HEADER,
                layout.INDEX_HEADER,
                layout.COMMITTED_AT_HEADER,
            ],
            "additionalProperties": _USER_PROPERTIES,
        },
        "ReplayedHeaders": {
            "type": "object",
            "description": "A dead letter published again by `txactors dlq replay`: the "
            "original's headers (no `Nats-*`, none the DLQ added) and these.",
            "properties": {
                layout.MSG_ID_HEADER: _header(
                    "`replay:<group>:<dlq seq>:<original Nats-Msg-Id>`", pattern="^replay:"
                ),
                layout.REPLAY_OF_HEADER: _header("The original's `Nats-Msg-Id`."),
                layout.REPLAY_GROUP_HEADER: _header(
                    "The one group meant to handle it; every other group acks it unhandled.",
                    **name_schema("group"),
                ),
            },
            "required": [layout.MSG_ID_HEADER, layout.REPLAY_OF_HEADER, layout.REPLAY_GROUP_HEADER],
            "additionalProperties": {"type": "string"},
        },
        "DeadLetterHeaders": {
            "type": "object",
            "description": "The original's headers (`Nats-*` left out, but for the id) and "
            "these; with `Txn-Omitted: body,headers` only these.",
            "properties": {
                layout.MSG_ID_HEADER: _header(
                    "The original's id; absent only when even that does not fit beside ours."
                ),
                layout.TOPIC_HEADER: _header("The original's topic.", **name_schema("topic")),
                **origin,
                layout.ERROR_HEADER: _header(
                    "The handler's last error, `Type: message` on one line.",
                    maxLength=1024,
                ),
                layout.DELIVERIES_HEADER: _number_header("How many times it was delivered."),
                layout.DLQ_OMITTED_HEADER: _header(
                    "Present on a dead letter stored by reference (empty body): what it lacks.",
                    enum=["body", "body,headers"],
                ),
            },
            "required": [
                layout.TOPIC_HEADER,
                layout.ORIGIN_STREAM_HEADER,
                layout.ORIGIN_SEQ_HEADER,
                layout.ERROR_HEADER,
                layout.DELIVERIES_HEADER,
            ],
            "additionalProperties": {"type": "string"},
        },
        "DiscardedHeaders": {
            "type": "object",
            "description": "A discarded half: its headers as stored in TXN_HALF, and why.",
            "properties": {
                layout.MSG_ID_HEADER: _header("`<txid>:<index>:discard`"),
                **half,
                layout.DISCARD_REASON_HEADER: _header(
                    "Why it was discarded.", enum=[r.value for r in DiscardReason]
                ),
                layout.CHECK_TIMES_HEADER: _number_header("Inconclusive check-backs made."),
            },
            "required": [
                layout.TXID_HEADER,
                layout.GROUP_HEADER,
                layout.PRODUCER_HEADER,
                layout.INDEX_HEADER,
                layout.TOPIC_HEADER,
                layout.DISCARD_REASON_HEADER,
                layout.CHECK_TIMES_HEADER,
            ],
            "additionalProperties": _USER_PROPERTIES,
        },
        "QuarantinedHeaders": {
            "type": "object",
            "description": "A record the coordinator put aside: JetStream refused it, or "
            "recovery could not read it.",
            "properties": {
                layout.QUARANTINE_REASON_HEADER: _header("Why it was put aside."),
                layout.ORIGIN_SUBJECT_HEADER: _header("The subject it was (to be) written to."),
                **origin,
                layout.BODY_DROPPED_HEADER: _number_header(
                    "Present when the body was too large to keep: its size in bytes."
                ),
            },
            "required": [layout.QUARANTINE_REASON_HEADER, layout.ORIGIN_SUBJECT_HEADER],
            "additionalProperties": {"type": "string"},
        },
    }


INTERNAL_HEADERS: Final = frozenset({layout.EXPECTED_LAST_SUBJECT_SEQ_HEADER})
"""Header names the coordinator uses only on its own streams' writes: no client sees them."""


# -- messages, channels, operations -------------------------------------------------------


def _summary(struct: type) -> str:
    """The first paragraph of the Struct's docstring, on one line."""
    first = inspect.cleandoc(struct.__doc__ or struct.__name__).split("\n\n", 1)[0]
    return " ".join(first.split())


def _command_message(struct: type) -> dict[str, Any]:
    return {
        "name": struct.__name__,
        "title": struct.__name__,
        "summary": _summary(struct),
        "headers": {"$ref": _SCHEMAS + "CommandHeaders"},
        "payload": {"$ref": _SCHEMAS + struct.__name__},
    }


def _raw_message(name: str, summary: str, headers: str) -> dict[str, Any]:
    return {
        "name": name,
        "title": name,
        "summary": summary,
        "contentType": "application/octet-stream",
        "headers": {"$ref": _SCHEMAS + headers},
        "payload": {"type": "string", "format": "binary"},
    }


def messages() -> dict[str, Any]:
    found = {s.__name__: _command_message(s) for s in _STRUCTS}
    found["CommittedMessage"] = _raw_message(
        "CommittedMessage",
        "A committed message: the body exactly as the producer sent it.",
        "CommittedHeaders",
    )
    found["ReplayedMessage"] = _raw_message(
        "ReplayedMessage",
        "A dead letter an operator published again for one group.",
        "ReplayedHeaders",
    )
    found["DeadLetter"] = _raw_message(
        "DeadLetter",
        "A message a consumer group gave up on: a copy, or a reference with an empty body.",
        "DeadLetterHeaders",
    )
    found["DiscardedHalf"] = _raw_message(
        "DiscardedHalf",
        "A half message of a transaction that was never decided.",
        "DiscardedHeaders",
    )
    found["QuarantinedRecord"] = _raw_message(
        "QuarantinedRecord",
        "A record the coordinator could not store or read.",
        "QuarantinedHeaders",
    )
    return found


_PARAMETERS: Final = {
    "partition": "The transaction's partition: crc32(utf-8 txid) mod the coordinator's "
    "partition count (1 by default).",
    "group": "A producer or consumer group name.",
    "producer": "The producer instance id sent in the transaction's Prepare.",
    "topic": "A topic name.",
    "tag": f"The message's tag, or `{layout.NO_TAG}` for a message without one.",
}


def _channel(address: str | None, description: str, *names: str) -> dict[str, Any]:
    channel: dict[str, Any] = {"address": address, "description": description}
    if address is not None:
        params = [p for p in _PARAMETERS if f"{{{p}}}" in address]
        if params:
            channel["parameters"] = {p: {"$ref": f"#/components/parameters/{p}"} for p in params}
    channel["messages"] = {n: {"$ref": f"#/components/messages/{n}"} for n in names}
    return channel


_REPLIES: Final = (
    "Prepared",
    "Ended",
    "TransactionList",
    "TransactionInfo",
    "CheckResult",
    "Error",
)


def channels() -> dict[str, Any]:
    admin = [
        "ListTransactions",
        "ShowTransaction",
        "ResumeTransaction",
        "CommitTransaction",
        "RollbackTransaction",
    ]
    return {
        "prepare": _channel(
            layout.prepare_subject(_PARTITION),
            "Store half messages (core NATS request/reply).",
            "Prepare",
        ),
        "end": _channel(
            layout.end_subject(_PARTITION),
            "Commit, roll back or leave a transaction to its check-back.",
            "EndTransaction",
        ),
        "admin": _channel(
            layout.admin_subject(_PARTITION),
            "Operators: list, show and resolve transactions without their token.",
            *admin,
        ),
        "checkInstance": _channel(
            layout.check_instance_subject("{group}", "{producer}"),
            "Check-backs for the producer instance that prepared the transaction; always msgpack.",
            "CheckTransaction",
        ),
        "checkGroup": _channel(
            layout.check_group_subject("{group}"),
            "Check-backs for any live producer of the group (a queue group named after it), "
            "when the instance does not answer; always msgpack.",
            "CheckTransaction",
        ),
        "inbox": _channel(
            None,
            "The requester's reply subject. Endpoints answer only subjects under the inbox "
            "prefix (`_INBOX.` unless the coordinator's inbox_prefix says otherwise); a "
            "request with any other reply subject is neither executed nor answered.",
            *_REPLIES,
        ),
        "topic": _channel(
            layout.topic_subject("{topic}", "{tag}"),
            f"Committed messages, in the JetStream stream `{layout.topic_stream('<topic>')}`.",
            "CommittedMessage",
            "ReplayedMessage",
        ),
        "deadLetters": _channel(
            layout.dlq_subject("{group}", "{topic}"),
            f"A consumer group's dead letters, in the stream `{layout.dlq_stream('<group>')}`.",
            "DeadLetter",
        ),
        "discarded": _channel(
            layout.discard_subject("{group}"),
            f"Discarded halves, in the stream `{layout.DISCARD_STREAM}`.",
            "DiscardedHalf",
        ),
        "quarantine": _channel(
            layout.quarantine_subject(),
            f"Records the coordinator put aside, in the stream `{layout.DISCARD_STREAM}`.",
            "QuarantinedRecord",
        ),
    }


def _ref(channel: str, message: str) -> dict[str, str]:
    return {"$ref": f"#/channels/{channel}/messages/{message}"}


def _request(channel: str, summary: str, command: str, *answers: str) -> dict[str, Any]:
    return {
        "action": "send",
        "channel": {"$ref": f"#/channels/{channel}"},
        "summary": summary,
        "messages": [_ref(channel, command)],
        "reply": {
            "channel": {"$ref": "#/channels/inbox"},
            "messages": [_ref("inbox", a) for a in (*answers, "Error")],
        },
    }


def _receive(channel: str, summary: str, *names: str, **extra: Any) -> dict[str, Any]:
    return {
        "action": "receive",
        "channel": {"$ref": f"#/channels/{channel}"},
        "summary": summary,
        "messages": [_ref(channel, n) for n in names],
        **extra,
    }


def operations() -> dict[str, Any]:
    answer_check = {
        "channel": {"$ref": "#/channels/inbox"},
        "messages": [_ref("inbox", "CheckResult"), _ref("inbox", "Error")],
    }
    return {
        "prepare": _request(
            "prepare", "A producer stores its transaction's messages.", "Prepare", "Prepared"
        ),
        "endTransaction": _request(
            "end", "A producer ends its transaction.", "EndTransaction", "Ended"
        ),
        "listTransactions": _request(
            "admin", "List open and discarded transactions.", "ListTransactions", "TransactionList"
        ),
        "showTransaction": _request(
            "admin", "Show one transaction.", "ShowTransaction", "TransactionInfo"
        ),
        "resumeTransaction": _request(
            "admin", "Back to prepared, with a fresh check count.", "ResumeTransaction", "Ended"
        ),
        "commitTransaction": _request(
            "admin", "Commit without the token.", "CommitTransaction", "Ended"
        ),
        "rollbackTransaction": _request(
            "admin", "Roll back without the token.", "RollbackTransaction", "Ended"
        ),
        "answerInstanceCheck": _receive(
            "checkInstance",
            "A producer answers a check-back about a transaction it prepared.",
            "CheckTransaction",
            reply=answer_check,
        ),
        "answerGroupCheck": _receive(
            "checkGroup",
            "Any live producer of the group answers a check-back.",
            "CheckTransaction",
            reply=answer_check,
            bindings={"nats": {"queue": "{group}", "bindingVersion": "0.1.0"}},
        ),
        "consume": _receive(
            "topic",
            "A consumer group reads a topic's committed messages (JetStream).",
            "CommittedMessage",
            "ReplayedMessage",
        ),
        "readDeadLetters": _receive(
            "deadLetters", "An operator reads a group's dead letters.", "DeadLetter"
        ),
        "readDiscarded": _receive(
            "discarded", "An operator reads discarded halves.", "DiscardedHalf"
        ),
        "readQuarantine": _receive(
            "quarantine", "An operator reads quarantined records.", "QuarantinedRecord"
        ),
    }


def document() -> dict[str, Any]:
    """The AsyncAPI document of the txactors protocol."""
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "txactors wire protocol",
            "version": version("txactors"),
            "description": (
                "Transactional messages on NATS JetStream: the commands a producer, a consumer "
                "and an operator exchange with the txactors coordinator. Generated from "
                f"txactors/protocol.py and txactors/layout.py (`{REGENERATE}`); "
                "docs/protocol.md says what the schemas cannot (encodings, id ranges, which "
                "errors are retriable)."
            ),
        },
        "defaultContentType": protocol.Encoding.MSGPACK.value,
        "servers": {
            "nats": {
                "host": "localhost:4222",
                "protocol": "nats",
                "description": "Any NATS server with JetStream (the coordinator's NATS_URL).",
            }
        },
        "channels": channels(),
        "operations": operations(),
        "components": {
            "schemas": {**payload_schemas(), **header_schemas()},
            "messages": messages(),
            "parameters": {name: {"description": text} for name, text in _PARAMETERS.items()},
        },
    }


def render() -> str:
    """The document as docs/asyncapi.json holds it."""
    return json.dumps(document(), indent=2, ensure_ascii=False) + "\n"
