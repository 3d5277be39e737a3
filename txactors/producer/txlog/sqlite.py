"""The transaction log in a SQLite database (aiosqlite).

The log keeps its own connection to the database file: a check-back must run in a
transaction of its own, never inside one the service has open on its connection. Local
transactions of the one-call form run on that connection too (one at a time: SQLite has
one writer anyway), with the business tables of the same file. Other processes of the
group may open the same file; a writer waits `busy_timeout` seconds for another's lock,
and a check-back that cannot get it in time answers UNKNOWN (asked again later).

Durable like `apply_once_sqlite`: `synchronous` is raised to FULL in WAL mode, EXTRA with a
rollback journal, so a committed local transaction (log row and business rows) and a
claimed rollback survive a power cut once the commit returned.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import Self

import aiosqlite
import anyio

from txactors.durability import sqlite_durable
from txactors.observe.logs import get_logger
from txactors.producer.txlog.decide import COMMITTED, ROLLED_BACK, LogUnavailable
from txactors.producer.txlog.log import PRUNE_BATCH, ConnectionLocal, TxLog, duplicate_txid
from txactors.producer.txlog.schema import (
    APPLIED_TABLE,
    CREATE_APPLIED_TABLE,
    CREATE_INDEX,
    CREATE_TABLE,
    TABLE,
)

log = get_logger(__name__)

DEFAULT_BUSY_TIMEOUT = 5.0


SqliteLocal = ConnectionLocal[aiosqlite.Connection]
"""A local transaction on the log's connection (`SqliteTxLog.local`)."""


class SqliteTxLog(TxLog[aiosqlite.Connection]):
    """The log of `group` in the SQLite file at `path`: `async with SqliteTxLog(...) as txlog`."""

    serial_local = True

    def __init__(
        self, path: str | PathLike[str], group: str, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT
    ) -> None:
        super().__init__(group)
        self.path = Path(path)
        self._busy_timeout = busy_timeout
        self._conn: aiosqlite.Connection | None = None
        self._lock = anyio.Lock()

    async def open(self) -> Self:
        """Connect (what `async with` does on entry; for an app's `on_startup` hook)."""
        # isolation_level=None: every transaction is begun here, none behind our back.
        self._conn = await aiosqlite.connect(
            self.path, timeout=self._busy_timeout, isolation_level=None
        )
        await sqlite_durable(self._conn)
        return self

    async def close(self) -> None:
        """Disconnect (what `async with` does on exit)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def connection(self) -> aiosqlite.Connection:
        if self._conn is None:
            raise RuntimeError("the SqliteTxLog is not open: use `async with SqliteTxLog(...)`")
        return self._conn

    async def create_table(self) -> None:
        async with self._lock:
            await self.connection.execute("BEGIN IMMEDIATE")
            try:
                await self.connection.execute(CREATE_TABLE)
                await self.connection.execute(CREATE_INDEX)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.connection.rollback()
                raise
            await self.connection.commit()

    async def create_applied_table(self) -> None:
        async with self._lock:
            await self.connection.execute("BEGIN IMMEDIATE")
            try:
                await self.connection.execute(CREATE_APPLIED_TABLE)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.connection.rollback()
                raise
            await self.connection.commit()

    async def mark_applied(
        self, conn: aiosqlite.Connection, consumer_group: str, msg_id: str
    ) -> bool:
        cursor = await conn.execute(
            f"INSERT INTO {APPLIED_TABLE} (consumer_group, msg_id, applied_at) "
            "VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            (consumer_group, msg_id, time.time()),
        )
        return cursor.rowcount == 1

    async def record(self, conn: aiosqlite.Connection, txid: str) -> None:
        try:
            await conn.execute(
                f"INSERT INTO {TABLE} (producer_group, txid, decision, recorded_at) "
                "VALUES (?, ?, ?, ?)",
                (self.group, txid, COMMITTED, time.time()),
            )
        except sqlite3.IntegrityError as error:
            raise duplicate_txid(self.group, txid) from error

    @asynccontextmanager
    async def local(self) -> AsyncIterator[SqliteLocal]:
        async with self._lock:
            conn = self.connection
            await sqlite_durable(conn)
            local = SqliteLocal(conn)
            try:
                # IMMEDIATE: the write lock first, so two writers never deadlock on upgrade.
                # Inside the `try`: cancelled while waiting, the BEGIN still runs in
                # aiosqlite's thread, and the rollback queued behind it undoes it.
                await conn.execute("BEGIN IMMEDIATE")
                yield local
            finally:
                if not local.committed:
                    with anyio.CancelScope(shield=True):
                        await _rollback(conn)

    async def lookup(self, txid: str) -> str | None:
        async with self._lock:
            try:
                cursor = await self.connection.execute(
                    f"SELECT decision FROM {TABLE} WHERE producer_group = ? AND txid = ?",
                    (self.group, txid),
                )
                row = await cursor.fetchone()
            except sqlite3.OperationalError as error:
                raise LogUnavailable(str(error)) from error
        return None if row is None else str(row[0])

    async def claim(self, txid: str) -> bool:
        async with self._lock:
            conn = self.connection
            try:
                await conn.execute("BEGIN IMMEDIATE")
                cursor = await conn.execute(
                    f"INSERT INTO {TABLE} (producer_group, txid, decision, recorded_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (self.group, txid, ROLLED_BACK, time.time()),
                )
                claimed = cursor.rowcount == 1
                await conn.commit()
            except sqlite3.OperationalError as error:  # locked by another writer, I/O error
                with anyio.CancelScope(shield=True):
                    await _rollback(conn)
                raise LogUnavailable(str(error)) from error
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await _rollback(conn)
                raise
        return claimed

    async def forget_before(self, cutoff: float) -> int:
        removed = 0
        while True:
            async with self._lock:
                conn = self.connection
                await conn.execute("BEGIN IMMEDIATE")
                try:
                    cursor = await conn.execute(
                        f"DELETE FROM {TABLE} WHERE rowid IN (SELECT rowid FROM {TABLE} "
                        "WHERE producer_group = ? AND recorded_at < ? LIMIT ?)",
                        (self.group, cutoff, PRUNE_BATCH),
                    )
                    count = cursor.rowcount
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await _rollback(conn)
                    raise
                await conn.commit()
            removed += count
            if count < PRUNE_BATCH:
                return removed


async def _rollback(conn: aiosqlite.Connection) -> None:
    """Roll back whatever is open; a rollback that fails left nothing committed."""
    try:
        if conn.in_transaction:
            await conn.rollback()
    except sqlite3.Error as error:
        log.warning("txlog_rollback_failed", error=repr(error))
