"""The public API raises what it documents: one error raised leaves each entry point as
itself, never inside an `ExceptionGroup` from the task groups it runs, so `except
PrepareFailed` (or the caller's own class) catches it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from nats.aio.client import Client

from tests.support.txlogs import SqliteBackend
from txactors import Consumer, TxApp
from txactors.consumer.message import ConsumedMessage
from txactors.coordinator.service import run_coordinator
from txactors.errors import ConfigError, PrepareFailed
from txactors.producer import Decision, TransactionProducer, TxMessage


class YourError(Exception):
    """An error of the caller's own, raised inside a block of ours."""


async def nothing(message: ConsumedMessage) -> None:
    pass


@pytest_asyncio.fixture
async def sqlite(tmp_path: Path) -> AsyncIterator[SqliteBackend]:
    db = SqliteBackend(tmp_path / "shop.db")
    try:
        yield db
    finally:
        await db.close()


async def test_transaction_producer_raises_prepare_failed_as_itself(private_nc: Client) -> None:
    """No coordinator runs: the send fails, and the producer's block lets it out alone."""
    with pytest.raises(PrepareFailed, match="no coordinator"):
        async with TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT) as p:
            await p.send_in_transaction(TxMessage("orders", b"x"), lambda m, a: Decision.COMMIT)


async def test_txlog_send_in_transaction_raises_what_failed_as_itself(
    private_nc: Client, sqlite: SqliteBackend
) -> None:
    txlog = await sqlite.instance("shop")
    with pytest.raises(PrepareFailed, match="no coordinator"):
        async with TransactionProducer(private_nc, "shop", txlog.check) as producer:
            await txlog.send_in_transaction(producer, TxMessage("orders", b"x"), sqlite.write)

    async def work(conn: Any, txid: str) -> None:
        raise YourError(txid)

    with pytest.raises(YourError):
        async with (
            run_coordinator(private_nc),
            TransactionProducer(private_nc, "shop", txlog.check) as producer,
        ):
            await txlog.send_in_transaction(producer, TxMessage("orders", b"x"), work)


async def test_consumer_raises_what_failed_as_itself(private_nc: Client) -> None:
    with pytest.raises(ConfigError, match="needs 3 replicas"):  # its start refused
        async with Consumer(private_nc, "orders", "audit", nothing, replicas=3):
            pass
    with pytest.raises(YourError):
        async with Consumer(private_nc, "orders", "audit", nothing):
            raise YourError


async def test_txapp_raises_what_failed_as_itself(private_nc: Client) -> None:
    app = TxApp("svc")

    @app.consumer("orders", group="audit")
    async def audit(message: ConsumedMessage) -> None:
        pass

    with pytest.raises(YourError):
        async with app.running(private_nc, pull_expires=0.1):
            raise YourError


async def test_run_coordinator_raises_what_failed_as_itself(private_nc: Client) -> None:
    with pytest.raises(YourError):
        async with run_coordinator(private_nc):
            raise YourError
