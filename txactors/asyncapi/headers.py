"""The header schemas of the AsyncAPI document: each kind of message's header block, from
the header names in `layout.py`."""

from __future__ import annotations

from typing import Any, Final

from txactors.asyncapi.schemas import name_schema
from txactors.coordinator.core.records import DiscardReason
from txactors.coordinator.partition.packs import PACK_VERSION
from txactors.wire import layout, protocol


def _header(description: str, **schema: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **schema}


def _number_header(description: str) -> dict[str, Any]:
    return _header(description, pattern="^[0-9]+$")


def _content_type() -> dict[str, Any]:
    return {
        layout.CONTENT_TYPE_HEADER: _header(
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
            "Seconds since the epoch (a float, to the millisecond) when the coordinator "
            "published it."
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
            "The first 16 bytes of the commit token's SHA-256, base64url without padding; never "
            "the token. A half stored by an earlier 0.x has `sha256:<hex>` instead.",
            pattern="^([A-Za-z0-9_-]{22}|sha256:[0-9a-f]{64})$",
        ),
        layout.GROUP_HEADER: committed[layout.GROUP_HEADER],
        layout.PRODUCER_HEADER: _header("The producer instance id.", **name_schema("producer")),
        layout.BEGINS_HEADER: _header(
            "`1` on the first prepare's halves, absent on a later prepare's (`0` on a half "
            "stored by an earlier 0.x).",
            enum=["0", "1"],
        ),
        layout.INDEX_HEADER: committed[layout.INDEX_HEADER],
        layout.TOPIC_HEADER: _header("The message's topic.", **name_schema("topic")),
        layout.BORN_HEADER: _header(
            "Seconds since the epoch when the half was stored (to the millisecond)."
        ),
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
            "someone else published on a topic subject may have none of them. A message the "
            "coordinator wrote in an atomic batch is also stored with the server's "
            "`Nats-Batch-Id`, `Nats-Batch-Sequence` (and `Nats-Batch-Commit` on the last): "
            "ignore them; a txactors consumer's handler never sees any `Nats-*` header.",
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
            "original's headers (none of the server's `Nats-*`, none the DLQ added) and these.",
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
            "description": "The original's headers (the server's `Nats-*` left out; the id is "
            "the original's) and these; with `Txn-Omitted: body,headers` only these.",
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
            "description": "A discarded half, one message per half: its headers as stored in "
            "its partition's log, TXN_LOG_<p> (for a half stored in a pack, those it would "
            "have had stored alone) but "
            "the server's `Nats-*` (an atomic batch's included), its txid and index (which the "
            "half names only in its `Nats-Msg-Id`, `<txid>:<index>:half`), and why.",
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
            "recovery could not read it. Its own headers but the server's `Nats-*`, and these.",
            "properties": {
                layout.QUARANTINE_REASON_HEADER: _header("Why it was put aside."),
                layout.ORIGIN_SUBJECT_HEADER: _header("The subject it was (to be) written to."),
                **origin,
                layout.BODY_DROPPED_HEADER: _number_header(
                    "Present when the body was too large to keep: its size in bytes."
                ),
                layout.PACK_HEADER: _header(
                    "Present on a pack of halves (TXN_LOG_<p>, docs/protocol.md): the pack "
                    "format's version; the body is the pack.",
                    enum=[PACK_VERSION],
                ),
            },
            "required": [layout.QUARANTINE_REASON_HEADER, layout.ORIGIN_SUBJECT_HEADER],
            "additionalProperties": {"type": "string"},
        },
    }


INTERNAL_HEADERS: Final = frozenset({layout.EXPECTED_LAST_SUBJECT_SEQ_HEADER})
"""Header names the coordinator uses only on its own streams' writes: no client sees them."""
