"""A Hypothesis state machine over the interleavings of local transactions and check-backs
on SQLite: whatever the order, no check-back answer ever contradicts the local outcome.

The local transaction runs on the service's own connection with a deferred BEGIN (the
bare API: `record` inside a transaction the service manages), so a check can come before
it writes anything, between its business write and its record, after its record (then it
waits for SQLite's write lock and, here with a short busy timeout, answers UNKNOWN), after
its commit or its rollback. Checks come from two other instances of the group.
"""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiosqlite
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from txactors.errors import RolledBackByCheck
from txactors.producer import CheckView, Decision
from txactors.producer.txlog.sqlite import SqliteTxLog

T = TypeVar("T")
GROUP = "shop"


class Interleavings(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.directory = tempfile.TemporaryDirectory()
        self.path = Path(self.directory.name) / "service.db"
        self.instances = [self.run(self._open_instance()) for _ in range(2)]
        self.conn = self.run(aiosqlite.connect(self.path, isolation_level=None, timeout=0.05))
        self.run(self.conn.execute("PRAGMA synchronous=FULL"))
        self.txids: list[str] = []
        self.answers: dict[str, list[Decision]] = {}
        self.outcome: dict[str, Decision] = {}
        self.current: str | None = None
        self.recorded = self.wrote = self.fenced = False

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    async def _open_instance(self) -> SqliteTxLog:
        txlog = SqliteTxLog(self.path, GROUP, busy_timeout=0.05)
        await txlog.__aenter__()
        await txlog.create_table()
        await txlog.connection.execute(
            "CREATE TABLE IF NOT EXISTS business (txid TEXT PRIMARY KEY)"
        )
        return txlog

    # -- the local transaction ------------------------------------------------------------

    @precondition(lambda self: self.current is None)
    @rule()
    def begin(self) -> None:
        self.current = uuid.uuid4().hex
        self.txids.append(self.current)
        self.answers[self.current] = []
        self.recorded = self.wrote = self.fenced = False
        self.run(self.conn.execute("BEGIN"))

    @precondition(lambda self: self.current is not None and not self.recorded and not self.fenced)
    @rule()
    def record(self) -> None:
        assert self.current is not None
        try:
            self.run(self.instances[0].record(self.conn, self.current))
        except RolledBackByCheck:
            self.fenced = True  # the caller must roll back now
        else:
            self.recorded = True

    @precondition(lambda self: self.current is not None and not self.wrote and not self.fenced)
    @rule()
    def write(self) -> None:
        self.run(self.conn.execute("INSERT INTO business (txid) VALUES (?)", (self.current,)))
        self.wrote = True

    @precondition(lambda self: self.current is not None and self.recorded and self.wrote)
    @rule()
    def commit(self) -> None:
        self.run(self.conn.commit())
        self._ended(Decision.COMMIT)

    @precondition(lambda self: self.current is not None)
    @rule()
    def rollback(self) -> None:
        self.run(self.conn.rollback())
        self._ended(Decision.ROLLBACK)

    def _ended(self, outcome: Decision) -> None:
        assert self.current is not None
        self.outcome[self.current] = outcome
        self.current = None

    # -- check-backs ----------------------------------------------------------------------

    @precondition(lambda self: bool(self.txids))
    @rule(data=st.data(), instance=st.integers(0, 1))
    def check(self, data: st.DataObject, instance: int) -> None:
        txid = data.draw(st.sampled_from(self.txids), label="txid")
        view = CheckView(txid=txid, group=GROUP, check_times=0, messages=())
        self.answers[txid].append(self.run(self.instances[instance].check(view)))

    @invariant()
    def no_answer_contradicts_the_local_outcome(self) -> None:
        for txid, answers in self.answers.items():
            decisive = {a for a in answers if a is not Decision.UNKNOWN}
            assert len(decisive) <= 1, f"{txid} was answered {answers}"
            if txid in self.outcome:
                assert decisive <= {self.outcome[txid]}, (txid, answers, self.outcome[txid])

    def teardown(self) -> None:
        try:
            if self.current is not None:
                self.rollback()
            with sqlite3.connect(self.path) as conn:
                committed = {row[0] for row in conn.execute("SELECT txid FROM business")}
            for txid in self.txids:
                view = CheckView(txid=txid, group=GROUP, check_times=0, messages=())
                final = self.run(self.instances[1].check(view))
                assert final is self.outcome[txid]  # nothing holds a lock now: decisive
                assert (txid in committed) is (final is Decision.COMMIT)
            self.no_answer_contradicts_the_local_outcome()
        finally:
            self.run(self.conn.close())
            for txlog in self.instances:
                self.run(txlog.__aexit__(None, None, None))
            self.loop.close()
            self.directory.cleanup()


Interleavings.TestCase.settings = settings(max_examples=40, stateful_step_count=20, deadline=None)
test_interleavings = pytest.mark.timeout(600)(Interleavings.TestCase)
