"""The dead-letter queue: where a consumer group puts messages it gave up on.

One stream per group (`DLQ_<group>`, subjects `dlq.<group>.<topic>`), like RocketMQ's
`%DLQ%<group>` topic. A dead letter keeps the original body and headers, so an operator can
read it, fix the cause and publish it again, and adds why and after how many attempts it
failed and where the original is (topic stream and sequence). It keeps `Nats-Msg-Id` too: if
the consumer dies between dead-lettering and acking, the second copy is dropped by the
stream's duplicate window.

A copy must fit where the original did, but it is larger (our headers), and NATS closes the
connection of a client that publishes more than `max_payload`. So a message whose copy would
not fit is dead-lettered *by reference*: the same headers without the body (`Txn-Omitted:
body`), and if even those do not fit, only ours (`Txn-Omitted: body,headers`); the original
stays readable at its stream sequence for as long as the topic stream keeps it.

Of the original's `Nats-*` headers only the id survives, and it is ours (`copies.copied_headers`
drops the rest): anyone may publish to a topic subject, and a copied `Nats-Expected-*`,
`Nats-Rollup`, `Nats-TTL` or an atomic batch's `Nats-Batch-*` would make JetStream refuse the
copy for good (a consumer stuck retrying it) or act on the DLQ stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext

from txactors.consumer.message import ConsumedMessage
from txactors.wire.copies import copied_headers
from txactors.wire.framing import JETSTREAM_MAX_HEADER_BYTES, header_block_bytes
from txactors.wire.layout import (
    DELIVERIES_HEADER,
    DLQ_OMITTED_HEADER,
    ERROR_HEADER,
    MSG_ID_HEADER,
    ORIGIN_SEQ_HEADER,
    ORIGIN_STREAM_HEADER,
    TOPIC_HEADER,
    dlq_subject,
    topic_stream,
)

MAX_ERROR_CHARS = 1024
"""Headers travel in every copy of the message; a long traceback belongs in the logs."""


def describe_error(error: BaseException) -> str:
    """`Type: message` on one line (a NATS header value may not contain CR or LF)."""
    text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())[:MAX_ERROR_CHARS]


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """What goes to the DLQ for one message: a full copy, or a reference without the body."""

    body: bytes
    headers: dict[str, str]
    omitted: tuple[str, ...]
    """What was left out: () for a full copy, ("body",) or ("body", "headers")."""


def dead_letter_entry(
    message: ConsumedMessage, error: BaseException, max_payload: int
) -> DeadLetter:
    """The DLQ entry for `message`: the fullest form whose headers and body fit the server's
    `max_payload` (and JetStream's header limit)."""
    ours = {
        TOPIC_HEADER: message.topic,
        ORIGIN_STREAM_HEADER: topic_stream(message.topic),
        ORIGIN_SEQ_HEADER: str(message.stream_seq),
        ERROR_HEADER: describe_error(error),
        DELIVERIES_HEADER: str(message.deliveries),
    }
    original = copied_headers(message.headers)
    with_id = {**original, MSG_ID_HEADER: message.msg_id, **ours}
    references = {**ours, DLQ_OMITTED_HEADER: "body,headers"}
    candidates = [
        DeadLetter(message.body, with_id, ()),
        DeadLetter(b"", {**with_id, DLQ_OMITTED_HEADER: "body"}, ("body",)),
        DeadLetter(b"", {MSG_ID_HEADER: message.msg_id, **references}, ("body", "headers")),
        # Only a foreign publisher's enormous Nats-Msg-Id gets here; the stream's duplicate
        # window then cannot catch a second copy.
        DeadLetter(b"", references, ("body", "headers")),
    ]
    for entry in candidates:
        block = header_block_bytes(entry.headers)
        if block <= JETSTREAM_MAX_HEADER_BYTES and block + len(entry.body) <= max_payload:
            return entry
    return candidates[-1]


async def dead_letter(
    js: JetStreamContext,
    group: str,
    message: ConsumedMessage,
    error: BaseException,
    *,
    max_payload: int,
) -> tuple[int, DeadLetter]:
    """Store `message` in the group's DLQ with the last error, as a copy or by reference
    (see `dead_letter_entry`); returns its DLQ sequence and what was stored."""
    entry = dead_letter_entry(message, error, max_payload)
    ack = await js.publish(dlq_subject(group, message.topic), entry.body, headers=entry.headers)
    return ack.seq, entry
