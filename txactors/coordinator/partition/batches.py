"""Batches (`PrepareBatch`, `EndBatch`): many transactions in one request, one answer.

The partition splits a batch that passed the boundary into one `Request` per item, each then
checked and carried out exactly as a lone prepare or end. The reply sink of item i fills
slot i of a `BatchAnswer`; once every slot is settled, the batch's own request is answered
once with all of them (`PreparedBatch`, `EndedBatch`), through the same reply handle as any
answer. An item's error message is cut as the boundary counted on (`item_error` in
wire/answers.py), so the answer fits in `max_payload`. A batch without a reply subject
(one-way ends) has no answer: each item is a one-way request of its own, its error counted
and logged (oneway.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from txactors.actors import Request
from txactors.actors.remote import error_reply
from txactors.coordinator.partition.oneway import OneWayErrors
from txactors.wire.answers import item_error
from txactors.wire.protocol import Error

Results = Callable[[list[Any]], Any]
"""Makes the batch's answer from its items' answers, in item order."""


class BatchAnswer:
    """The answers of one batch's items, sent as one once the last is in."""

    __slots__ = ("_left", "_request", "_results", "_wrap")

    def __init__(self, request: Request, size: int, wrap: Results) -> None:
        self._request = request
        self._results: list[Any] = [None] * size
        self._left = size
        self._wrap = wrap

    async def settle(self, index: int, value: Any) -> None:
        """Slot `index` is answered (each item's `Request` settles it once)."""
        if self.fill(index, value):
            await self.send()

    def fill(self, index: int, value: Any) -> bool:
        """`settle` without sending: True once every slot is filled (then `send`)."""
        self._results[index] = item_error(value) if isinstance(value, Error) else value
        self._left -= 1
        return self._left == 0

    async def send(self) -> None:
        await self._request.answer(self._wrap(self._results))


class ItemSlot:
    """The reply sink of one item: fills its slot of the batch's answer."""

    __slots__ = ("_answer", "_index")

    def __init__(self, answer: BatchAnswer, index: int) -> None:
        self._answer = answer
        self._index = index

    async def resolve(self, value: Any) -> None:
        await self._answer.settle(self._index, value)

    async def fail(self, error: BaseException) -> None:
        await self._answer.settle(self._index, error_reply(error))

    def fill(self, value: Any) -> BatchAnswer | None:
        """`resolve` without a coroutine (two items a transaction, each answered once): the
        batch, to `send`, when this was its last slot."""
        answer = self._answer
        return answer if answer.fill(self._index, value) else None


def item_requests(
    request: Request, commands: Sequence[Any], wrap: Results, one_way: OneWayErrors
) -> list[Request]:
    """One request per item of the batch `request` carries (`commands`: what each item
    stands for); answered together through `wrap`, or each one-way if the batch is."""
    if request.reply is None:  # one-way (oneway.py wrapped it): so is each item
        return [one_way.wrap(Request(command, None, request.subject)) for command in commands]
    answer = BatchAnswer(request, len(commands), wrap)
    return [
        Request(command, ItemSlot(answer, index), request.subject)
        for index, command in enumerate(commands)
    ]
