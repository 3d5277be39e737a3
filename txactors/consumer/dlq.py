"""The dead-letter queue: where a consumer group puts messages it gave up on.

One stream per group (`DLQ_<group>`, subjects `dlq.<group>.<topic>`), like RocketMQ's
`%DLQ%<group>` topic. A dead letter keeps the original body and headers, so an operator can
read it, fix the cause and publish it again, and adds why and after how many attempts it
failed. It keeps `Nats-Msg-Id` too: if the consumer dies between dead-lettering and acking,
the second copy is dropped by the stream's duplicate window.
"""

from __future__ import annotations

from nats.js import JetStreamContext

from txactors.consumer.message import ConsumedMessage
from txactors.layout import (
    DELIVERIES_HEADER,
    ERROR_HEADER,
    MSG_ID_HEADER,
    TOPIC_HEADER,
    dlq_filter,
    dlq_stream,
    dlq_subject,
    validate_name,
)
from txactors.topics import ensure_stream

MAX_ERROR_CHARS = 1024
"""Headers travel in every copy of the message; a long traceback belongs in the logs."""


async def ensure_dlq_stream(js: JetStreamContext, group: str) -> str:
    """Declare `DLQ_<group>` on `dlq.<group>.>` (file storage); returns the stream name."""
    name = dlq_stream(validate_name("group", group))
    await ensure_stream(js, name, [dlq_filter(group)])
    return name


def describe_error(error: BaseException) -> str:
    """`Type: message` on one line (a NATS header value may not contain CR or LF)."""
    text = f"{type(error).__name__}: {error}"
    return " ".join(text.split())[:MAX_ERROR_CHARS]


async def dead_letter(
    js: JetStreamContext, group: str, message: ConsumedMessage, error: BaseException
) -> int:
    """Store `message` in the group's DLQ with the last error; returns its DLQ sequence."""
    headers = {
        **message.headers,
        MSG_ID_HEADER: message.msg_id,
        TOPIC_HEADER: message.topic,
        ERROR_HEADER: describe_error(error),
        DELIVERIES_HEADER: str(message.deliveries),
    }
    ack = await js.publish(dlq_subject(group, message.topic), message.body, headers=headers)
    return ack.seq
