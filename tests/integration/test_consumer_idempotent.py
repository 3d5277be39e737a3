"""The message apply table on SQLite and PostgreSQL: once applied, never again; all or nothing.

The PostgreSQL tests need the server on 127.0.0.1:5432 (TXACTORS_TEST_PG_DSN overrides the
DSN); they fail, not skip, when it is missing. Each test works in its own schema, dropped after.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiosqlite
import anyio
import asyncpg
import pytest
import pytest_asyncio

from tests.support.wait import eventually
from txactors.consumer import apply_once_postgres, apply_once_sqlite
from txactors.consumer.idempotent import PgConnection

PG_DSN = os.environ.get("TXACTORS_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


class Boom(Exception):
    pass


# -- SQLite -------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def sqlite_db(tmp_path: Path) -> AsyncIterator[aiosqlite.Connection]:
    async with aiosqlite.connect(tmp_path / "bank.db") as conn:
        await conn.execute("CREATE TABLE account (name TEXT PRIMARY KEY, cents INTEGER)")
        await conn.execute("INSERT INTO account VALUES ('b', 0)")
        await conn.commit()
        yield conn


async def credit_sqlite(conn: aiosqlite.Connection, cents: int = 100) -> None:
    await conn.execute("UPDATE account SET cents = cents + ? WHERE name = 'b'", (cents,))


async def balance_sqlite(conn: aiosqlite.Connection) -> int:
    async with conn.execute("SELECT cents FROM account WHERE name = 'b'") as cursor:
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def test_sqlite_redelivery_applies_once(sqlite_db: aiosqlite.Connection) -> None:
    assert await apply_once_sqlite(sqlite_db, "bank-b", "tx1:0", credit_sqlite) is True
    assert await apply_once_sqlite(sqlite_db, "bank-b", "tx1:0", credit_sqlite) is False
    assert await balance_sqlite(sqlite_db) == 100
    # another message, and the same message for another group, are separate
    assert await apply_once_sqlite(sqlite_db, "bank-b", "tx1:1", credit_sqlite) is True
    assert await apply_once_sqlite(sqlite_db, "audit", "tx1:0", credit_sqlite) is True
    assert await balance_sqlite(sqlite_db) == 300
    assert not sqlite_db.in_transaction


async def test_sqlite_failed_work_rolls_back_the_record(sqlite_db: aiosqlite.Connection) -> None:
    async def fail_after_credit(conn: aiosqlite.Connection) -> None:
        await credit_sqlite(conn)
        raise Boom

    with pytest.raises(Boom):
        await apply_once_sqlite(sqlite_db, "bank-b", "tx2:0", fail_after_credit)
    assert await balance_sqlite(sqlite_db) == 0
    assert not sqlite_db.in_transaction
    # the retry applies it: the failed attempt left no apply record behind
    assert await apply_once_sqlite(sqlite_db, "bank-b", "tx2:0", credit_sqlite) is True
    assert await balance_sqlite(sqlite_db) == 100


async def test_sqlite_concurrent_redeliveries_apply_once(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    async with aiosqlite.connect(path) as setup:
        await setup.execute("CREATE TABLE account (name TEXT PRIMARY KEY, cents INTEGER)")
        await setup.execute("INSERT INTO account VALUES ('b', 0)")
        await setup.commit()
    results: list[bool] = []

    async def slow_credit(conn: aiosqlite.Connection) -> None:
        await credit_sqlite(conn)
        await anyio.sleep(0.05)  # the scenario: a slow credit widens the race window

    async def deliver(conn: aiosqlite.Connection) -> None:
        results.append(await apply_once_sqlite(conn, "bank-b", "tx3:0", slow_credit))

    # two handlers sharing a connection, and one on a second connection (another process)
    async with aiosqlite.connect(path, timeout=5) as one, aiosqlite.connect(path, timeout=5) as two:
        async with anyio.create_task_group() as tg:
            tg.start_soon(deliver, one)
            tg.start_soon(deliver, one)
            tg.start_soon(deliver, two)
        assert sorted(results) == [False, False, True]
        assert await balance_sqlite(one) == 100


async def test_sqlite_nests_in_the_callers_transaction(sqlite_db: aiosqlite.Connection) -> None:
    await sqlite_db.execute("INSERT INTO account VALUES ('c', 5)")  # opens a transaction
    assert sqlite_db.in_transaction
    assert await apply_once_sqlite(sqlite_db, "bank-b", "tx4:0", credit_sqlite) is True
    assert await apply_once_sqlite(sqlite_db, "bank-b", "tx4:0", credit_sqlite) is False
    assert sqlite_db.in_transaction  # the caller decides
    await sqlite_db.rollback()
    assert await balance_sqlite(sqlite_db) == 0
    assert await apply_once_sqlite(sqlite_db, "bank-b", "tx4:0", credit_sqlite) is True


# -- PostgreSQL ---------------------------------------------------------------------------


@pytest_asyncio.fixture
async def pg_schema() -> AsyncIterator[str]:
    """A throwaway schema with an account table; dropped after the test."""
    schema = f"txactors_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = await asyncpg.connect(PG_DSN)
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL at {PG_DSN} is required for @postgres tests: {exc!r}")
    try:
        await admin.execute(f"CREATE SCHEMA {schema}")
        await admin.execute(f"CREATE TABLE {schema}.account (name TEXT PRIMARY KEY, cents BIGINT)")
        await admin.execute(f"INSERT INTO {schema}.account VALUES ('b', 0)")
        yield schema
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.close()


async def pg_connect(schema: str) -> asyncpg.Connection:
    return await asyncpg.connect(PG_DSN, server_settings={"search_path": schema})


async def credit_pg(conn: PgConnection) -> None:
    await conn.execute("UPDATE account SET cents = cents + 100 WHERE name = 'b'")


async def balance_pg(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT cents FROM account WHERE name = 'b'"))


@pytest.mark.postgres
async def test_postgres_redelivery_applies_once(pg_schema: str) -> None:
    conn = await pg_connect(pg_schema)
    try:
        assert await apply_once_postgres(conn, "bank-b", "tx1:0", credit_pg) is True
        assert await apply_once_postgres(conn, "bank-b", "tx1:0", credit_pg) is False
        assert await apply_once_postgres(conn, "audit", "tx1:0", credit_pg) is True
        assert await balance_pg(conn) == 200
        rows = await conn.fetch("SELECT consumer_group, msg_id FROM message_apply ORDER BY 1")
        assert [tuple(r) for r in rows] == [("audit", "tx1:0"), ("bank-b", "tx1:0")]
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_postgres_failed_work_rolls_back_the_record(pg_schema: str) -> None:
    conn = await pg_connect(pg_schema)

    async def fail_after_credit(c: PgConnection) -> None:
        await credit_pg(c)
        raise Boom

    try:
        with pytest.raises(Boom):
            await apply_once_postgres(conn, "bank-b", "tx2:0", fail_after_credit)
        assert await balance_pg(conn) == 0
        assert await conn.fetchval("SELECT count(*) FROM message_apply") == 0
        assert await apply_once_postgres(conn, "bank-b", "tx2:0", credit_pg) is True
        assert await balance_pg(conn) == 100
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_postgres_concurrent_redeliveries_apply_once(pg_schema: str) -> None:
    pool = await asyncpg.create_pool(
        PG_DSN, min_size=4, max_size=4, server_settings={"search_path": pg_schema}
    )
    results: list[bool] = []

    async def slow_credit(c: PgConnection) -> None:
        await credit_pg(c)
        await anyio.sleep(0.05)  # the scenario: a slow credit; the others block meanwhile

    async def deliver() -> None:
        results.append(await apply_once_postgres(pool, "bank-b", "tx3:0", slow_credit))

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(deliver)
        assert sorted(results) == [False, False, False, True]
        async with pool.acquire() as conn:
            assert await balance_pg(conn) == 100
    finally:
        await pool.close()


@pytest.mark.postgres
async def test_postgres_concurrent_attempt_after_a_rollback_applies(pg_schema: str) -> None:
    first_in = anyio.Event()
    conn_a, conn_b = await pg_connect(pg_schema), await pg_connect(pg_schema)
    outcomes: dict[str, object] = {}

    async def fail_slowly(c: PgConnection) -> None:
        await credit_pg(c)
        first_in.set()

        async def b_waits_for() -> str | None:
            await c.execute("SELECT pg_stat_clear_snapshot()")  # fresh within a transaction
            query = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1"
            return await c.fetchval(query, conn_b.get_server_pid())  # type: ignore[no-any-return]

        await eventually(
            b_waits_for, until=lambda kind: kind == "Lock", what="b waits on our apply record"
        )
        raise Boom

    async def attempt_a() -> None:
        with pytest.raises(Boom):
            await apply_once_postgres(conn_a, "bank-b", "tx5:0", fail_slowly)
        outcomes["a"] = "failed"

    async def attempt_b() -> None:
        await first_in.wait()
        outcomes["b"] = await apply_once_postgres(conn_b, "bank-b", "tx5:0", credit_pg)

    try:
        await apply_once_postgres(conn_b, "bank-b", "warm-up", credit_pg)  # table exists
        async with anyio.create_task_group() as tg:
            tg.start_soon(attempt_a)
            tg.start_soon(attempt_b)
        assert outcomes == {"a": "failed", "b": True}
        assert await balance_pg(conn_a) == 200  # warm-up + b
    finally:
        await conn_a.close()
        await conn_b.close()
