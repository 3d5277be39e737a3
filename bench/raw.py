"""The raw JetStream baselines the transactional path is measured against, on the same server.

- pipelined acked publishes: single messages, `in_flight` of them awaiting their acks (one at
  a time gives the latency of one acked publish);
- atomic batch publish (nats-server 2.12+, streams with `allow_atomic`): `size` messages with
  `Nats-Batch-Id` / `Nats-Batch-Sequence` headers, the last one marked `Nats-Batch-Commit`,
  stored all or nothing with one ack; `in_flight` batches at once.

Both return (acked msg/s, per-message latencies: publish to ack).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from typing import Any

from nats.aio.client import Client
from nats.nuid import NUID

from txactors.nats.topics import ensure_topic_stream
from txactors.wire import layout

BATCH_ID = "Nats-Batch-Id"
BATCH_SEQUENCE = "Nats-Batch-Sequence"
BATCH_COMMIT = "Nats-Batch-Commit"


async def _stream(nc: Client, topic: str) -> str:
    await ensure_topic_stream(nc.jetstream(), topic)  # allow_atomic: takes atomic batches
    return layout.topic_subject(topic)


async def pipelined(
    nc: Client, body: bytes, count: int, in_flight: int, topic: str = "rawpipe"
) -> tuple[float, list[float]]:
    subject = await _stream(nc, topic)
    started = time.monotonic()
    latencies = await publish_acked(nc, subject, body, range(count), in_flight)
    seconds = time.monotonic() - started
    await nc.jetstream().purge_stream(layout.topic_stream(topic))
    return count / seconds, latencies


async def publish_acked(
    nc: Client, subject: str, body: bytes, numbers: range, in_flight: int
) -> list[float]:
    """Publish `body` once per number (its `Nats-Msg-Id`), `in_flight` awaiting their acks;
    returns each one's latency, publish to ack."""
    js = nc.jetstream(publish_async_max_pending=max(in_flight, 1))
    latencies: list[float] = []
    pending: collections.deque[tuple[float, asyncio.Future[Any]]] = collections.deque()

    async def settle_oldest() -> None:
        sent, future = pending.popleft()
        await future
        latencies.append(time.monotonic() - sent)

    for i in numbers:
        if len(pending) >= in_flight:
            await settle_oldest()
        future = await js.publish_async(subject, body, headers={"Nats-Msg-Id": f"r{i}"})
        pending.append((time.monotonic(), future))
    while pending:
        await settle_oldest()
    return latencies


async def atomic_batches(
    nc: Client, body: bytes, count: int, size: int, in_flight: int, topic: str = "rawbatch"
) -> tuple[float, list[float]]:
    subject = await _stream(nc, topic)
    nuid = NUID()
    numbers = iter(range(0, count, size))
    latencies: list[float] = []

    async def sender() -> None:
        for first in numbers:
            batch_id = nuid.next().decode()
            n = min(size, count - first)
            sent = time.monotonic()
            for seq in range(1, n):
                headers = {BATCH_ID: batch_id, BATCH_SEQUENCE: str(seq)}
                await nc.publish(subject, body, headers=headers)
            headers = {BATCH_ID: batch_id, BATCH_SEQUENCE: str(n), BATCH_COMMIT: "1"}
            answer = await nc.request(subject, body, timeout=10, headers=headers)
            ack = json.loads(answer.data)
            if "error" in ack or ack.get("count") != n:
                raise RuntimeError(f"atomic batch refused: {ack}")
            latencies.extend(itertools.repeat(time.monotonic() - sent, n))

    started = time.monotonic()
    await asyncio.gather(*(sender() for _ in range(in_flight)))
    seconds = time.monotonic() - started
    await nc.jetstream().purge_stream(layout.topic_stream(topic))
    return count / seconds, latencies
