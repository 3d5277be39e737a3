"""The AsyncAPI document itself: its messages, channels and operations around the schemas,
as `txactors protocol asyncapi` prints it and docs/asyncapi.json holds it."""

from __future__ import annotations

import inspect
import json
from importlib.metadata import version
from typing import Any, Final

from txactors.asyncapi.headers import header_schemas
from txactors.asyncapi.schemas import SCHEMA_REF, STRUCTS, payload_schemas
from txactors.wire import layout, protocol

ASYNCAPI_VERSION: Final = "3.0.0"
OUTPUT: Final = "docs/asyncapi.json"
REGENERATE: Final = f"txactors protocol asyncapi -o {OUTPUT}"

_PARTITION: Final[Any] = "{partition}"
"""The channel parameter, where layout's subject functions take a partition number."""


def _summary(struct: type) -> str:
    """The first paragraph of the Struct's docstring, on one line."""
    first = inspect.cleandoc(struct.__doc__ or struct.__name__).split("\n\n", 1)[0]
    return " ".join(first.split())


def _command_message(struct: type) -> dict[str, Any]:
    return {
        "name": struct.__name__,
        "title": struct.__name__,
        "summary": _summary(struct),
        "headers": {"$ref": SCHEMA_REF + "CommandHeaders"},
        "payload": {"$ref": SCHEMA_REF + struct.__name__},
    }


def _raw_message(name: str, summary: str, headers: str) -> dict[str, Any]:
    return {
        "name": name,
        "title": name,
        "summary": summary,
        "contentType": "application/octet-stream",
        "headers": {"$ref": SCHEMA_REF + headers},
        "payload": {"type": "string", "format": "binary"},
    }


def messages() -> dict[str, Any]:
    found = {s.__name__: _command_message(s) for s in STRUCTS}
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
    "partition": "The transaction's partition: crc32(utf-8 txid) mod the partition count "
    f"the coordinators publish (key `{layout.PARTITIONS_KEY}` of KV bucket "
    f"`{layout.META_BUCKET}`, read with a JetStream direct get on "
    f"`{layout.partitions_read_subject()}`; docs/protocol.md).",
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
    "PreparedBatch",
    "EndedBatch",
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
            layout.prepare_subject(_PARTITION, "{group}"),
            "Store half messages (core NATS request/reply), of one transaction or a batch of "
            "them; `{group}` is the prepare's group, or the prepare is refused `forbidden`.",
            "Prepare",
            "PrepareBatch",
        ),
        "end": _channel(
            layout.end_subject(_PARTITION, "{group}"),
            "Commit, roll back or leave a transaction (or a batch of them) to its check-back; "
            "`{group}` is the transaction's group.",
            "EndTransaction",
            "EndBatch",
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
            "prefix (`_INBOX.` unless the coordinator's inbox_prefix says otherwise); with "
            "a tenant policy (group_topics) a group's request only under its own inbox "
            "(`_INBOX.<group>.`), and no other request into a tenant's inbox; a request "
            "with any other reply subject is neither executed nor answered.",
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
        "endTransactionOneway": {
            "action": "send",
            "channel": {"$ref": "#/channels/end"},
            "summary": "A producer ends its transaction without a reply subject and goes on.",
            "description": "Carried out like an acknowledged end, never answered (errors are "
            "counted by the coordinator); the check-back settles an end that was lost.",
            "messages": [_ref("end", "EndTransaction")],
        },
        "prepareBatch": _request(
            "prepare",
            "A producer stores the messages of several transactions in one request.",
            "PrepareBatch",
            "PreparedBatch",
        ),
        "endBatch": _request(
            "end", "A producer ends several transactions in one request.", "EndBatch", "EndedBatch"
        ),
        "endBatchOneway": {
            "action": "send",
            "channel": {"$ref": "#/channels/end"},
            "summary": "A producer ends several transactions without a reply subject.",
            "description": "Each item is carried out like a one-way end, never answered.",
            "messages": [_ref("end", "EndBatch")],
        },
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
            "x-protocol-version": protocol.PROTOCOL_VERSION,
            "description": (
                "Transactional messages on NATS JetStream: the commands a producer, a consumer "
                "and an operator exchange with the txactors coordinator. Generated from "
                f"txactors/wire/protocol.py and txactors/wire/layout.py (`{REGENERATE}`); "
                "docs/protocol.md says what the schemas cannot (encodings, id ranges, which "
                "errors are retriable). The protocol version (the `version` field of every "
                f"command) is {protocol.PROTOCOL_VERSION}."
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
