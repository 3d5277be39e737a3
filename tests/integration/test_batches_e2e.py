"""The two halves of the batch verbs together: a real `TransactionProducer` against a real
coordinator, each counting an item's answer by the one rule in wire/answers.py.

What goes on the wire is watched by a plain subscription of its own: NATS hands a request to
every subscriber of its subject, so a spy counts each prepare the producer sends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.support.txn import topic_ids
from tests.support.wait import eventually
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.errors import PrepareFailed
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.producer.link import DEFAULT_MAX_ITEMS
from txactors.producer.transaction import TransactionResult
from txactors.wire.layout import partition_of
from txactors.wire.protocol import Encoding, encoding_of

TRANSACTIONS = 64


def sent(msg: Msg) -> tuple[str, int]:
    """The `type` a spied request names and how many transactions it carries, read as any
    client would read the payload."""
    encoding = encoding_of(msg.headers)
    assert isinstance(encoding, Encoding), encoding
    decode = msgspec.json.decode if encoding is Encoding.JSON else msgspec.msgpack.decode
    payload: dict[str, Any] = decode(msg.data)
    return str(payload["type"]), len(payload.get("items", [None]))


@asynccontextmanager
async def spying(nc: Client) -> AsyncIterator[dict[str, list[tuple[str, int]]]]:
    """Every prepare and end request sent to any partition (`sent`), by verb."""
    heard: dict[str, list[tuple[str, int]]] = {"prepare": [], "end": []}
    subscriptions = []
    for verb, requests in heard.items():

        async def hear(msg: Msg, requests: list[tuple[str, int]] = requests) -> None:
            requests.append(sent(msg))

        subscriptions.append(await nc.subscribe(f"txn.coord.*.{verb}.>", cb=hear))
    await nc.flush()
    try:
        yield heard
    finally:
        for subscription in subscriptions:
            await subscription.unsubscribe()


async def test_concurrent_transactions_go_in_batches_and_each_commits_once(
    private_nc: Client,
) -> None:
    async def never_asked(view: CheckView) -> Decision:
        raise AssertionError(f"no check-back was due: {view.txid}")

    async with (
        run_coordinator(private_nc),
        TransactionProducer(private_nc, "shop", never_asked) as producer,
        spying(private_nc) as heard,
    ):
        results: dict[int, TransactionResult] = {}

        async def one(n: int) -> None:
            results[n] = await producer.send_in_transaction(
                TxMessage("orders", f"order-{n}".encode()), lambda message, arg: Decision.COMMIT
            )

        async with anyio.create_task_group() as tg:
            for n in range(TRANSACTIONS):
                tg.start_soon(one, n)

        assert [r.state for r in results.values()] == ["committed"] * TRANSACTIONS
        txids = [r.txid for r in results.values()]
        assert sorted(await topic_ids(private_nc, "orders")) == sorted(f"{t}:0" for t in txids)

        def carried(verb: str) -> int:
            return sum(items for _, items in heard[verb])

        def all_heard() -> bool:
            return carried("prepare") == carried("end") == TRANSACTIONS

        await eventually(all_heard)
        assert len(heard["prepare"]) < TRANSACTIONS, "batches happened"

        before = len(heard["prepare"])
        lone = await producer.send_in_transaction(
            TxMessage("orders", b"alone"), lambda message, arg: Decision.COMMIT
        )
        assert lone.state == "committed"

        def lone_heard() -> bool:
            return len(heard["prepare"]) > before

        await eventually(lone_heard)
        assert heard["prepare"][before:] == [("Prepare", 1)], "a lone one waits for nothing"
        assert (await topic_ids(private_nc, "orders")).count(f"{lone.txid}:0") == 1


async def test_concurrent_transactions_share_a_partition_whatever_the_count(
    private_nc: Client,
) -> None:
    """With 8 partitions, 64 transactions begun together land in one or two of them
    (sticky.py), so they still travel in batches of many: spread at random, they would
    make 8 requests' worth of rounds of about 8."""

    async def never_asked(view: CheckView) -> Decision:
        raise AssertionError(f"no check-back was due: {view.txid}")

    async with (
        run_coordinator(private_nc, options=CoordinatorOptions(partitions=8)),
        TransactionProducer(private_nc, "shop", never_asked, partitions=8) as producer,
        spying(private_nc) as heard,
    ):

        async def one(n: int) -> TransactionResult:
            return await producer.send_in_transaction(
                TxMessage("orders", f"order-{n}".encode()), lambda message, arg: Decision.COMMIT
            )

        await one(-1)  # the partition count is read by the first transaction
        results: list[TransactionResult] = []

        async def collect(n: int) -> None:
            results.append(await one(n))

        async with anyio.create_task_group() as tg:
            for n in range(TRANSACTIONS):
                tg.start_soon(collect, n)

        assert [r.state for r in results] == ["committed"] * TRANSACTIONS
        assert len({partition_of(r.txid, 8) for r in results}) <= 2
        await eventually(lambda: sum(items for _, items in heard["prepare"]) == TRANSACTIONS + 1)
        assert len(heard["prepare"]) <= 1 + 2 * TRANSACTIONS // 8, "rounds of many"


async def committed_or_none(producer: TransactionProducer) -> TransactionResult | None:
    """One transaction; None if its prepare failed."""
    try:
        return await producer.send_in_transaction(
            TxMessage("orders", b"x"), lambda message, arg: Decision.COMMIT
        )
    except PrepareFailed:
        return None


async def test_new_transactions_leave_a_partition_nobody_serves(private_nc: Client) -> None:
    """A producer that fills one partition at a time moves on as soon as that partition
    fails a prepare (here: nobody serves it), rather than failing a whole block there."""
    half_served = CoordinatorOptions(partitions=2, max_partitions=1)
    async with (
        run_coordinator(private_nc, options=half_served) as running,
        TransactionProducer(
            private_nc, "shop", lambda view: Decision.COMMIT, partitions=2, prepare_retries=0
        ) as producer,
    ):
        await eventually(lambda: running.partitions, until=lambda served: len(served) == 1)
        for _ in range(2 * DEFAULT_MAX_ITEMS + 1):  # the unserved one's turn comes in time
            if await committed_or_none(producer) is None:
                break
        else:
            raise AssertionError("no prepare reached the partition nobody serves")
        after = [await committed_or_none(producer) for _ in range(10)]
        assert all(r is not None and r.state == "committed" for r in after)


async def test_a_first_transaction_failing_its_prepare_moves_the_next_one_elsewhere(
    private_nc: Client,
) -> None:
    """A producer's very first transaction has any txid (the partition count is not known
    yet); if its partition fails the prepare, the next one still goes to another."""
    half_served = CoordinatorOptions(partitions=2, max_partitions=1)
    first_failures = 0
    async with run_coordinator(private_nc, options=half_served) as running:
        await eventually(lambda: running.partitions, until=lambda served: len(served) == 1)
        for _ in range(40):  # fresh producers, until 4 first transactions met nobody
            async with TransactionProducer(
                private_nc, "shop", lambda view: Decision.COMMIT, partitions=2, prepare_retries=0
            ) as producer:
                if await committed_or_none(producer) is not None:
                    continue
                first_failures += 1
                following = await committed_or_none(producer)
                assert following is not None and following.state == "committed"
            if first_failures == 4:
                break
    assert first_failures == 4, "some first transactions landed where nobody serves"
