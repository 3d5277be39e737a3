"""Transactional messages with producer, coordinator and consumer sharing one process.

Not how anything is deployed (see `bench.transactions` for that): `bench.transfer` uses it as
the bare rate next to its demo, which runs its roles in one process too.
"""

from __future__ import annotations

import time

import anyio
from nats.aio.client import Client

from bench.workers import run_workers
from txactors.consumer import ConsumedMessage, Consumer
from txactors.producer import Decision, TransactionProducer, TxMessage

BODY = b"x" * 128


async def transactions(
    nc: Client, producer: TransactionProducer, count: int, workers: int, topic: str
) -> tuple[float, list[float], list[float]]:
    """(committed tx/s until the consumer had all, commit latencies, end-to-end latencies)."""
    sent_at: dict[str, float] = {}
    e2e: list[float] = []
    all_in = anyio.Event()

    async def handle(message: ConsumedMessage) -> None:
        e2e.append(time.perf_counter() - sent_at[message.keys[0]])
        if len(e2e) == count:
            all_in.set()

    commit_latencies: list[float] = []

    async def one(i: int) -> None:
        key = f"{topic}-{i}"
        sent_at[key] = started = time.perf_counter()
        result = await producer.send_in_transaction(
            TxMessage(topic, BODY, keys=[key]), lambda m, a: Decision.COMMIT
        )
        assert result.state == "committed", result
        commit_latencies.append(time.perf_counter() - started)

    async with Consumer(nc, topic, "bench", handle, concurrency=64):
        started = time.perf_counter()
        await run_workers(count, workers, one)
        await all_in.wait()
        seconds = time.perf_counter() - started
    return count / seconds, commit_latencies, e2e
