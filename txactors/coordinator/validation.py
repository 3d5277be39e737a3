"""What makes a prepare acceptable, checked before anything is written (pure)."""

from __future__ import annotations

from txactors import layout
from txactors.protocol import Prepare

HEADER_ALLOWANCE = 1024
"""Bytes kept free for our headers when checking a half against the server's max payload."""


def prepare_problem(prepare: Prepare, *, max_payload: int, max_messages: int) -> str | None:
    """Why `prepare` is a bad request (None: it is fine).

    Names become subject tokens and stream names, keys are joined with commas in a header,
    properties travel as headers and may not impersonate ours, and each half must fit in one
    NATS message together with the headers the coordinator adds.
    """
    if not prepare.messages:
        return "a prepare needs at least one message"
    if len(prepare.messages) > max_messages:
        return f"at most {max_messages} messages per prepare"
    limit = max_payload - HEADER_ALLOWANCE
    try:
        layout.validate_name("txid", prepare.txid)
        layout.validate_name("group", prepare.group)
        layout.validate_name("producer", prepare.producer)
        for message in prepare.messages:
            layout.validate_name("topic", message.topic)
            if message.tag is not None:
                layout.validate_name("tag", message.tag)
            if any("," in key for key in message.keys):
                return "message keys may not contain ','"
            for name in message.properties:
                if name.startswith(layout.RESERVED_HEADER_PREFIXES) or not name.isprintable():
                    return f"property {name!r} is reserved or not a valid header name"
            size = len(message.body) + sum(map(len, message.properties.values()))
            if size > limit:
                return f"message to {message.topic!r} is {size} bytes; the limit is {limit}"
    except ValueError as error:
        return str(error)
    return None
