"""One small async database interface over SQLite (aiosqlite) and PostgreSQL (asyncpg).

Each demo service owns its database: a SQLite file, or a PostgreSQL schema. Its code is
written once against `Database`: SQL with `?` placeholders (rewritten to `$1, $2, …` for
PostgreSQL; so never put a literal `?` in the SQL), run in `transaction()`, and
`apply_once()` for consumers, which records the message id in txactors' message-apply
table in the same local transaction as the change. A producer keeps its transaction log
here too (`open_txlog`), so its check-backs answer themselves. Portable DDL: `TEXT`,
`BIGINT`, `DOUBLE PRECISION` mean the same to both.

    storage = Storage.sqlite(Path("data"))       # or Storage.postgres(dsn, prefix="t1_")
    db = await storage.open("alipay", fresh=True)
    async with db.transaction() as tx:
        await tx.execute("UPDATE accounts SET balance = balance - ? WHERE id = ?", 5, "a-1")
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit, urlunsplit

import aiosqlite
import anyio

from txactors.consumer import apply_once_postgres, apply_once_sqlite
from txactors.errors import ConfigError
from txactors.producer.txlog import TxLog
from txactors.producer.txlog.pg_asyncpg import AsyncpgTxLog
from txactors.producer.txlog.sqlite import SqliteTxLog

DEFAULT_PG_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SQLITE_BUSY_TIMEOUT = 30.0
"""Seconds a SQLite writer waits for another process's write lock (demos run several)."""
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class Tx(Protocol):
    """The statements of one local transaction."""

    connection: Any
    """The driver's connection it runs on, for helpers that take one (`TxLog.record`)."""

    async def execute(self, sql: str, *args: Any) -> int:
        """Run a statement; returns the number of rows it changed."""
        ...

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]: ...

    async def fetchval(self, sql: str, *args: Any) -> Any:
        """The first column of the first row, or None when there is no row."""
        ...


Work = Callable[[Tx], Awaitable[object]]


class Database(ABC):
    """A service's own database; see the module docstring."""

    kind: str
    name: str

    @abstractmethod
    def transaction(self) -> AbstractAsyncContextManager[Tx]:
        """`async with db.transaction() as tx:` commits on exit, rolls back on an exception."""

    @abstractmethod
    async def apply_once(self, group: str, msg_id: str, work: Work) -> bool:
        """Run `work` and record `msg_id` for `group` in one transaction; False (and nothing
        run) when the message was applied before."""

    @abstractmethod
    async def open_txlog(self, group: str) -> TxLog[Any]:
        """Producer `group`'s transaction log in this database (its table created if
        missing); closed with the database."""

    @abstractmethod
    def tx(self, connection: Any) -> Tx:
        """The statements of a local transaction the caller opened on `connection` (the
        one `TxLog.send_in_transaction` hands its work)."""

    @abstractmethod
    async def close(self) -> None: ...

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        async with self.transaction() as tx:
            return await tx.fetch(sql, *args)

    async def fetchval(self, sql: str, *args: Any) -> Any:
        async with self.transaction() as tx:
            return await tx.fetchval(sql, *args)

    async def script(self, statements: Sequence[str]) -> None:
        """Run DDL statements in one transaction."""
        async with self.transaction() as tx:
            for statement in statements:
                await tx.execute(statement)


# -- SQLite -----------------------------------------------------------------------------------


class _SqliteTx:
    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.connection = conn

    async def execute(self, sql: str, *args: Any) -> int:
        cursor = await self.connection.execute(sql, args)
        return max(cursor.rowcount, 0)

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        cursor = await self.connection.execute(sql, args)
        return [tuple(row) for row in await cursor.fetchall()]

    async def fetchval(self, sql: str, *args: Any) -> Any:
        rows = await self.fetch(sql, *args)
        return rows[0][0] if rows else None


class SqliteDatabase(Database):
    """One connection in WAL mode; its transactions take turns (SQLite has one writer
    anyway), and other processes may open the same file (they wait for the write lock)."""

    kind = "sqlite"

    def __init__(self, name: str, path: Path, conn: aiosqlite.Connection) -> None:
        self.name = name
        self.path = path
        self._conn = conn
        self._lock = anyio.Lock()
        self._txlogs: list[SqliteTxLog] = []

    @classmethod
    async def open(cls, name: str, path: Path) -> SqliteDatabase:
        # isolation_level=None: we say BEGIN ourselves, so nothing starts one behind our back.
        conn = await aiosqlite.connect(path, timeout=SQLITE_BUSY_TIMEOUT, isolation_level=None)
        await conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit is fsynced before it returns. NORMAL survives a process crash but
        # not a power cut, after which a debit whose message went out could vanish.
        await conn.execute("PRAGMA synchronous=FULL")
        return cls(name, path, conn)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._lock:
            try:
                # IMMEDIATE: take the write lock first, so two writers never deadlock on
                # upgrade. Inside the `try`: cancelled while waiting, the BEGIN still runs in
                # aiosqlite's thread, and the rollback queued behind it must undo it.
                await self._conn.execute("BEGIN IMMEDIATE")
                yield _SqliteTx(self._conn)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._conn.rollback()
                raise
            await self._conn.commit()

    async def apply_once(self, group: str, msg_id: str, work: Work) -> bool:
        async with self._lock:
            return await apply_once_sqlite(
                self._conn, group, msg_id, lambda conn: work(_SqliteTx(conn))
            )

    async def open_txlog(self, group: str) -> TxLog[Any]:
        # Its own connection to the file: a check-back's transaction must never run inside
        # one of ours. Writers of both connections take turns on SQLite's lock.
        txlog = SqliteTxLog(self.path, group, busy_timeout=SQLITE_BUSY_TIMEOUT)
        await txlog.__aenter__()
        self._txlogs.append(txlog)
        await txlog.create_table()
        return txlog

    def tx(self, connection: Any) -> Tx:
        return _SqliteTx(connection)

    async def close(self) -> None:
        for txlog in self._txlogs:
            await txlog.__aexit__(None, None, None)
        await self._conn.close()


# -- PostgreSQL -------------------------------------------------------------------------------


def _pg_sql(sql: str) -> str:
    parts = sql.split("?")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)) + parts[-1]


class _PgTx:
    def __init__(self, conn: Any) -> None:
        self.connection = conn

    async def execute(self, sql: str, *args: Any) -> int:
        status: str = await self.connection.execute(_pg_sql(sql), *args)
        count = status.rsplit(" ", 1)[-1]  # "UPDATE 3", "INSERT 0 1", "CREATE TABLE"
        return int(count) if count.isdigit() else 0

    async def fetch(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in await self.connection.fetch(_pg_sql(sql), *args)]

    async def fetchval(self, sql: str, *args: Any) -> Any:
        return await self.connection.fetchval(_pg_sql(sql), *args)


class PostgresDatabase(Database):
    """A connection pool whose sessions see only `schema` (search_path), so each service's
    tables, message-apply table included, live in its own schema of one database. Every
    session commits durably (`synchronous_commit = on`, whatever the server's default)."""

    kind = "postgres"

    def __init__(self, name: str, schema: str, pool: Any) -> None:
        self.name = name
        self.schema = schema
        self._pool = pool

    @classmethod
    async def open(
        cls, name: str, dsn: str, schema: str, *, pool_size: int = 8
    ) -> PostgresDatabase:
        import asyncpg  # type: ignore[import-untyped]  # the `postgres` extra only

        conn = await pg_connect(dsn)
        try:
            await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{pg_schema(schema)}"')
        finally:
            await conn.close()
        # Startup parameters: they outrank the server's, database's and role's defaults and
        # survive the RESET ALL with which the pool hands a connection back.
        pool = await asyncpg.create_pool(
            dsn,
            min_size=1,
            max_size=pool_size,
            server_settings={"search_path": schema, "synchronous_commit": "on"},
        )
        return cls(name, schema, pool)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._pool.acquire() as conn, conn.transaction():
            yield _PgTx(conn)

    async def apply_once(self, group: str, msg_id: str, work: Work) -> bool:
        return await apply_once_postgres(self._pool, group, msg_id, lambda conn: work(_PgTx(conn)))

    async def open_txlog(self, group: str) -> TxLog[Any]:
        txlog = AsyncpgTxLog(self._pool, group)  # in this schema: the pool's search_path
        await txlog.create_table()
        return txlog

    def tx(self, connection: Any) -> Tx:
        return _PgTx(connection)

    async def close(self) -> None:
        await self._pool.close()


def pg_schema(schema: str) -> str:
    """`schema` if it is a plain lower-case identifier (it is spliced into DDL), else ValueError."""
    if not _IDENTIFIER.match(schema):
        raise ValueError(
            f"PostgreSQL schema name {schema!r} must be lower-case letters, digits and _, "
            "starting with a letter or _"
        )
    return schema


async def pg_connect(dsn: str) -> Any:
    """A connection to `dsn`; one that cannot be made is a ConfigError naming the DSN (which
    may be the default, not given by the user) and the flag that changes it."""
    import asyncpg

    try:
        return await asyncpg.connect(dsn)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
        reason = str(error) or type(error).__name__
        raise ConfigError(
            f"PostgreSQL at {shown_dsn(dsn)} cannot be used ({reason}); start it, or name "
            "another database with --pg-dsn postgresql://user@host:port/db"
        ) from None


def shown_dsn(dsn: str) -> str:
    """`dsn` with its password masked, for messages and the demos' headers."""
    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))


async def drop_pg_schema(dsn: str, schema: str) -> None:
    conn = await pg_connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{pg_schema(schema)}" CASCADE')
    finally:
        await conn.close()


# -- where the databases live -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Storage:
    """Where a demo's services keep their databases: `<directory>/<name>.db` for SQLite, or
    schema `<prefix><name>` in the PostgreSQL database at `dsn`."""

    kind: Literal["sqlite", "postgres"]
    directory: Path | None = None
    dsn: str | None = None
    prefix: str = ""

    @classmethod
    def sqlite(cls, directory: Path) -> Storage:
        return cls("sqlite", directory=directory)

    @classmethod
    def postgres(cls, dsn: str = DEFAULT_PG_DSN, prefix: str = "") -> Storage:
        return cls("postgres", dsn=dsn, prefix=prefix)

    def describe(self, name: str) -> str:
        if self.kind == "sqlite":
            return str(self._path(name))
        assert self.dsn is not None
        default = " (the default: --pg-dsn names another)" if self.dsn == DEFAULT_PG_DSN else ""
        return f"schema {self.prefix}{name} of {shown_dsn(self.dsn)}{default}"

    async def open(self, name: str, *, fresh: bool = False) -> Database:
        """Open `name`'s database; `fresh` first deletes whatever it held."""
        if fresh:
            await self.drop(name)
        if self.kind == "sqlite":
            path = self._path(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            return await SqliteDatabase.open(name, path)
        assert self.dsn is not None
        return await PostgresDatabase.open(name, self.dsn, pg_schema(self.prefix + name))

    async def drop(self, name: str) -> None:
        if self.kind == "sqlite":
            path = self._path(name)
            for suffix in ("", "-wal", "-shm", "-journal"):
                await anyio.Path(f"{path}{suffix}").unlink(missing_ok=True)
        else:
            assert self.dsn is not None
            await drop_pg_schema(self.dsn, self.prefix + name)

    def to_args(self) -> list[str]:
        """Command-line form, for child processes (see `from_args`)."""
        if self.kind == "sqlite":
            return ["sqlite", str(self.directory)]
        return ["postgres", str(self.dsn), self.prefix]

    @classmethod
    def from_args(cls, args: Sequence[str]) -> Storage:
        if args[0] == "sqlite":
            return cls.sqlite(Path(args[1]))
        return cls.postgres(args[1], args[2] if len(args) > 2 else "")

    def _path(self, name: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{name}.db"
