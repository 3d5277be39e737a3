"""How many bytes an item's answer in a batch reply takes at its longest: the one rule by which
the coordinator accepts a batch (`answerable_items` in coordinator/boundary.py) and the
producer cuts its requests (`answer_size` in producer/verbs.py).

An item is answered with an `Error` (its message cut by `item_error`), a `Prepared` with one
stream sequence per message, or an `Ended` whose state is at most `MAX_STATE_LENGTH` long;
each is counted in the longer of the two encodings. Pure, no I/O.
"""

from __future__ import annotations

from typing import Final

from txactors.wire import layout
from txactors.wire.protocol import (
    Encoding,
    Ended,
    EndedBatch,
    EndItem,
    Error,
    ErrorCode,
    Prepared,
    PreparedBatch,
    PrepareItem,
    encode,
)

MAX_ITEM_ERROR_CHARS: Final = 300
"""An item's `Error.message` in a batch answer is cut to this many characters (`item_error`),
so that the size of the answer is known before any item is carried out."""
MAX_STATE_LENGTH: Final = 32
"""`Ended.state` is at most this long: the coordinator's state names (TxnState, Gone) fit it,
as tests/unit/test_batch_answers.py checks; wire cannot name them itself."""


def _longest(value: object) -> int:
    """Encoded bytes of `value` in the longer of the two encodings."""
    return max(len(encode(value, encoding)) for encoding in Encoding)


_WORST_TXID: Final = "x" * layout.NAME_MAX_LENGTH["txid"]
_WORST_RETRY: Final = -2.2250738585072014e-308
"""The longest float in JSON (`repr` of the smallest negative normal)."""
_ARRAY_HEADER: Final = 4
"""Bytes an array header may grow by (msgpack's `array 32` against the empty array's 1)."""
_WORST_ERROR: Final = _longest(
    Error(
        max(ErrorCode, key=len),
        "\x00" * MAX_ITEM_ERROR_CHARS,  # a control character: 6 bytes in JSON (\u0000)
        _WORST_RETRY,
    )
)
_WORST_ENDED: Final = _longest(Ended(txid=_WORST_TXID, state="x" * MAX_STATE_LENGTH))
_PREPARED_BASE: Final = (
    _longest(Prepared(txid=_WORST_TXID, token="0" * 32, seqs=[])) + _ARRAY_HEADER
)
_SEQ_BYTES: Final = _longest(2**64 - 1) + 1
"""One stream sequence of `Prepared.seqs` at its longest, and its separator."""

BATCH_ANSWER_BASE: Final = (
    max(_longest(PreparedBatch(results=[])), _longest(EndedBatch(results=[]))) + _ARRAY_HEADER
)
"""A `PreparedBatch` or `EndedBatch` without its results, at its longest."""


def item_answer_bytes(item: PrepareItem | EndItem, max_messages: int | None = None) -> int:
    """The bytes of `item`'s answer in a batch reply at its longest, with its separator: an
    `Error`, an `Ended`, or a `Prepared` with one sequence per message (at most
    `max_messages`: an item with more is answered with an error)."""
    if isinstance(item, EndItem):
        return max(_WORST_ERROR, _WORST_ENDED) + 1
    messages = len(item.messages)
    if max_messages is not None:
        messages = min(messages, max_messages)
    return max(_WORST_ERROR, _PREPARED_BASE + _SEQ_BYTES * messages) + 1


def item_error(error: Error) -> Error:
    """`error` as an item of a batch answer carries it: its message at most
    MAX_ITEM_ERROR_CHARS long (what the sizes above count on)."""
    if len(error.message) <= MAX_ITEM_ERROR_CHARS:
        return error
    cut = f"{error.message[: MAX_ITEM_ERROR_CHARS - 3]}..."
    return Error(error.code, cut, error.retry_after)
