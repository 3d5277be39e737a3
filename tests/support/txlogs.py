"""The transaction log's backends under test, each on its real database, behind one face.

A `Backend` opens instances of a group's log (each on connections of its own, as separate
producer processes have), writes the business change of a local transaction (a row in
`txlog_business`, keyed by txid) and says whether it committed. SQLite uses a file, the
others the test servers: PostgreSQL on 127.0.0.1:5432 (asyncpg and psycopg) and MariaDB on
127.0.0.1:3306 (SQLAlchemy with asyncmy); none is skipped when its server is missing.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Final

import aiosqlite
import asyncpg  # type: ignore[import-untyped]
import psycopg_pool
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from txactors.producer.txlog import TxLog
from txactors.producer.txlog.alchemy import SqlAlchemyTxLog
from txactors.producer.txlog.pg_asyncpg import AsyncpgTxLog
from txactors.producer.txlog.pg_psycopg import PsycopgTxLog
from txactors.producer.txlog.sqlite import SqliteTxLog

PG_DSN: Final = os.environ.get("TXACTORS_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
MARIADB_URL: Final = os.environ.get(
    "TXACTORS_TEST_MARIADB_URL", "mysql+asyncmy://root@127.0.0.1:3306/test"
)
BUSINESS: Final = "txlog_business"
PG_ALCHEMY_URL: Final = PG_DSN.replace("postgresql://", "postgresql+asyncpg://", 1)
BACKENDS: Final = ("sqlite", "asyncpg", "psycopg", "mariadb", "alchemy-pg")


class Backend(ABC):
    """One database and driver; `close()` closes every instance it opened."""

    name: str

    def __init__(self) -> None:
        self.stack = AsyncExitStack()

    @abstractmethod
    async def instance(self, group: str) -> TxLog[Any]:
        """A new instance of `group`'s log, with connections of its own."""

    @abstractmethod
    async def write(self, conn: Any, txid: str) -> None:
        """The business change of transaction `txid`, on the local transaction's `conn`."""

    @abstractmethod
    async def committed(self, txid: str) -> bool:
        """Whether `txid`'s business change is committed."""

    async def close(self) -> None:
        await self.stack.aclose()


class SqliteBackend(Backend):
    name = "sqlite"

    def __init__(self, path: Path, busy_timeout: float = 5.0) -> None:
        super().__init__()
        self.path = path
        self.busy_timeout = busy_timeout

    async def instance(self, group: str) -> SqliteTxLog:
        txlog = await self.stack.enter_async_context(
            SqliteTxLog(self.path, group, busy_timeout=self.busy_timeout)
        )
        await txlog.create_table()
        await txlog.connection.execute(
            f"CREATE TABLE IF NOT EXISTS {BUSINESS} (txid TEXT PRIMARY KEY)"
        )
        return txlog

    async def write(self, conn: Any, txid: str) -> None:
        await conn.execute(f"INSERT INTO {BUSINESS} (txid) VALUES (?)", (txid,))

    async def committed(self, txid: str) -> bool:
        async with aiosqlite.connect(self.path) as conn:
            cursor = await conn.execute(f"SELECT 1 FROM {BUSINESS} WHERE txid = ?", (txid,))
            return await cursor.fetchone() is not None


class AsyncpgBackend(Backend):
    name = "asyncpg"

    async def instance(self, group: str) -> AsyncpgTxLog:
        pool = await asyncpg.create_pool(PG_DSN, min_size=1, max_size=4)
        self.stack.push_async_callback(pool.close)
        await pool.execute(f"CREATE TABLE IF NOT EXISTS {BUSINESS} (txid TEXT PRIMARY KEY)")
        txlog = AsyncpgTxLog(pool, group)
        await txlog.create_table()
        return txlog

    async def write(self, conn: Any, txid: str) -> None:
        await conn.execute(f"INSERT INTO {BUSINESS} (txid) VALUES ($1)", txid)

    async def committed(self, txid: str) -> bool:
        conn = await asyncpg.connect(PG_DSN)
        try:
            return bool(await conn.fetchval(f"SELECT 1 FROM {BUSINESS} WHERE txid = $1", txid))
        finally:
            await conn.close()


class PsycopgBackend(Backend):
    name = "psycopg"

    async def instance(self, group: str) -> PsycopgTxLog:
        pool = psycopg_pool.AsyncConnectionPool(
            "host=127.0.0.1 port=5432 user=postgres dbname=test",
            min_size=1,
            max_size=4,
            open=False,
        )
        await pool.open()
        self.stack.push_async_callback(pool.close)
        async with pool.connection() as conn:
            await conn.execute(f"CREATE TABLE IF NOT EXISTS {BUSINESS} (txid TEXT PRIMARY KEY)")
        txlog = PsycopgTxLog(pool, group)
        await txlog.create_table()
        return txlog

    async def write(self, conn: Any, txid: str) -> None:
        await conn.execute(f"INSERT INTO {BUSINESS} (txid) VALUES (%s)", (txid,))

    async def committed(self, txid: str) -> bool:
        return await AsyncpgBackend().committed(txid)


class MariadbBackend(Backend):
    """SQLAlchemy's async engine on MariaDB (asyncmy)."""

    name = "mariadb"
    url = MARIADB_URL

    async def instance(self, group: str) -> SqlAlchemyTxLog:
        engine = create_async_engine(self.url, pool_size=4)
        self.stack.push_async_callback(engine.dispose)
        async with engine.begin() as conn:
            await conn.execute(
                sa.text(f"CREATE TABLE IF NOT EXISTS {BUSINESS} (txid VARCHAR(128) PRIMARY KEY)")
            )
        txlog = SqlAlchemyTxLog(engine, group)
        await txlog.create_table()
        return txlog

    async def write(self, conn: Any, txid: str) -> None:
        await conn.execute(sa.text(f"INSERT INTO {BUSINESS} (txid) VALUES (:txid)"), {"txid": txid})

    async def committed(self, txid: str) -> bool:
        engine = create_async_engine(self.url, poolclass=sa.NullPool)
        try:
            async with engine.connect() as conn:
                found = await conn.execute(
                    sa.text(f"SELECT 1 FROM {BUSINESS} WHERE txid = :txid"), {"txid": txid}
                )
                return found.first() is not None
        finally:
            await engine.dispose()


class PgAlchemyBackend(MariadbBackend):
    """SQLAlchemy's async engine on PostgreSQL (its asyncpg dialect): the same portable SQL."""

    name = "alchemy-pg"
    url = PG_ALCHEMY_URL


def backend(name: str, directory: Path) -> Backend:
    if name == "sqlite":
        return SqliteBackend(directory / "service.db")
    others: dict[str, type[Backend]] = {
        "asyncpg": AsyncpgBackend,
        "psycopg": PsycopgBackend,
        "mariadb": MariadbBackend,
        "alchemy-pg": PgAlchemyBackend,
    }
    return others[name]()
