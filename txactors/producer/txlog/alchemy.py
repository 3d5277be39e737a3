"""The transaction log through SQLAlchemy's async engine (the `sqlalchemy` extra): MySQL
and MariaDB (asyncmy, aiomysql), PostgreSQL, SQLite, and whatever else it drives.

`SqlAlchemyTxLog(engine, group)`: local transactions of the one-call form and check-backs
each take a connection of the engine's pool. `record(conn, txid)` works on any
`AsyncConnection` in a transaction (from an `AsyncSession`: `await session.connection()`).
Only portable SQL: a claim is a plain INSERT in its own transaction, whose key violation
means "taken"; each read is a transaction of its own, so under MySQL's REPEATABLE READ it
sees the latest commit.

MySQL and MariaDB keep a transaction open after a statement failed: when `record` raises
`RolledBackByCheck`, let the error propagate so the transaction rolls back (the one-call
form does). Durability: on PostgreSQL the log row's INSERT sets `synchronous_commit = on`
for its transaction, as the asyncpg and psycopg logs do (see `postgres`), whatever the
server's or session's default; on MySQL and MariaDB it is the server's, InnoDB's
`innodb_flush_log_at_trx_commit = 1` (its default) flushing the log at each commit.

`create_table()` looks for the table, then creates it: instances starting together on a fresh
database would race between the two (MariaDB: `1050 Table ... already exists`), so each
takes the database's lock for it first (`_ddl_lock`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import anyio
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from txactors.observe.logs import get_logger
from txactors.producer.txlog.decide import COMMITTED, ROLLED_BACK
from txactors.producer.txlog.log import (
    PRUNE_BATCH,
    ConnectionLocal,
    TxLog,
    duplicate_txid,
    unavailable_raised,
)
from txactors.producer.txlog.postgres import DDL_LOCK, durable_applied_insert, durable_insert
from txactors.producer.txlog.schema import (
    APPLIED_TABLE,
    DECISION_LENGTH,
    GROUP_LENGTH,
    INDEX,
    MSG_ID_LENGTH,
    TABLE,
    TXID_LENGTH,
)

log = get_logger(__name__)

metadata: Final = sa.MetaData()
table: Final = sa.Table(
    TABLE,
    metadata,
    sa.Column("producer_group", sa.String(GROUP_LENGTH), primary_key=True),
    sa.Column("txid", sa.String(TXID_LENGTH), primary_key=True),
    sa.Column("decision", sa.String(DECISION_LENGTH), nullable=False),
    sa.Column("recorded_at", sa.Double(), nullable=False),
    sa.Index(INDEX, "producer_group", "recorded_at"),
)
"""The same table as `schema.CREATE_TABLE`, for `metadata.create_all` or Alembic."""
applied_table: Final = sa.Table(
    APPLIED_TABLE,
    metadata,
    sa.Column("consumer_group", sa.String(GROUP_LENGTH), primary_key=True),
    sa.Column("msg_id", sa.String(MSG_ID_LENGTH), primary_key=True),
    sa.Column("applied_at", sa.Double(), nullable=False),
)
"""The same table as `schema.CREATE_APPLIED_TABLE`."""
_DURABLE_PG_APPLIED: Final = sa.text(
    durable_applied_insert(":consumer_group, :msg_id, :applied_at")
)
_DURABLE_PG_INSERT: Final = sa.text(
    durable_insert(":producer_group, :txid, :decision, :recorded_at")
)
"""PostgreSQL's log row, committed with `synchronous_commit = on` (see `postgres`)."""
DDL_LOCK_NAME: Final = f"txactors.{TABLE}"
"""MySQL's and MariaDB's named lock (`GET_LOCK`) serializing `create_table`."""
DDL_LOCK_WAIT: Final = 60
"""Seconds a `create_table` waits for another instance's (MySQL, MariaDB)."""


class SqlAlchemyTxLog(TxLog[AsyncConnection]):
    """The log of `group` in the database of `engine`."""

    def __init__(self, engine: AsyncEngine, group: str) -> None:
        super().__init__(group)
        self._engine = engine
        self._insert: sa.Executable = (
            _DURABLE_PG_INSERT if engine.dialect.name == "postgresql" else table.insert()
        )
        self._applied: sa.Executable = (
            _DURABLE_PG_APPLIED if engine.dialect.name == "postgresql" else applied_table.insert()
        )

    async def create_table(self) -> None:
        async with self._engine.connect() as conn, _ddl_lock(conn):
            await conn.run_sync(metadata.create_all, tables=[table])
            await conn.commit()

    async def create_applied_table(self) -> None:
        async with self._engine.connect() as conn, _ddl_lock(conn):
            await conn.run_sync(metadata.create_all, tables=[applied_table])
            await conn.commit()

    async def mark_applied(self, conn: AsyncConnection, consumer_group: str, msg_id: str) -> bool:
        row = {"consumer_group": consumer_group, "msg_id": msg_id, "applied_at": time.time()}
        try:
            await conn.execute(self._applied, row)
        except IntegrityError:
            return False  # the caller rolls the transaction back
        return True

    async def record(self, conn: AsyncConnection, txid: str) -> None:
        try:
            await conn.execute(self._insert, self._row(txid, COMMITTED))
        except IntegrityError as error:
            raise duplicate_txid(self.group, txid) from error

    @asynccontextmanager
    async def local(self) -> AsyncIterator[ConnectionLocal[AsyncConnection]]:
        async with self._engine.connect() as conn:
            local = ConnectionLocal(conn)
            try:
                await conn.begin()
                yield local
            finally:
                if not local.committed:
                    with anyio.CancelScope(shield=True):
                        await _rollback(conn)

    async def lookup(self, txid: str) -> str | None:
        query = sa.select(table.c.decision).where(
            table.c.producer_group == self.group, table.c.txid == txid
        )
        with unavailable_raised(_unavailable):
            async with self._engine.begin() as conn:
                found = (await conn.execute(query)).scalar_one_or_none()
        return None if found is None else str(found)

    async def claim(self, txid: str) -> bool:
        with unavailable_raised(_unavailable):
            try:
                async with self._engine.begin() as conn:
                    await conn.execute(self._insert, self._row(txid, ROLLED_BACK))
            except IntegrityError:
                return False  # recorded first: the row says what happened
        return True

    async def forget_before(self, cutoff: float) -> int:
        removed = 0
        while True:
            async with self._engine.begin() as conn:
                # Keys first, then a delete by key: MySQL allows no LIMIT in a subquery.
                keys = (
                    await conn.execute(
                        sa.select(table.c.producer_group, table.c.txid)
                        .where(table.c.producer_group == self.group)
                        .where(table.c.recorded_at < cutoff)
                        .limit(PRUNE_BATCH)
                    )
                ).all()
                if keys:
                    await conn.execute(
                        table.delete().where(
                            sa.tuple_(table.c.producer_group, table.c.txid).in_(
                                [tuple(key) for key in keys]
                            )
                        )
                    )
            removed += len(keys)
            if len(keys) < PRUNE_BATCH:
                return removed

    def _row(self, txid: str, decision: str) -> dict[str, object]:
        return {
            "producer_group": self.group,
            "txid": txid,
            "decision": decision,
            "recorded_at": time.time(),
        }


@asynccontextmanager
async def _ddl_lock(conn: AsyncConnection) -> AsyncIterator[None]:
    """Hold the database's lock for the log's DDL, so that its look for the table and its
    CREATE are one step: a PostgreSQL advisory lock (the asyncpg and psycopg logs take the
    same one) or a MySQL/MariaDB named lock, each held until the block's commit; SQLite's
    write lock (`BEGIN IMMEDIATE`, its DDL being transactional). Another dialect takes none:
    create the table before instances start (docs/operations.md has the DDL)."""
    dialect = conn.dialect.name
    if dialect == "postgresql":
        await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": DDL_LOCK})
        yield
    elif dialect in ("mysql", "mariadb"):  # DDL commits at once there: a session lock
        named = {"name": DDL_LOCK_NAME, "wait": DDL_LOCK_WAIT}
        taken = await conn.scalar(sa.text("SELECT GET_LOCK(:name, :wait)"), named)
        if taken != 1:
            raise TimeoutError(
                f"create_table: the lock {DDL_LOCK_NAME!r} was not free within "
                f"{DDL_LOCK_WAIT}s (GET_LOCK answered {taken!r})"
            )
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await conn.scalar(sa.text("SELECT RELEASE_LOCK(:name)"), named)
    elif dialect == "sqlite":
        await conn.exec_driver_sql("BEGIN IMMEDIATE")
        yield
    else:
        yield


def _unavailable(error: Exception) -> bool:
    """Connection lost, lock wait timeout, deadlock, pool exhausted: ask again later."""
    if isinstance(error, OperationalError | PoolTimeout | OSError | TimeoutError):
        return True
    return isinstance(error, DBAPIError) and error.connection_invalidated


async def _rollback(conn: AsyncConnection) -> None:
    """A rollback that fails left nothing committed (the pool discards the connection)."""
    try:
        await conn.rollback()
    except sa.exc.SQLAlchemyError as error:
        log.warning("txlog_rollback_failed", error=repr(error))
