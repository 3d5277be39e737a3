"""The transaction log in PostgreSQL through psycopg 3 (the `psycopg` extra).

`PsycopgTxLog(pool, group)` with a `psycopg_pool.AsyncConnectionPool`: local transactions
of the one-call form and check-backs each take a connection of the pool, so a check never
runs inside a transaction the service has open. `record(conn, txid)` works on any psycopg
`AsyncConnection` in a transaction; its failure on the key aborts that transaction
(PostgreSQL refuses to commit it). The log row's INSERT also makes its transaction's commit
durable (see `postgres`): no statement of its own for that.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import anyio
import psycopg

from txactors.observe.logs import get_logger
from txactors.producer.txlog.decide import COMMITTED, ROLLED_BACK
from txactors.producer.txlog.log import (
    PRUNE_BATCH,
    ConnectionLocal,
    TxLog,
    duplicate_txid,
    unavailable_raised,
)
from txactors.producer.txlog.postgres import (
    DDL_LOCK,
    durable_applied_insert,
    durable_insert,
    is_transient,
)
from txactors.producer.txlog.schema import CREATE_APPLIED_TABLE, CREATE_INDEX, CREATE_TABLE, TABLE

log = get_logger(__name__)

Connection = psycopg.AsyncConnection[Any]
_INSERT = durable_insert("%s, %s, %s, %s")
_APPLIED = durable_applied_insert("%s, %s, %s")


class PsycopgPool(Protocol):
    """What we use of a `psycopg_pool.AsyncConnectionPool`."""

    def connection(self) -> AbstractAsyncContextManager[Connection]: ...

    def get_stats(self) -> Mapping[str, int]: ...


class PsycopgTxLog(TxLog[Connection]):
    """The log of `group` in the database of `pool`."""

    def __init__(self, pool: PsycopgPool, group: str) -> None:
        super().__init__(group)
        self._pool = pool

    async def create_table(self) -> None:
        async with self._pool.connection() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK,))
            await conn.execute(CREATE_TABLE)
            await conn.execute(CREATE_INDEX)
            await conn.commit()

    def pool_exhausted(self) -> bool:
        stats = self._pool.get_stats()
        return stats.get("pool_available", 1) == 0 and stats.get("pool_size", 0) >= stats.get(
            "pool_max", 0
        )

    async def create_applied_table(self) -> None:
        async with self._pool.connection() as conn:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (DDL_LOCK,))
            await conn.execute(CREATE_APPLIED_TABLE)
            await conn.commit()

    async def mark_applied(self, conn: Connection, consumer_group: str, msg_id: str) -> bool:
        try:
            await conn.execute(_APPLIED, (consumer_group, msg_id, time.time()))
        except psycopg.errors.UniqueViolation:
            return False  # the transaction is aborted: the caller rolls it back
        return True

    async def record(self, conn: Connection, txid: str) -> None:
        try:
            await conn.execute(_INSERT, (self.group, txid, COMMITTED, time.time()))
        except psycopg.errors.UniqueViolation as error:
            raise duplicate_txid(self.group, txid) from error

    @asynccontextmanager
    async def local(self) -> AsyncIterator[ConnectionLocal[Connection]]:
        async with self._pool.connection() as conn:
            local = ConnectionLocal(conn)
            try:  # the first statement begins the transaction (autocommit is off)
                yield local
            finally:
                if not local.committed:
                    with anyio.CancelScope(shield=True):
                        await _rollback(conn)

    async def lookup(self, txid: str) -> str | None:
        with unavailable_raised(_unavailable):
            async with self._pool.connection() as conn:
                cursor = await conn.execute(
                    f"SELECT decision FROM {TABLE} WHERE producer_group = %s AND txid = %s",
                    (self.group, txid),
                )
                row = await cursor.fetchone()
                await conn.rollback()  # a read: nothing to commit
        return None if row is None else str(row[0])

    async def claim(self, txid: str) -> bool:
        with unavailable_raised(_unavailable):
            async with self._pool.connection() as conn:
                cursor = await conn.execute(
                    f"{_INSERT} ON CONFLICT DO NOTHING",
                    (self.group, txid, ROLLED_BACK, time.time()),
                )
                claimed = cursor.rowcount == 1
                await conn.commit()
        return claimed

    async def forget_before(self, cutoff: float) -> int:
        removed = 0
        while True:
            async with self._pool.connection() as conn:
                cursor = await conn.execute(
                    f"DELETE FROM {TABLE} WHERE ctid IN (SELECT ctid FROM {TABLE} "
                    "WHERE producer_group = %s AND recorded_at < %s LIMIT %s)",
                    (self.group, cutoff, PRUNE_BATCH),
                )
                count = cursor.rowcount
                await conn.commit()
            removed += count
            if count < PRUNE_BATCH:
                return removed


def _unavailable(error: Exception) -> bool:
    return isinstance(error, psycopg.OperationalError) or is_transient(error)


async def _rollback(conn: Connection) -> None:
    """A rollback that fails left nothing committed (the pool replaces the connection)."""
    try:
        await conn.rollback()
    except psycopg.Error as error:
        log.warning("txlog_rollback_failed", error=repr(error))
