"""The local side commits durably before it acks or answers COMMIT: what the databases run with.

SQLite `PRAGMA synchronous` must read 2 (FULL) and PostgreSQL `SHOW synchronous_commit` must
read `on` inside the transactions the idempotent helper and the demos' databases run; each test
first lowers the setting where a user (or a server default) could, so it can fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiosqlite
import asyncpg  # type: ignore[import-untyped]
import pytest
import pytest_asyncio

from apps.common.db import Storage, Tx
from txactors.consumer import apply_once_postgres, apply_once_sqlite
from txactors.consumer.idempotent import PgConnection

PG_DSN = os.environ.get("TXACTORS_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SQLITE_FULL = 2
SQLITE_EXTRA = 3


async def _synchronous(conn: aiosqlite.Connection) -> int:
    cursor = await conn.execute("PRAGMA synchronous")
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


# -- SQLite -------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def lax_sqlite(tmp_path: Path) -> AsyncIterator[aiosqlite.Connection]:
    """A user's connection in WAL mode with synchronous=NORMAL: durable against a process
    crash, not a power cut."""
    conn = await aiosqlite.connect(tmp_path / "user.db", isolation_level=None)
    await conn.execute("PRAGMA journal_mode=WAL")
    await conn.execute("PRAGMA synchronous=NORMAL")
    await conn.execute("CREATE TABLE account (name TEXT PRIMARY KEY, cents INTEGER)")
    await conn.execute("INSERT INTO account VALUES ('b', 0)")
    try:
        yield conn
    finally:
        await conn.close()


async def test_the_sqlite_helper_commits_with_synchronous_full(
    lax_sqlite: aiosqlite.Connection,
) -> None:
    assert await _synchronous(lax_sqlite) == 1
    seen: list[int] = []

    async def credit(conn: aiosqlite.Connection) -> None:
        seen.append(await _synchronous(conn))
        await conn.execute("UPDATE account SET cents = cents + 100 WHERE name = 'b'")

    assert await apply_once_sqlite(lax_sqlite, "bank-b", "tx1:0", credit)
    assert seen == [SQLITE_FULL]
    await lax_sqlite.execute("PRAGMA synchronous=OFF")  # lowered again by its owner
    assert await apply_once_sqlite(lax_sqlite, "bank-b", "tx2:0", credit)
    assert seen == [SQLITE_FULL, SQLITE_FULL]


async def test_the_sqlite_helper_leaves_extra_alone(lax_sqlite: aiosqlite.Connection) -> None:
    await lax_sqlite.execute("PRAGMA synchronous=EXTRA")

    async def nothing(conn: aiosqlite.Connection) -> None:
        pass

    assert await apply_once_sqlite(lax_sqlite, "bank-b", "tx1:0", nothing)
    assert await _synchronous(lax_sqlite) == 3


async def test_with_a_rollback_journal_the_sqlite_helper_commits_with_extra(
    tmp_path: Path,
) -> None:
    """FULL does not sync a rollback journal's deletion: a power cut just after the commit can
    bring the journal back and undo it (tests/integration/test_powercut.py shows it). EXTRA does."""
    conn = await aiosqlite.connect(tmp_path / "journal.db", isolation_level=None)
    try:
        await conn.execute("PRAGMA journal_mode=DELETE")
        await conn.execute("PRAGMA synchronous=FULL")
        seen: list[int] = []

        async def look(c: aiosqlite.Connection) -> None:
            seen.append(await _synchronous(c))

        assert await apply_once_sqlite(conn, "bank-b", "tx1:0", look)
        assert seen == [SQLITE_EXTRA]
    finally:
        await conn.close()


async def test_nested_the_callers_setting_decides(lax_sqlite: aiosqlite.Connection) -> None:
    """SQLite refuses to change `synchronous` inside a transaction: nested, the helper leaves
    it (and the durability of the commit) to the caller, as its docstring says."""
    await lax_sqlite.execute("BEGIN IMMEDIATE")

    async def nothing(conn: aiosqlite.Connection) -> None:
        pass

    assert await apply_once_sqlite(lax_sqlite, "bank-b", "tx1:0", nothing)
    assert await _synchronous(lax_sqlite) == 1
    await lax_sqlite.commit()


async def test_the_demo_sqlite_database_commits_with_synchronous_full(tmp_path: Path) -> None:
    storage = Storage.sqlite(tmp_path)
    db = await storage.open("bank", fresh=True)
    try:
        assert await db.fetchval("PRAGMA journal_mode") == "wal"
        async with db.transaction() as tx:
            assert await tx.fetchval("PRAGMA synchronous") == SQLITE_FULL
        await db.script(["CREATE TABLE t (id TEXT PRIMARY KEY)"])

        async def insert(tx: Tx) -> None:
            assert await tx.fetchval("PRAGMA synchronous") == SQLITE_FULL
            await tx.execute("INSERT INTO t (id) VALUES (?)", "a")

        assert await db.apply_once("g", "m1", insert)
    finally:
        await db.close()


# -- PostgreSQL ---------------------------------------------------------------------------

LAX_DSN = f"{PG_DSN}{'&' if '?' in PG_DSN else '?'}synchronous_commit=off"
"""Sessions that acknowledge a commit before its WAL is flushed, as a server default could."""


@pytest_asyncio.fixture
async def lax_pg() -> AsyncIterator[asyncpg.Connection]:
    try:
        conn = await asyncpg.connect(LAX_DSN)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL at {PG_DSN} is required for @postgres tests: {exc!r}")
    schema = f"txactors_test_{uuid.uuid4().hex[:12]}"
    try:
        await conn.execute(f"CREATE SCHEMA {schema}; SET search_path = {schema}")
        yield conn
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


@pytest.mark.postgres
async def test_the_postgres_helper_commits_with_synchronous_commit_on(
    lax_pg: asyncpg.Connection,
) -> None:
    assert await lax_pg.fetchval("SHOW synchronous_commit") == "off"
    seen: list[str] = []

    async def look(conn: PgConnection) -> None:
        seen.append(await conn.fetchval("SHOW synchronous_commit"))  # type: ignore[attr-defined]

    assert await apply_once_postgres(lax_pg, "bank-b", "tx1:0", look)
    assert seen == ["on"]
    # Only its own transaction: the session's choice is the user's.
    assert await lax_pg.fetchval("SHOW synchronous_commit") == "off"


@pytest.mark.postgres
async def test_the_demo_postgres_database_commits_with_synchronous_commit_on() -> None:
    storage = Storage.postgres(LAX_DSN, prefix=f"t{uuid.uuid4().hex[:8]}_")
    db = await storage.open("bank", fresh=True)
    try:
        for _ in range(3):  # each time through the pool (which RESETs ALL on release)
            async with db.transaction() as tx:
                assert await tx.fetchval("SHOW synchronous_commit") == "on"
        await db.script(["CREATE TABLE t (id TEXT PRIMARY KEY)"])

        async def insert(tx: Tx) -> None:
            assert await tx.fetchval("SHOW synchronous_commit") == "on"
            await tx.execute("INSERT INTO t (id) VALUES (?)", "a")

        assert await db.apply_once("g", "m1", insert)
    finally:
        await db.close()
        await storage.drop("bank")
