"""The transaction log decides check-backs by claiming: every interleaving of a local
transaction and a check-back, on SQLite, PostgreSQL (asyncpg, psycopg) and MariaDB.

The local transaction runs on instance A of the group; the check is served by another
instance B (its own connections, as another process of the group has) or by A itself.
Whatever the order, a decisive answer agrees with the local outcome: COMMIT if and only if
the business change committed.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from tests.support.roundtrips import TurnCounter, counting_proxy
from tests.support.txlogs import BACKENDS, PG_DSN, Backend, SqliteBackend, backend
from txactors.errors import RolledBackByCheck
from txactors.producer import CheckView, Decision
from txactors.producer.txlog import TxLog, retention_age, schedule_span
from txactors.wire.rules import CoordinatorConfig

pytestmark = [pytest.mark.postgres, pytest.mark.mariadb]  # required, never skipped


@pytest_asyncio.fixture(params=BACKENDS)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    opened = backend(request.param, tmp_path)
    try:
        yield opened
    finally:
        await opened.close()


def new_group() -> str:
    return f"shop-{uuid.uuid4().hex[:12]}"


async def check(txlog: TxLog[Any], txid: str) -> Decision:
    return await txlog.check(CheckView(txid=txid, group=txlog.group, check_times=0, messages=()))


async def commit_locally(db: Backend, txlog: TxLog[Any], txid: str) -> None:
    async with txlog.local() as local:
        await txlog.record(local.connection, txid)
        await db.write(local.connection, txid)
        await local.commit()


async def test_a_check_before_the_local_transaction_fences_it_off(db: Backend) -> None:
    group = new_group()
    a, b = await db.instance(group), await db.instance(group)
    txid = uuid.uuid4().hex
    assert await check(b, txid) is Decision.ROLLBACK
    with pytest.raises(RolledBackByCheck):
        await commit_locally(db, a, txid)
    assert not await db.committed(txid)
    assert [await check(a, txid), await check(b, txid)] == [Decision.ROLLBACK] * 2


async def test_a_check_while_the_local_transaction_runs_before_it_records(db: Backend) -> None:
    """The work is done, the txid not yet recorded. A database with row locks lets the check
    claim the txid at once: the record then fails and the work rolls back. SQLite's one
    writer makes the check wait for the local transaction, which then commits first."""
    group = new_group()
    a, b = await db.instance(group), await db.instance(group)
    txid = uuid.uuid4().hex
    answer: list[Decision] = []
    answered = anyio.Event()
    async with anyio.create_task_group() as tg, a.local() as local:
        await db.write(local.connection, txid)
        tg.start_soon(lambda: _append(answer, check(b, txid), answered))
        await _settled(answered, 0.5)
        try:
            await a.record(local.connection, txid)
        except RolledBackByCheck:
            pass
        else:
            await local.commit()
    committed = await db.committed(txid)
    assert answer == [Decision.COMMIT if committed else Decision.ROLLBACK]
    assert committed is isinstance(db, SqliteBackend)


@pytest.mark.parametrize("outcome", [Decision.COMMIT, Decision.ROLLBACK])
async def test_a_check_after_the_record_waits_for_the_local_outcome(
    db: Backend, outcome: Decision
) -> None:
    group = new_group()
    a, b = await db.instance(group), await db.instance(group)
    txid = uuid.uuid4().hex
    answer: list[Decision] = []
    answered = anyio.Event()
    async with anyio.create_task_group() as tg, a.local() as local:
        await a.record(local.connection, txid)
        await db.write(local.connection, txid)
        tg.start_soon(lambda: _append(answer, check(b, txid), answered))
        await _settled(answered, 0.5)
        assert answer == [], "the check answered before the local transaction ended"
        if outcome is Decision.COMMIT:
            await local.commit()
    assert answer == [outcome]
    assert await db.committed(txid) is (outcome is Decision.COMMIT)
    assert [await check(a, txid), await check(b, txid)] == [outcome] * 2


async def test_a_check_after_the_commit_says_commit(db: Backend) -> None:
    group = new_group()
    a, b = await db.instance(group), await db.instance(group)
    txid = uuid.uuid4().hex
    await commit_locally(db, a, txid)
    assert [await check(a, txid), await check(b, txid), await check(b, txid)] == [
        Decision.COMMIT
    ] * 3


async def test_a_check_after_a_rollback_says_rollback_and_fences_a_retry(db: Backend) -> None:
    group = new_group()
    a, b = await db.instance(group), await db.instance(group)
    txid = uuid.uuid4().hex
    with pytest.raises(ZeroDivisionError):
        async with a.local() as local:
            await a.record(local.connection, txid)
            await db.write(local.connection, txid)
            raise ZeroDivisionError
    assert await check(b, txid) is Decision.ROLLBACK
    with pytest.raises(RolledBackByCheck):  # the same txid can never commit now
        await commit_locally(db, a, txid)
    assert not await db.committed(txid)


async def test_groups_do_not_answer_for_each_other(db: Backend) -> None:
    shop, bank = await db.instance(new_group()), await db.instance(new_group())
    txid = uuid.uuid4().hex
    await commit_locally(db, shop, txid)
    assert await check(bank, txid) is Decision.ROLLBACK
    assert await check(shop, txid) is Decision.COMMIT


async def test_retention_removes_only_rows_past_the_cutoff(db: Backend) -> None:
    txlog = await db.instance(new_group())
    old, young = uuid.uuid4().hex, uuid.uuid4().hex
    await commit_locally(db, txlog, old)
    assert await check(txlog, uuid.uuid4().hex) is Decision.ROLLBACK  # a claimed row
    cutoff = await _now_after_a_tick()
    await commit_locally(db, txlog, young)
    assert await txlog.forget_before(cutoff) == 2  # this group's: `old` and the claim
    assert await txlog.lookup(old) is None
    assert await txlog.lookup(young) == "committed"
    assert await txlog.prune(CoordinatorConfig()) == 0  # nothing is 73 hours old


async def test_pruning_follows_the_coordinators_retention(db: Backend) -> None:
    """With a half retention of 0.2 s, a row is prunable 0.3 s after it was written; other
    groups' rows are theirs to prune."""
    txlog, other = await db.instance(new_group()), await db.instance(new_group())
    config = CoordinatorConfig(
        transaction_timeout=0.1, half_retention=0.2, check_answer_timeout=0.1
    )
    others = uuid.uuid4().hex
    await commit_locally(db, other, others)
    old = uuid.uuid4().hex
    await commit_locally(db, txlog, old)
    assert await txlog.prune(config, clock_margin=0) == 0  # young: a check may still come
    await anyio.sleep(0.35)
    young = uuid.uuid4().hex
    await commit_locally(db, txlog, young)
    with anyio.move_on_after(0.1):  # a few rounds, while `young` is still young
        await txlog.prune_forever(config, every=0.02, clock_margin=0)
    assert await txlog.lookup(old) is None
    assert await txlog.lookup(young) == "committed"
    assert await other.lookup(others) == "committed"


# -- the database cannot answer: UNKNOWN -----------------------------------------------


async def test_a_locked_sqlite_database_answers_unknown(tmp_path: Path) -> None:
    db = SqliteBackend(tmp_path / "locked.db", busy_timeout=0.1)
    try:
        group = new_group()
        a, b = await db.instance(group), await db.instance(group)
        txid = uuid.uuid4().hex
        async with a.local() as local:
            await a.record(local.connection, txid)
            assert await check(b, txid) is Decision.UNKNOWN  # A holds the write lock
            await local.commit()
        assert await check(b, txid) is Decision.COMMIT
    finally:
        await db.close()


async def test_an_unreachable_server_answers_unknown() -> None:
    import asyncpg  # type: ignore[import-untyped]
    import psycopg_pool
    from sqlalchemy.ext.asyncio import create_async_engine

    from txactors.producer.txlog.alchemy import SqlAlchemyTxLog
    from txactors.producer.txlog.pg_asyncpg import AsyncpgTxLog
    from txactors.producer.txlog.pg_psycopg import PsycopgTxLog

    port = 1  # nothing listens there
    pg_pool = await asyncpg.create_pool(f"postgresql://postgres@127.0.0.1:{port}/test", min_size=0)
    ps_pool = psycopg_pool.AsyncConnectionPool(
        f"host=127.0.0.1 port={port} user=postgres dbname=test", min_size=1, open=False, timeout=1
    )
    await ps_pool.open(wait=False)
    engine = create_async_engine(f"mysql+asyncmy://root@127.0.0.1:{port}/test")
    try:
        for txlog in (
            AsyncpgTxLog(pg_pool, "shop"),
            PsycopgTxLog(ps_pool, "shop"),
            SqlAlchemyTxLog(engine, "shop"),
        ):
            assert await check(txlog, uuid.uuid4().hex) is Decision.UNKNOWN, txlog
    finally:
        await pg_pool.close()
        await ps_pool.close()
        await engine.dispose()


# -- retention arithmetic ---------------------------------------------------------------


def test_the_retention_age_outlasts_the_half_retention() -> None:
    config = CoordinatorConfig()
    assert retention_age(config) == config.half_retention + config.check_answer_timeout + 3600
    assert retention_age(config, clock_margin=0) > config.half_retention
    with pytest.raises(ValueError, match="clock_margin"):
        retention_age(config, clock_margin=-1)


@given(
    check_max=st.integers(1, 40),
    interval=st.floats(0.1, 100),
    backoff=st.floats(1.0, 4.0),
    half_retention=st.floats(10, 1e6),
)
def test_the_check_schedule_never_outlasts_the_retention_age(
    check_max: int, interval: float, backoff: float, half_retention: float
) -> None:
    config = CoordinatorConfig(
        check_max=check_max,
        check_interval=interval,
        check_interval_max=interval * 8,
        check_backoff=backoff,
        half_retention=half_retention,
    )
    span = schedule_span(config)
    assert min(config.max_immunity, config.half_retention) < span
    assert span <= retention_age(config, clock_margin=0)


# -- helpers ------------------------------------------------------------------------------


async def _append(answers: list[Decision], answer: Any, answered: anyio.Event) -> None:
    answers.append(await answer)
    answered.set()


async def _settled(answered: anyio.Event, wait: float) -> None:
    """Until the check answered, or `wait` seconds (it is waiting for a lock)."""
    with anyio.move_on_after(wait):
        await answered.wait()


async def _now_after_a_tick() -> float:
    import time

    await anyio.sleep(0.05)
    now = time.time()
    await anyio.sleep(0.05)
    return now


# -- PostgreSQL: round trips and durability of the log's own statements -------------------


@asynccontextmanager
async def pg_log_through_proxy(driver: str) -> AsyncIterator[tuple[TxLog[Any], TurnCounter]]:
    """`driver`'s log on one connection through a round-trip counter, in a session whose
    default is `synchronous_commit = off` (as a server, database or role default can be)."""
    from urllib.parse import urlsplit

    import asyncpg  # type: ignore[import-untyped]
    import psycopg_pool

    from txactors.producer.txlog.pg_asyncpg import AsyncpgTxLog
    from txactors.producer.txlog.pg_psycopg import PsycopgTxLog

    server = urlsplit(PG_DSN)
    async with counting_proxy(server.hostname or "127.0.0.1", server.port or 5432) as (port, seen):
        user, database = server.username or "postgres", server.path.lstrip("/")
        txlog: TxLog[Any]
        if driver == "asyncpg":
            pool = await asyncpg.create_pool(
                f"postgresql://{user}@127.0.0.1:{port}/{database}",
                min_size=1,
                max_size=1,
                server_settings={"synchronous_commit": "off"},
            )
            txlog = AsyncpgTxLog(pool, new_group())
            close = pool.close
        else:
            ps_pool = psycopg_pool.AsyncConnectionPool(
                f"host=127.0.0.1 port={port} user={user} dbname={database} "
                "options='-c synchronous_commit=off'",
                min_size=1,
                max_size=1,
                open=False,
            )
            await ps_pool.open()
            txlog = PsycopgTxLog(ps_pool, new_group())
            close = ps_pool.close
        try:
            await txlog.create_table()
            yield txlog, seen
        finally:
            await close()


async def show_synchronous_commit(conn: Any) -> str:
    if hasattr(conn, "fetchval"):  # asyncpg
        return str(await conn.fetchval("SHOW synchronous_commit"))
    cursor = await conn.execute("SHOW synchronous_commit")
    row = await cursor.fetchone()
    return str(row[0])


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_postgres_local_transaction_is_four_round_trips(driver: str) -> None:
    """BEGIN, the log row (which makes the commit durable too), the work, COMMIT: every
    round trip of the log's own is one the caller waits for, at any concurrency. (Giving
    the connection back to the pool is the pool's: asyncpg's resets it, one more.)"""
    async with pg_log_through_proxy(driver) as (txlog, seen):

        async def local_transaction() -> int:
            before = seen.turns
            async with txlog.local() as local:
                await txlog.record(local.connection, uuid.uuid4().hex)
                await local.connection.execute("SELECT 1")  # the user's work
                await local.commit()
                turns = seen.turns - before  # not the pool's reset after
            return turns

        async def claim() -> int:
            before = seen.turns
            assert await txlog.claim(uuid.uuid4().hex)
            return seen.turns - before

        await local_transaction()  # the driver prepares each statement once
        await claim()
        assert await local_transaction() == 4
        # A check-back's claim: one statement (its own transaction), then the pool's reset;
        # psycopg's BEGIN, the statement, COMMIT.
        assert await claim() == (2 if driver == "asyncpg" else 3)


@pytest.mark.parametrize("driver", ["asyncpg", "psycopg"])
async def test_a_postgres_record_makes_its_transaction_durable(driver: str) -> None:
    """The session says `synchronous_commit = off`; the transaction that records a txid
    commits with `on` all the same, and only that transaction."""
    async with pg_log_through_proxy(driver) as (txlog, _), txlog.local() as local:
        assert await show_synchronous_commit(local.connection) == "off"
        await txlog.record(local.connection, uuid.uuid4().hex)
        assert await show_synchronous_commit(local.connection) == "on"
        await local.commit()
        assert await show_synchronous_commit(local.connection) == "off"


async def test_a_postgres_record_through_sqlalchemy_makes_its_transaction_durable() -> None:
    """The same promise through SQLAlchemy's engine: a session default of `off` does not
    reach the transaction that records a txid, nor a check-back's claim."""
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from tests.support.txlogs import PG_ALCHEMY_URL
    from txactors.producer.txlog.alchemy import SqlAlchemyTxLog

    engine = create_async_engine(
        PG_ALCHEMY_URL,
        poolclass=sa.NullPool,
        connect_args={"server_settings": {"synchronous_commit": "off"}},
    )
    try:
        txlog = SqlAlchemyTxLog(engine, new_group())
        await txlog.create_table()
        show = sa.text("SHOW synchronous_commit")
        async with txlog.local() as local:
            assert (await local.connection.execute(show)).scalar_one() == "off"
            await txlog.record(local.connection, uuid.uuid4().hex)
            assert (await local.connection.execute(show)).scalar_one() == "on"
            await local.commit()
        assert await txlog.claim(uuid.uuid4().hex)
        txid = uuid.uuid4().hex
        async with txlog.local() as local:
            await txlog.record(local.connection, txid)
            await local.commit()
        assert await check(txlog, txid) == Decision.COMMIT
    finally:
        await engine.dispose()


@asynccontextmanager
async def fresh_database(kind: str, directory: Path) -> AsyncIterator[str]:
    """The URL of a database made for the test alone (dropped after): the log's table is
    not there yet, as on a first deployment."""
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from tests.support.txlogs import MARIADB_URL, PG_ALCHEMY_URL

    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{directory / 'fresh.db'}"
        return
    server = MARIADB_URL if kind == "mariadb" else PG_ALCHEMY_URL
    name = f"txlog_ddl_{uuid.uuid4().hex[:12]}"
    admin = create_async_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        async with admin.connect() as conn:
            await conn.execute(sa.text(f"CREATE DATABASE {name}"))
        try:
            yield server.rsplit("/", 1)[0] + f"/{name}"
        finally:
            async with admin.connect() as conn:
                await conn.execute(sa.text(f"DROP DATABASE {name}"))
    finally:
        await admin.dispose()


@pytest.mark.parametrize("kind", ["mariadb", "postgresql", "sqlite"])
async def test_instances_creating_the_table_at_once_all_succeed(kind: str, tmp_path: Path) -> None:
    """Twelve instances start together on a fresh database, each calling `create_table()`:
    none fails on another's CREATE (MariaDB: `1050 Table ... already exists`), and the
    table and its index are there once."""
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from txactors.producer.txlog.alchemy import SqlAlchemyTxLog
    from txactors.producer.txlog.schema import INDEX, TABLE

    async with fresh_database(kind, tmp_path) as url:
        engines = [create_async_engine(url, poolclass=sa.NullPool) for _ in range(12)]
        failures: list[BaseException] = []

        async def start(engine: Any) -> None:
            try:
                await SqlAlchemyTxLog(engine, new_group()).create_table()
            except Exception as error:
                failures.append(error)

        try:
            async with anyio.create_task_group() as tg:
                for engine in engines:
                    tg.start_soon(start, engine)
            assert failures == []
            async with engines[0].connect() as conn:
                indexes = await conn.run_sync(lambda c: sa.inspect(c).get_indexes(TABLE))
            assert [index["name"] for index in indexes] == [INDEX]
        finally:
            for engine in engines:
                await engine.dispose()
