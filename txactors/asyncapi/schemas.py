"""The payload schemas of the AsyncAPI document: msgspec's JSON Schemas of the protocol's
Structs, with the limits the coordinator enforces (`coordinator/boundary.py`) added as
patterns, lengths and ranges."""

from __future__ import annotations

from typing import Any, Final

import msgspec

from txactors.coordinator import boundary as validation
from txactors.coordinator.core import tokens
from txactors.coordinator.core.records import DiscardReason
from txactors.coordinator.core.states import TxnState
from txactors.coordinator.options import CoordinatorOptions
from txactors.wire import layout, protocol
from txactors.wire.rules import CoordinatorConfig

NAME_PATTERN: Final = "^[A-Za-z0-9_-]+$"
"""`layout.name_problem`'s grammar (tests/integration/test_asyncapi.py checks that they agree)."""

KEY_PATTERN: Final = r"^[^\s,]([^,]*[^\s,])?$"
"""A key: no ',', no blank at either end (control characters are refused too)."""
VALUE_PATTERN: Final = r"^(\S(.*\S)?)?$"
"""A property value: may be empty, no blank at either end, no line break."""

SCHEMA_REF: Final = "#/components/schemas/"
"""Where the document keeps its schemas: a `$ref` is this and the schema's name."""
STRUCTS: Final = (
    protocol.Prepare,
    protocol.Prepared,
    protocol.EndTransaction,
    protocol.Ended,
    protocol.PrepareBatch,
    protocol.PreparedBatch,
    protocol.EndBatch,
    protocol.EndedBatch,
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
    """What coordinator/boundary.py refuses, as JSON Schema keywords per (schema, property)."""
    token = {"pattern": f"^{tokens.TOKEN_PATTERN.pattern}$", "minLength": 32, "maxLength": 32}
    text = {"description": validation.TEXT_GRAMMAR}
    states = {"enum": [s.value for s in TxnState]}
    options, config = CoordinatorOptions(), CoordinatorConfig()
    messages = {
        "minItems": 1,
        "description": "At most the coordinator's max_messages_per_prepare "
        f"({options.max_messages_per_prepare} by default).",
    }
    batch_items = {
        "minItems": 1,
        "description": "At most the coordinator's max_batch_items "
        f"({options.max_batch_items} by default), and no more than the server's max_payload "
        "can answer (docs/protocol.md#batches). Each item is checked and carried out as the "
        "lone command it stands for, and refused alone.",
    }
    return {
        ("Prepare", "txid"): name_schema("txid"),
        ("Prepare", "group"): name_schema("group"),
        ("Prepare", "producer"): name_schema("producer"),
        ("Prepare", "token"): token,
        ("Prepare", "messages"): messages,
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
        ("PrepareBatch", "group"): name_schema("group"),
        ("PrepareBatch", "producer"): name_schema("producer"),
        ("PrepareBatch", "items"): batch_items,
        ("PrepareItem", "txid"): name_schema("txid"),
        ("PrepareItem", "token"): token,
        ("PrepareItem", "messages"): messages,
        ("EndBatch", "items"): batch_items,
        ("EndItem", "txid"): name_schema("txid"),
        ("EndItem", "token"): token,
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
        **{
            (command.__name__, "version"): {
                "minimum": protocol.OLDEST_VERSION,
                "maximum": protocol.PROTOCOL_VERSION,
                "description": "The protocol version the client speaks. Without it (version "
                "1, removed in 0.x), or another one, the command is refused with "
                "`unsupported_version`.",
            }
            for command in STRUCTS
            if issubclass(command, protocol.Command)
        },
        **{
            (batch.__name__, "version"): {
                "minimum": protocol.BATCH_VERSION,
                "maximum": protocol.PROTOCOL_VERSION,
                "description": f"At least {protocol.BATCH_VERSION}, the version that brought "
                "the batch verbs (below it: `bad_request`; absent, 1 or newer than the "
                "coordinator: `unsupported_version`).",
            }
            for batch in (protocol.PrepareBatch, protocol.EndBatch)
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
    _, schemas = msgspec.json.schema_components(STRUCTS, ref_template=SCHEMA_REF + "{name}")
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
