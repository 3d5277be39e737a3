"""A bounded memory of finished transactions, for idempotent repeated `end`s.

A committed or rolled-back transaction leaves the open table at once (memory must not grow
with history); its outcome and token stay here, least recently finished evicted first, so a
producer that retries its `end` after a lost reply is still told the truth. Past the bound
the retry gets `not_found`, as it would after the records aged out of the streams.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from txactors.coordinator.core.states import TxnState


class Outcome(NamedTuple):
    state: TxnState
    token: str


class RecentOutcomes:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._outcomes: OrderedDict[str, Outcome] = OrderedDict()

    def __len__(self) -> int:
        return len(self._outcomes)

    def __contains__(self, txid: object) -> bool:
        return txid in self._outcomes

    def get(self, txid: str) -> Outcome | None:
        return self._outcomes.get(txid)

    def remember(self, txid: str, outcome: Outcome) -> None:
        self._outcomes[txid] = outcome
        self._outcomes.move_to_end(txid)
        while len(self._outcomes) > self._capacity:
            self._outcomes.popitem(last=False)
