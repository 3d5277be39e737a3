"""`TxLog`: the transaction log in the producer's own database, and the one-call send.

A backend (one module per database driver) knows the SQL; this class holds what every
backend shares: the check-back (`check`, see `decide`), retention (`prune`) and the
one-call form (`send_in_transaction`), which is the only order of steps in which a crash
or a cancellation at any point still ends with the message delivered if and only if the
business change committed:

1. send the prepare of the halves, without waiting for its reply;
2. meanwhile, open the local database transaction and record the txid first: a check-back
   that claimed it already makes this fail before the work runs, and a check-back that
   comes later waits on the row (or fails on it) instead of claiming it;
3. run the user's work on the same connection;
4. wait for the prepare: the halves are stored before the local commit, or (a failure)
   the local transaction rolls back and nothing is committed;
5. commit the local transaction (shielded: its outcome is then known);
6. end the transaction with COMMIT.

A lone call thus waits for the prepare's round trip only where it is longer than the local
work. A backend whose local transactions take turns on one writer (SQLite: `serial_local`)
awaits the prepare before step 2 instead: holding the writer through a slow prepare would
stall every other call. So does any call that finds its pool with no free connection
(`pool_exhausted`): then connections are the bound, and one held while the halves travel is
one another call waits for (measured: the outbox job at 64 in flight on 48 connections).
Until the end, a check-back that reaches this process is answered UNKNOWN (the transaction is
in flight), except the last one, which would discard it: that one claims it, ROLLBACK, while
the local commit has not begun (step 5 is then refused with `RolledBackByCheck`), and asks the
log once it has (`inflight.LocalCommit`). One served by another instance of the group decides
from the log, where the row is already recorded or not at all (`decide`): the order above
holds for it.
An exception before the commit rolls the local transaction back and the messages with it.
A commit that raises has an unknown outcome: the log is asked at once (`settle`, the
check-back's own decision), so the end says what really happened. A cancellation, or a
crash, ends nothing: the coordinator's check-back asks the group, and the log answers.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import ClassVar, Generic, NoReturn, Protocol, TypeVar

import anyio

from txactors.errors import ConfigError, RolledBackByCheck
from txactors.faults import FaultPoint, crash_if_armed
from txactors.observe.logs import get_logger
from txactors.producer.checks import CheckView
from txactors.producer.message import TxMessage
from txactors.producer.producer import TransactionProducer
from txactors.producer.transaction import TransactionResult
from txactors.producer.txlog.decide import LogUnavailable, settle
from txactors.producer.txlog.retention import CLOCK_MARGIN, retention_age
from txactors.wire.layout import validate_name
from txactors.wire.protocol import Decision
from txactors.wire.rules import CoordinatorConfig

C = TypeVar("C")
C_co = TypeVar("C_co", covariant=True)

log = get_logger(__name__)

PRUNE_BATCH = 1000
"""Rows removed per statement: short transactions that never hold the table for long."""


class OpenLocal(Protocol[C_co]):
    """A local database transaction that `TxLog.local()` opened: its connection, and its
    commit. Left without a commit, it is rolled back."""

    @property
    def connection(self) -> C_co: ...

    async def commit(self) -> None: ...


Work = Callable[[C, str], Awaitable[object]]
"""The business change: `work(connection, txid)`, inside the local transaction (the txid
to keep beside the change, if you like). It must not commit or roll back: the one-call
form does."""


class TxLog(ABC, Generic[C]):
    """The transaction log of producer group `group` in one database."""

    serial_local: ClassVar[bool] = False
    """Local transactions take turns (one connection, one writer): `send_in_transaction`
    then awaits the prepare before its local transaction starts, so a slow prepare holds up
    only its own call, not every other waiting for the writer."""

    def __init__(self, group: str) -> None:
        self.group = validate_name("group", group)

    def pool_exhausted(self) -> bool:
        """Whether a local transaction started now would wait for a connection: then
        `send_in_transaction` awaits the prepare before taking one, holding it only for the
        local work. False where the backend cannot tell (the prepare then overlaps)."""
        return False

    @abstractmethod
    async def create_table(self) -> None:
        """Create the log table and its index if they are missing (docs/operations.md has
        the same DDL as a migration)."""

    @abstractmethod
    async def record(self, conn: C, txid: str) -> None:
        """Record `txid` as committed, on `conn`, inside the caller's open local transaction:
        it commits or rolls back with the business change, and its commit is durable (on
        PostgreSQL this statement sets `synchronous_commit = on` for the transaction). Raises
        `RolledBackByCheck` when a check-back claimed the txid first; the transaction must
        then roll back."""

    @abstractmethod
    def local(self) -> AbstractAsyncContextManager[OpenLocal[C]]:
        """Open a local transaction on a connection of this database (`record` in it makes
        its commit durable)."""

    @abstractmethod
    async def create_applied_table(self) -> None:
        """Create the table of inputs chained handlers applied (`schema.APPLIED_TABLE`) if it
        is missing: a consumer that sends (`txactors.app.chain`) keeps its apply records
        here, so that one local transaction holds them, the log row and the handler's
        change."""

    @abstractmethod
    async def mark_applied(self, conn: C, consumer_group: str, msg_id: str) -> bool:
        """Record, on `conn` inside the caller's open local transaction, that
        `consumer_group` applied the input `msg_id`: False when it had already (committed
        by another attempt; a concurrent one is waited for), and the transaction must then
        roll back. Its commit is durable, as `record`'s is."""

    @abstractmethod
    async def lookup(self, txid: str) -> str | None:
        """The recorded decision for `txid`, in a transaction of its own."""

    @abstractmethod
    async def claim(self, txid: str) -> bool:
        """Insert `rolled_back` for `txid` and commit; False when the key was taken."""

    @abstractmethod
    async def forget_before(self, cutoff: float) -> int:
        """Remove this group's rows recorded before `cutoff` (epoch seconds); how many."""

    async def check(self, view: CheckView) -> Decision:
        """The group's checker: `TransactionProducer(nc, group, txlog.check)`."""
        if view.group != self.group:
            raise ConfigError(f"this log answers for group {self.group!r}, not {view.group!r}")
        return await settle(self, view.txid)

    async def prune(
        self, config: CoordinatorConfig | None = None, *, clock_margin: float = CLOCK_MARGIN
    ) -> int:
        """Remove the rows no check-back can ask about any more (see `retention`), for the
        coordinators' `config`; how many were removed. Run it now and then (hourly)."""
        age = retention_age(config or CoordinatorConfig(), clock_margin)
        removed = await self.forget_before(time.time() - age)
        log.info("txlog_pruned", group=self.group, removed=removed, older_than=age)
        return removed

    async def prune_forever(
        self,
        config: CoordinatorConfig | None = None,
        *,
        every: float = 3600.0,
        clock_margin: float = CLOCK_MARGIN,
    ) -> NoReturn:
        """`prune` now and every `every` seconds, until cancelled: start it beside the
        producer. A prune that fails (the database away) is logged and tried next time."""
        while True:
            try:
                await self.prune(config, clock_margin=clock_margin)
            except Exception:
                log.exception("txlog_prune_failed", group=self.group)
            await anyio.sleep(every)

    async def send_in_transaction(
        self,
        producer: TransactionProducer,
        message: TxMessage | Sequence[TxMessage],
        work: Work[C],
    ) -> TransactionResult:
        """Send `message` if and only if `work` commits: prepare, then one local transaction
        (record the txid, run `work(connection, txid)`, commit), then end with COMMIT.

        The prepare is out while the local transaction runs, and awaited just before its
        commit (before it starts where the pool has no free connection: `pool_exhausted`).
        `work` raising rolls both back and the error propagates; `RolledBackByCheck` if a
        check-back had already decided the transaction. `PrepareFailed` if the halves
        were not stored: the work ran, and was rolled back. A commit that raises is settled
        from the log at once: the error propagates unless the commit did happen.
        """
        if producer.group != self.group:
            raise ConfigError(
                f"the log is for group {self.group!r}, the producer for {producer.group!r}"
            )
        async with producer.begin() as txn:  # an exception rolls back, a cancel ends nothing
            local_commit = txn.local_commit()  # the last check-back may claim it until begun
            sending = txn.start_send(message)  # out while the local transaction runs
            if self.serial_local or self.pool_exhausted():
                await sending
            commit_error: Exception | None = None
            async with self.local() as local:  # left uncommitted, it rolls back
                await self.record(local.connection, txn.txid)
                crash_if_armed(FaultPoint.AFTER_TXLOG_RECORD)
                await work(local.connection, txn.txid)
                crash_if_armed(FaultPoint.AFTER_LOCAL_WORK)
                await sending  # cancelled here, the send is failed: the check says ROLLBACK
                crash_if_armed(FaultPoint.AFTER_PREPARE)
                local_commit.begin()  # RolledBackByCheck if the last check claimed it
                try:
                    with anyio.CancelScope(shield=True):
                        await local.commit()
                except Exception as error:
                    commit_error = error
            if commit_error is not None:  # it may have committed all the same: ask the log
                decision = await settle(self, txn.txid)
                log.warning("local_commit_failed", error=repr(commit_error), settled=decision)
                await txn.end(decision)
                if decision is not Decision.COMMIT:
                    raise commit_error
            crash_if_armed(FaultPoint.AFTER_LOCAL_COMMIT)
        assert txn.result is not None  # the block's exit ended it
        return txn.result


class Commits(Protocol):
    """A driver's connection whose `commit()` ends its transaction."""

    async def commit(self) -> None: ...


K = TypeVar("K", bound=Commits)


class ConnectionLocal(Generic[K]):
    """A local transaction on `connection` (`TxLog.local` of a backend whose driver commits
    on the connection)."""

    def __init__(self, connection: K) -> None:
        self.connection = connection
        self.committed = False

    async def commit(self) -> None:
        await self.connection.commit()
        self.committed = True


@contextmanager
def unavailable_raised(unavailable: Callable[[Exception], bool]) -> Iterator[None]:
    """An error that `unavailable` says is the database's (connection lost, lock timeout)
    raised as `LogUnavailable`: the check answers UNKNOWN and is asked again later."""
    try:
        yield
    except Exception as error:
        if unavailable(error):
            raise LogUnavailable(repr(error)) from error
        raise


def duplicate_txid(group: str, txid: str) -> RolledBackByCheck:
    """The error `record` raises when the key is taken."""
    return RolledBackByCheck(
        f"transaction {txid} of group {group!r} was decided by a check-back (rolled back) "
        "before its local transaction recorded it; roll the local transaction back",
        txid=txid,
    )
