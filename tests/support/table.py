"""Tools for the pure coordinator table tests: all of its state, and a move that goes astray."""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
from collections.abc import Iterator
from typing import Any

from txactors.coordinator.core.deadlines import Deadlines
from txactors.coordinator.core.recent import RecentOutcomes
from txactors.coordinator.core.states import Where
from txactors.coordinator.core.table import ROWS, Move, Row, TransactionTable


def everything(table: TransactionTable) -> dict[str, object]:
    """Every attribute of the table, down to each transaction's fields, as comparable
    values; only the random generator is left out (random draws are not given back)."""

    def comparable(value: object) -> object:
        if isinstance(value, Deadlines):
            return {key: when for key, (when, _) in value._live.items()}
        if isinstance(value, RecentOutcomes):
            return list(value._outcomes.items())
        if isinstance(value, itertools.count):
            return repr(value)
        return copy.deepcopy(value)

    return {
        name: comparable(value)
        for name, value in vars(table).items()
        if not isinstance(value, random.Random)
    }


@contextlib.contextmanager
def astray(victim: str, target: Where) -> Iterator[None]:
    """Meanwhile every row whose `to` does not list `target` does its work on `victim` as
    usual, then moves it to `target` all the same: a bug in a move, as the table meets it."""
    rows = dict(ROWS)
    for (where, kind), row in rows.items():
        if target != where and target not in row.to:
            ROWS[where, kind] = Row(_astray(row.move, victim, target), row.to)
    try:
        yield
    finally:
        ROWS.update(rows)


def _astray(move: Move, victim: str, target: Where) -> Move:
    def move_astray(table: Any, txn: Any, event: Any, now: float) -> Where | None:
        moved = move(table, txn, event, now)
        txid = event.txid if txn is None else txn.txid
        return target if txid == victim else moved

    return move_astray
