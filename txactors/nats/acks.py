"""A JetStream message's stream, sequence, deliveries and pending count, read cheaply.

nats-py's `Msg.metadata` parses the ack subject into a frozen dataclass and a timezone-aware
`datetime` nobody here reads: about 40,000 instructions a message, as much as a consumer's
whole handling and more than the late-halves follower's own loop. Splitting the ack subject
once gives the same numbers; nats-py's parser stays the fallback for the domain form.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from nats.aio.msg import Msg

_ACK_TOKENS: Final = 9
"""`$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ns>.<pending>`."""


class AckFields(NamedTuple):
    stream: str
    seq: int
    """The message's stream sequence."""
    deliveries: int
    pending: int
    """Messages the consumer still has behind this one."""


def ack_fields(msg: Msg) -> AckFields:
    """What `msg.metadata` says of `msg`'s stream, sequence, deliveries and pending count."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == _ACK_TOKENS and tokens[0] == "$JS" and tokens[1] == "ACK":
        return AckFields(tokens[2], int(tokens[5]), int(tokens[4]), int(tokens[8]))
    meta = msg.metadata
    return AckFields(meta.stream, meta.sequence.stream, meta.num_delivered, meta.num_pending or 0)
