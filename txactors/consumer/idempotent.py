"""Idempotent handling: apply each message at most once, in your own database transaction.

Delivery is at least once (a crash after the commit but before the ack redelivers), so a
handler that changes a database must notice a message it already applied. The classic remedy
(the 消息应用状态表, "message apply table") is to insert the message id into a table in the
SAME local transaction as the business change: both commit or neither does. The insert comes
first, so a concurrent redelivery of the same message blocks on the primary key until the
first attempt commits (and then applies nothing) or rolls back (and then applies it).

    CREATE TABLE message_apply (
        consumer_group TEXT, msg_id TEXT, applied_at ...,
        PRIMARY KEY (consumer_group, msg_id))

The table is created on first use. Both backends nest: called while the connection already
has a transaction open, the work runs in a savepoint and the caller's commit makes it durable.

Durable before the ack: the consumer acks once the helper returns, so the commit must be on
disk by then, or a power cut after the ack loses a change whose message is gone for good.
SQLite: the helper raises the connection's `synchronous` before its own transaction: to FULL in
WAL mode (the common WAL-with-NORMAL is not durable), to EXTRA with a rollback journal, where
FULL does not sync the journal's deletion and a power cut right after a commit can bring the
journal back and undo it (the power-cut tests in tests/integration/test_powercut.py show both).
PostgreSQL: it sets `synchronous_commit = on` for its transaction (`off` or `local` would ack
before the WAL is flushed). When nested, your transaction commits, so your connection needs the
same: SQLite `PRAGMA synchronous=FULL` in WAL mode, EXTRA otherwise (it cannot change inside a
transaction), PostgreSQL `synchronous_commit=on` (and `fsync=on` on the server, its default).
A database of your own that your handler writes besides these needs them too.
"""

from __future__ import annotations

import time
import weakref
import zlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar, runtime_checkable

import anyio

from txactors.durability import sqlite_durable

if TYPE_CHECKING:
    import aiosqlite

TABLE: Final = "message_apply"
_SAVEPOINT: Final = "txactors_message_apply"

C = TypeVar("C")
Work = Callable[[C], Awaitable[object]]

# One lock per SQLite connection: a connection holds one transaction at a time, and a consumer
# runs handlers concurrently.
_sqlite_locks: weakref.WeakKeyDictionary[object, anyio.Lock] = weakref.WeakKeyDictionary()
_sqlite_tables: weakref.WeakSet[object] = weakref.WeakSet()


async def apply_once_sqlite(
    conn: aiosqlite.Connection, group: str, msg_id: str, work: Work[aiosqlite.Connection]
) -> bool:
    """Run `work(conn)` and record `msg_id` for `group` in one SQLite transaction.

    Returns False, and runs nothing, when the message was already applied. If `work` raises,
    the transaction (record included) is rolled back and the error propagates, so the consumer
    retries the message later. Unless nested, the commit is durable (`synchronous` is raised
    to FULL first); nested, the caller's connection setting decides.
    """
    lock = _sqlite_locks.setdefault(conn, anyio.Lock())
    async with lock:
        if not conn.in_transaction:
            await sqlite_durable(conn)
        if conn not in _sqlite_tables:
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {TABLE} (consumer_group TEXT NOT NULL, "
                "msg_id TEXT NOT NULL, applied_at REAL NOT NULL, "
                "PRIMARY KEY (consumer_group, msg_id))"
            )
            if not conn.in_transaction:  # else the caller's rollback may undo it: ask again
                await conn.commit()
                _sqlite_tables.add(conn)
        nested = conn.in_transaction
        # IMMEDIATE takes the write lock up front: two connections that both read first and
        # then write would otherwise deadlock into SQLITE_BUSY.
        await conn.execute(f"SAVEPOINT {_SAVEPOINT}" if nested else "BEGIN IMMEDIATE")
        try:
            cursor = await conn.execute(
                f"INSERT INTO {TABLE} (consumer_group, msg_id, applied_at) VALUES (?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (group, msg_id, time.time()),
            )
            fresh = cursor.rowcount == 1
            if fresh:
                await work(conn)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _sqlite_end(conn, nested, commit=False)
            raise
        await _sqlite_end(conn, nested, commit=fresh)
        return fresh


async def _sqlite_end(conn: aiosqlite.Connection, nested: bool, *, commit: bool) -> None:
    if nested:
        if not commit:
            await conn.execute(f"ROLLBACK TO {_SAVEPOINT}")
        await conn.execute(f"RELEASE {_SAVEPOINT}")
    elif commit:
        await conn.commit()
    else:
        await conn.rollback()


# -- PostgreSQL ---------------------------------------------------------------------------
# Typed by what we call, so txactors needs asyncpg only when you use it (the `postgres` extra).


class PgTransaction(Protocol):
    async def __aenter__(self) -> Any: ...
    async def __aexit__(self, *exc_info: object) -> Any: ...


@runtime_checkable
class PgConnection(Protocol):
    """What we use of an `asyncpg.Connection`."""

    async def execute(self, query: str, *args: object) -> str: ...
    def transaction(self) -> PgTransaction: ...


class PgAcquire(Protocol):
    async def __aenter__(self) -> PgConnection: ...
    async def __aexit__(self, *exc_info: object) -> Any: ...


class PgPool(Protocol):
    """What we use of an `asyncpg.Pool`."""

    def acquire(self) -> PgAcquire: ...


_PG_DDL: Final = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (consumer_group TEXT NOT NULL, "
    "msg_id TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now(), "
    "PRIMARY KEY (consumer_group, msg_id))"
)
# CREATE TABLE IF NOT EXISTS races with itself across sessions (a unique violation on the
# catalog); serialize it with a transaction-scoped advisory lock.
_PG_DDL_LOCK: Final = zlib.crc32(b"txactors." + TABLE.encode())
_UNDEFINED_TABLE: Final = "42P01"  # SQLSTATE; matched by code so asyncpg stays optional


async def apply_once_postgres(
    db: PgConnection | PgPool, group: str, msg_id: str, work: Work[PgConnection]
) -> bool:
    """Run `work(conn)` and record `msg_id` for `group` in one PostgreSQL transaction.

    `db` is an asyncpg connection or pool (a pool lets concurrent handlers use several
    connections). Returns False, and runs nothing, when the message was already applied; if
    `work` raises, the transaction (record included) is rolled back and the error propagates.
    The transaction runs with `synchronous_commit = on`, so its commit is durable on return.
    """
    if isinstance(db, PgConnection):
        return await _apply_postgres(db, group, msg_id, work)
    async with db.acquire() as conn:
        return await _apply_postgres(conn, group, msg_id, work)


async def _apply_postgres(
    conn: PgConnection, group: str, msg_id: str, work: Work[PgConnection]
) -> bool:
    try:
        return await _apply_postgres_once(conn, group, msg_id, work)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) != _UNDEFINED_TABLE:
            raise
    # First use in this database (the failed attempt was rolled back): create, then retry.
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _PG_DDL_LOCK)
        await conn.execute(_PG_DDL)
    return await _apply_postgres_once(conn, group, msg_id, work)


async def _apply_postgres_once(
    conn: PgConnection, group: str, msg_id: str, work: Work[PgConnection]
) -> bool:
    async with conn.transaction():
        # SET LOCAL: this transaction only (the enclosing one, when nested), whatever the
        # server, database, role or session default says.
        await conn.execute("SET LOCAL synchronous_commit = on")
        status = await conn.execute(
            f"INSERT INTO {TABLE} (consumer_group, msg_id) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            group,
            msg_id,
        )
        if status != "INSERT 0 1":
            return False
        await work(conn)
    return True
