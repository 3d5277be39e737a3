"""The transaction log in PostgreSQL through asyncpg (the `postgres` extra).

`AsyncpgTxLog(pool, group)`: local transactions of the one-call form and check-backs each
take a connection of the pool, so a check never runs inside a transaction the service has
open. `record(conn, txid)` works on any asyncpg connection in a transaction; its failure
on the key aborts that transaction (PostgreSQL refuses to commit it). A local transaction of
the one-call form is four round trips: BEGIN, the log row (which also makes the commit
durable, see `postgres`), the user's work, COMMIT; a claim is one (a statement of its own).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from txactors.observe.logs import get_logger
from txactors.producer.txlog.decide import COMMITTED, ROLLED_BACK
from txactors.producer.txlog.log import PRUNE_BATCH, TxLog, duplicate_txid, unavailable_raised
from txactors.producer.txlog.postgres import (
    DDL_LOCK,
    UNIQUE_VIOLATION,
    durable_applied_insert,
    durable_insert,
    is_transient,
)
from txactors.producer.txlog.schema import CREATE_APPLIED_TABLE, CREATE_INDEX, CREATE_TABLE, TABLE

log = get_logger(__name__)

_INSERT = durable_insert("$1, $2, $3, $4")
_APPLIED = durable_applied_insert("$1, $2, $3")


class AsyncpgLocal:
    """A local transaction on a pooled connection (`AsyncpgTxLog.local`)."""

    def __init__(self, connection: Any, transaction: Any) -> None:
        self.connection = connection
        self._transaction = transaction
        self.committed = False

    async def commit(self) -> None:
        await self._transaction.commit()
        self.committed = True


class AsyncpgTxLog(TxLog[Any]):
    """The log of `group` in the database of asyncpg `pool` (an `asyncpg.Pool`)."""

    def __init__(self, pool: Any, group: str) -> None:
        super().__init__(group)
        self._pool = pool

    async def create_table(self) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", DDL_LOCK)
            await conn.execute(CREATE_TABLE)
            await conn.execute(CREATE_INDEX)

    def pool_exhausted(self) -> bool:
        pool = self._pool
        return bool(pool.get_idle_size() == 0 and pool.get_size() >= pool.get_max_size())

    async def create_applied_table(self) -> None:
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", DDL_LOCK)
            await conn.execute(CREATE_APPLIED_TABLE)

    async def mark_applied(self, conn: Any, consumer_group: str, msg_id: str) -> bool:
        try:
            await conn.execute(_APPLIED, consumer_group, msg_id, time.time())
        except Exception as error:
            if getattr(error, "sqlstate", None) == UNIQUE_VIOLATION:
                return False  # the transaction is aborted: the caller rolls it back
            raise
        return True

    async def record(self, conn: Any, txid: str) -> None:
        try:
            await conn.execute(_INSERT, self.group, txid, COMMITTED, time.time())
        except Exception as error:
            if getattr(error, "sqlstate", None) == UNIQUE_VIOLATION:
                raise duplicate_txid(self.group, txid) from error
            raise

    @asynccontextmanager
    async def local(self) -> AsyncIterator[AsyncpgLocal]:
        async with self._pool.acquire() as conn:
            transaction = conn.transaction()
            await transaction.start()
            local = AsyncpgLocal(conn, transaction)
            try:
                yield local
            finally:
                if not local.committed:
                    with anyio.CancelScope(shield=True):
                        await _rollback(transaction)

    async def lookup(self, txid: str) -> str | None:
        with unavailable_raised(is_transient):
            async with self._pool.acquire() as conn:
                found = await conn.fetchval(
                    f"SELECT decision FROM {TABLE} WHERE producer_group = $1 AND txid = $2",
                    self.group,
                    txid,
                )
        return None if found is None else str(found)

    async def claim(self, txid: str) -> bool:
        with unavailable_raised(is_transient):
            async with self._pool.acquire() as conn:  # its own transaction, durable
                status = await conn.execute(
                    f"{_INSERT} ON CONFLICT DO NOTHING", self.group, txid, ROLLED_BACK, time.time()
                )
        return bool(status == "INSERT 0 1")

    async def forget_before(self, cutoff: float) -> int:
        removed = 0
        while True:
            async with self._pool.acquire() as conn:
                status = await conn.execute(
                    f"DELETE FROM {TABLE} WHERE ctid IN (SELECT ctid FROM {TABLE} "
                    "WHERE producer_group = $1 AND recorded_at < $2 LIMIT $3)",
                    self.group,
                    cutoff,
                    PRUNE_BATCH,
                )
            count = int(status.rsplit(" ", 1)[-1])
            removed += count
            if count < PRUNE_BATCH:
                return removed


async def _rollback(transaction: Any) -> None:
    """A rollback that fails left nothing committed (the server drops the transaction
    with the connection, which the pool then discards)."""
    try:
        await transaction.rollback()
    except Exception as error:
        log.warning("txlog_rollback_failed", error=repr(error))
