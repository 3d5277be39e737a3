"""A request lost on its way to the coordinator (its connection dropped with a node) costs
the caller a fraction of a second, not its whole timeout; a merely slow one is never doubled
into a failure.

Against a real coordinator. A lost request is made by dropping the producer connection's
publish of it; a slow one by holding the partition's half write.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
import pytest_asyncio
from nats.aio.client import Client

from tests.support.servers import MakeNatsServer
from tests.support.txn import topic_ids
from tests.support.wait import eventually
from txactors.coordinator.service import run_coordinator
from txactors.nats.client import connect
from txactors.nats.writer import PipelinedWriter, _Batch
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout

TIMEOUT = 10.0
"""The producer's request timeout: what a lost request cost before."""


@pytest_asyncio.fixture
async def clients(make_nats_server: MakeNatsServer) -> AsyncIterator[tuple[Client, Client]]:
    """The coordinator's connection and the producer's, to a server of this test's own."""
    server = await make_nats_server()
    coordinator, producer = await connect(server.url), await connect(server.url)
    try:
        yield coordinator, producer
    finally:
        await producer.close()
        await coordinator.close()


async def rollback(view: CheckView) -> Decision:
    return Decision.ROLLBACK


def lose_first(nc: Client, monkeypatch: pytest.MonkeyPatch, prefix: str) -> list[str]:
    """The connection's first publish to a subject starting with `prefix` never leaves it;
    returns the subjects of every publish to such a subject, the lost one first."""
    lost: list[str] = []
    publish = nc.publish

    async def losing(subject: str, payload: bytes = b"", *args: Any, **kwargs: Any) -> None:
        if subject.startswith(prefix):
            lost.append(subject)
            if len(lost) == 1:
                return
        await publish(subject, payload, *args, **kwargs)

    monkeypatch.setattr(nc, "publish", losing)
    return lost


@pytest.mark.parametrize("verb", ["prepare", "end"])
async def test_a_lost_request_is_sent_again_long_before_its_timeout(
    clients: tuple[Client, Client], monkeypatch: pytest.MonkeyPatch, verb: str
) -> None:
    private_nc, producer_nc = clients
    async with run_coordinator(private_nc):
        async with TransactionProducer(
            producer_nc, "shop", rollback, request_timeout=TIMEOUT
        ) as producer:
            await producer.send_in_transaction(TxMessage("orders", b"warm-up"), _commit)
            lost = lose_first(producer_nc, monkeypatch, f"txn.coord.0.{verb}.")
            started = time.monotonic()
            result = await producer.send_in_transaction(TxMessage("orders", b"once"), _commit)
            took = time.monotonic() - started
            # The lost request, answered through its copy, holds the link's window no
            # longer: the next ones go at once and are answered as sent, never again.
            later = time.monotonic()
            for n in range(5):
                await producer.send_in_transaction(TxMessage("orders", b"%d" % n), _commit)
            later = time.monotonic() - later
        assert took < TIMEOUT / 4, f"the lost {verb} held the caller {took:.2f}s"
        assert result.state == "committed", "confirmed, not left to the check-back"
        assert len(lost) == 1 + 1 + 5, f"the lost {verb}, its copy, and one per later call"
        # Held behind the lost request, each later call would wait for its own copy.
        assert later < 1.0, f"five later transactions took {later:.2f}s"
        ids = await eventually(lambda: topic_ids(private_nc, "orders"), until=lambda i: len(i) == 7)
        assert f"{result.txid}:0" in ids and len(ids) == 7, "each published once"


async def test_a_first_prepare_merely_slow_is_answered_though_its_copy_was_refused(
    clients: tuple[Client, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy reaches the coordinator while the first prepare's halves are being written:
    refused `conflict` (the first arrived), the caller waits on for the first's answer."""
    held = anyio.Event()
    issue = PipelinedWriter._issue
    slowed: list[int] = []

    async def slow(writer: PipelinedWriter, batch: _Batch) -> bool:
        if batch.slots[0].append.stream == layout.log_stream(0) and len(slowed) == 1:
            slowed.append(1)
            await held.wait()
        return await issue(writer, batch)

    private_nc, producer_nc = clients
    async with run_coordinator(private_nc):
        async with TransactionProducer(
            producer_nc, "shop", rollback, request_timeout=TIMEOUT
        ) as producer:
            await producer.send_in_transaction(TxMessage("orders", b"warm-up"), _commit)
            slowed.append(0)
            monkeypatch.setattr(PipelinedWriter, "_issue", slow)
            sent: list[str] = []
            publish = producer_nc.publish

            async def counting(subject: str, payload: bytes = b"", *a: Any, **k: Any) -> None:
                if subject.startswith("txn.coord.0.prepare."):
                    sent.append(subject)
                await publish(subject, payload, *a, **k)

            monkeypatch.setattr(producer_nc, "publish", counting)
            async with anyio.create_task_group() as tasks:
                results: list[Any] = []

                async def send() -> None:
                    results.append(
                        await producer.send_in_transaction(TxMessage("orders", b"slow"), _commit)
                    )

                tasks.start_soon(send)
                await eventually(lambda: len(sent) == 2, what="the prepare sent again")
                held.set()
        [result] = results
        assert result.state == "committed"
        ids = await eventually(lambda: topic_ids(private_nc, "orders"), until=lambda i: len(i) == 2)
        assert f"{result.txid}:0" in ids


async def _commit(message: Any, arg: Any) -> Decision:
    return Decision.COMMIT


async def test_a_first_prepare_overtaken_by_its_copy_is_answered_with_the_copys_receipt(
    clients: tuple[Client, Client], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first prepare, delayed on its way, arrives while its copy's halves are being
    written: refused `conflict` at once (the copy arrived), the caller waits for, and takes,
    the copy's answer."""
    private_nc, producer_nc = clients
    gate = anyio.Event()
    held: list[int] = []
    issue = PipelinedWriter._issue

    async def holding(writer: PipelinedWriter, batch: _Batch) -> bool:
        if batch.slots[0].append.stream == layout.log_stream(0) and not held:
            held.append(1)
            await gate.wait()
        return await issue(writer, batch)

    async with run_coordinator(private_nc):
        async with TransactionProducer(
            producer_nc, "shop", rollback, request_timeout=TIMEOUT
        ) as producer:
            await producer.send_in_transaction(TxMessage("orders", b"warm-up"), _commit)
            monkeypatch.setattr(PipelinedWriter, "_issue", holding)
            publish = producer_nc.publish
            delayed: list[tuple[str, bytes, Any, Any]] = []

            async def overtaken(subject: str, payload: bytes = b"", *a: Any, **k: Any) -> None:
                if subject.startswith("txn.coord.0.prepare.") and not delayed:
                    delayed.append((subject, payload, a, k))  # sent once its copy is held
                    return
                await publish(subject, payload, *a, **k)

            monkeypatch.setattr(producer_nc, "publish", overtaken)
            async with anyio.create_task_group() as tasks:
                results: list[Any] = []

                async def send() -> None:
                    results.append(
                        await producer.send_in_transaction(TxMessage("orders", b"late"), _commit)
                    )

                tasks.start_soon(send)
                await eventually(lambda: held, what="the copy's halves held in the writer")
                subject, payload, a, k = delayed[0]
                await publish(subject, payload, *a, **k)  # refused: its copy is in flight
                await private_nc.flush()
                await producer_nc.flush()
                await anyio.sleep(0.3)  # its `conflict` is back by now (and must not count)
                gate.set()
        [result] = results
        assert result.state == "committed"
        ids = await eventually(lambda: topic_ids(private_nc, "orders"), until=lambda i: len(i) == 2)
        assert f"{result.txid}:0" in ids
