"""The demo apps' shared helpers: fault parsing, one database interface over two engines."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from apps.common.db import DEFAULT_PG_DSN, Database, Storage, Tx, pg_schema
from apps.common.faults import Fault, parse_faults
from apps.common.options import Backend, default_data_dir, storage_of
from apps.common.report import Check, Reconciliation
from txactors.errors import ConfigError


def test_parse_faults_accepts_all_none_and_lists() -> None:
    assert parse_faults("all") == frozenset(Fault)
    assert parse_faults("none") == parse_faults("") == frozenset()
    assert parse_faults("lost-end, duplicate") == {Fault.LOST_END, Fault.DUPLICATE}


def test_parse_faults_names_the_choices_for_an_unknown_fault() -> None:
    with pytest.raises(ValueError, match=r"unknown fault 'meteor'.*local-failure"):
        parse_faults("duplicate,meteor")


def test_the_default_sqlite_directory_is_the_users_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a fixed path in the shared temp directory: each user's demo has its own books."""
    monkeypatch.setenv("HOME", str(tmp_path / "alice"))
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    alice = tmp_path / "alice" / ".local" / "share" / "txactors" / "transfer"
    assert default_data_dir("transfer") == alice
    assert storage_of("transfer", Backend.SQLITE).describe("alipay").startswith(str(alice))
    xdg = {"XDG_DATA_HOME": str(tmp_path / "data")}
    assert default_data_dir("orders", xdg) == tmp_path / "data" / "txactors" / "orders"
    assert default_data_dir("orders", {"XDG_DATA_HOME": "relative"}).is_relative_to(
        tmp_path / "alice"
    ), "a relative XDG_DATA_HOME is ignored, as the XDG spec says"


def test_the_postgres_storage_says_which_dsn_it_uses_default_or_not() -> None:
    """`--db postgres` without `--pg-dsn` runs on a default DSN: the header says so."""
    default = storage_of("orders", Backend.POSTGRES).describe("cart")
    said = f"schema orders_cart of {DEFAULT_PG_DSN} (the default: --pg-dsn names another)"
    assert default == said
    given = storage_of("orders", Backend.POSTGRES, pg_dsn="postgresql://me:pw@db:5433/shop")
    assert given.describe("cart") == "schema orders_cart of postgresql://me:***@db:5433/shop"


async def test_a_postgres_that_cannot_be_used_is_named_with_the_flag_to_change_it() -> None:
    storage = Storage.postgres("postgresql://postgres:secret@127.0.0.1:1/test", prefix="t_")
    with pytest.raises(ConfigError) as refused:
        await storage.open("alipay", fresh=True)
    said = str(refused.value)
    assert said.startswith("PostgreSQL at postgresql://postgres:***@127.0.0.1:1/test cannot be")
    assert "--pg-dsn" in said and "secret" not in said


def test_schema_names_are_plain_identifiers() -> None:
    assert pg_schema("t1_alipay") == "t1_alipay"
    with pytest.raises(ValueError, match="schema name"):
        pg_schema('x"; DROP TABLE y; --')


def test_a_reconciliation_is_ok_only_when_every_check_is() -> None:
    good = Check(section="s", name="n", expected=2, actual=2)
    reached = Check(section="s", name="n", expected=2, actual=3, at_least=True)
    bad = Check(section="s", name="n", expected=2, actual=1)
    assert Reconciliation(app="a", checks=[good, reached]).ok
    result = Reconciliation(app="a", checks=[good, bad])
    assert not result.ok and result.mismatches == [bad]


@asynccontextmanager
async def opened(storage: Storage) -> AsyncIterator[Database]:
    db = await storage.open("svc", fresh=True)
    try:
        yield db
    finally:
        await db.close()
        await storage.drop("svc")


async def exercise(db: Database) -> None:
    await db.script(["CREATE TABLE t (id TEXT PRIMARY KEY, n BIGINT NOT NULL)"])
    async with db.transaction() as tx:
        assert await tx.execute("INSERT INTO t (id, n) VALUES (?, ?)", "a", 1) == 1
    with pytest.raises(RuntimeError):
        async with db.transaction() as tx:
            await tx.execute("UPDATE t SET n = n + ? WHERE id = ?", 10, "a")
            raise RuntimeError("rolls back")
    assert await db.fetchval("SELECT n FROM t WHERE id = ?", "a") == 1
    assert await db.fetchval("SELECT n FROM t WHERE id = ?", "missing") is None

    async def bump(tx: Tx) -> None:
        await tx.execute("UPDATE t SET n = n + 1 WHERE id = ?", "a")

    assert await db.apply_once("g", "m1", bump)
    assert not await db.apply_once("g", "m1", bump)  # a redelivery changes nothing
    assert await db.fetch("SELECT id, n FROM t") == [("a", 2)]


async def test_sqlite_database(tmp_path: Path) -> None:
    async with opened(Storage.sqlite(tmp_path)) as db:
        await exercise(db)


@pytest.mark.postgres
async def test_postgres_database_lives_in_its_own_schema() -> None:
    storage = Storage.postgres(DEFAULT_PG_DSN, prefix=f"t{uuid.uuid4().hex[:8]}_")
    async with opened(storage) as db:
        await exercise(db)


async def test_a_transaction_cancelled_while_beginning_leaves_the_sqlite_connection_usable(
    tmp_path: Path,
) -> None:
    async with opened(Storage.sqlite(tmp_path)) as db:
        async with db.transaction() as tx:
            await tx.execute("CREATE TABLE t (n INTEGER)")
        for attempt in range(200):  # cancelled at varying points, the BEGIN among them
            with anyio.move_on_after(attempt * 0.00002):
                async with db.transaction() as tx:
                    await tx.execute("INSERT INTO t VALUES (1)")
        async with db.transaction() as tx:
            await tx.execute("INSERT INTO t VALUES (2)")
            rows = await tx.fetch("SELECT n FROM t WHERE n = 2")
        # (A commit cancelled while running may still land, as in any database; what must
        # not happen is a connection left inside a transaction nobody will end.)
        assert rows == [(2,)]
