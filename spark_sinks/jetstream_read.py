"""Reading committed messages from topic streams by stream sequence, for the Spark source.

The source's offsets are stream sequences, so everything it needs from JetStream is here: the
bounds of each stream, and every message in a sequence range. A range is read with an ephemeral
pull consumer (no acks, in-memory consumer state) starting at the range's first sequence,
fetching large batches; `bench/spark.py` measured it against direct gets by sequence
(`$JS.API.STREAM.MSG.GET`, pipelined) and it was 2-3x faster, since one fetch request
brings a whole batch (bench/HISTORY.md, "Spark sink backfill").

Each call connects, works and closes: Spark calls these from short-lived Python workers and
from the driver's source process, neither of which keeps an event loop between calls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import nats
import nats.errors
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from spark_sinks.errors import SinkError
from spark_sinks.schema import Committed
from txactors.nats.config import NatsConfig
from txactors.nats.connect import nats_session
from txactors.wire.layout import topic_filter, topic_stream

FETCH_BATCH: Final = 2_000
"""Messages per pull request: large enough that the request round trip is amortised."""
FETCH_TIMEOUT: Final = 5.0
AUTH_OPTIONS: Final = (
    "user", "password", "token", "creds_file", "nkeys_seed", "tls_ca", "tls_cert", "tls_key",
)  # fmt: skip
"""NatsConfig fields that travel as source options, under the same names."""

T = TypeVar("T")


@contextlib.asynccontextmanager
async def connect(config: NatsConfig) -> AsyncIterator[Client]:
    """A client for `config.url` with its auth and TLS (the source never embeds a server).

    Through txactors' own connect: a server that cannot be reached is one NatsConnectError,
    with no traceback per attempt logged by nats-py on the way.
    """
    if config.url is None:
        raise SinkError("the sink needs a NATS URL (option 'servers', or NATS_URL)")
    async with nats_session(
        config, name=f"{config.name}-spark", disconnected_cb=_closed
    ) as session:
        yield session.nc


async def _closed() -> None:
    """Each call closes its connection when done: that disconnect is not news to log."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """A stream's first and last sequence; first = last + 1 when it holds nothing (any more).

    `created`: when the stream was created (ISO 8601), which tells it from one of the same
    name created again (offsets.StreamPosition).
    """

    first: int
    last: int
    created: str | None = None


async def stream_bounds(config: NatsConfig, streams: Sequence[str]) -> dict[str, Bounds | None]:
    """Each stream's bounds; None for a stream that does not exist.

    Only `stream_info`: the sink reads, it never creates a stream (a typo must not make one).
    """
    async with connect(config) as nc:
        js = nc.jetstream()
        found: dict[str, Bounds | None] = {}
        for stream in streams:
            try:
                info = await js.stream_info(stream)
            except NotFoundError:
                found[stream] = None
                continue
            created = None if info.created is None else info.created.isoformat()
            found[stream] = Bounds(info.state.first_seq, info.state.last_seq, created)
        return found


async def fetch_range(
    config: NatsConfig, topic: str, first: int, last: int, *, batch: int = FETCH_BATCH
) -> AsyncIterator[list[Committed]]:
    """Every message of `topic` with sequence in [first, last], in chunks of up to `batch`.

    Sequences missing from the stream (deleted or purged) are skipped; the range ends at `last`
    even if the stream has grown since.
    """
    stream = topic_stream(topic)
    async with connect(config) as nc:
        js = nc.jetstream()
        consumer = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(first, 1),
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
            mem_storage=True,
            num_replicas=1,
        )
        sub = await js.pull_subscribe(topic_filter(topic), stream=stream, config=consumer)
        try:
            seq = first - 1
            # One fetch is always in flight: the server sends the next batch while the
            # caller (Spark's worker) turns this one into Arrow.
            pending = asyncio.ensure_future(
                sub.fetch(min(batch, last - seq), timeout=FETCH_TIMEOUT)
            )
            while True:
                try:
                    msgs = await pending
                except nats.errors.TimeoutError:
                    return  # nothing left below `last`: the rest of the range was deleted
                chunk = []
                for msg in msgs:
                    seq, published_us = _position(msg.reply)
                    if seq > last:
                        break
                    chunk.append(Committed(seq, published_us, msg.headers or {}, msg.data))
                if seq >= last:
                    if chunk:
                        yield chunk
                    return
                pending = asyncio.ensure_future(
                    sub.fetch(min(batch, last - seq), timeout=FETCH_TIMEOUT)
                )
                if chunk:
                    yield chunk
        finally:
            if not pending.done():
                pending.cancel()
            with contextlib.suppress(nats.errors.Error, asyncio.CancelledError):
                await sub.unsubscribe()


def _position(reply: str) -> tuple[int, int]:
    """(stream sequence, store time in µs) from a JetStream reply subject.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ns>.<pending>`, or with domain and
    account hash in front (`$JS.ACK.<domain>.<hash>.<stream>...`, 12+ tokens). Cheaper than
    nats-py's `msg.metadata`, which builds several objects per message.
    """
    tokens = reply.split(".")
    at = 5 if len(tokens) == 9 else 7
    return int(tokens[at]), int(tokens[at + 2]) // 1_000


def run_sync(chunks: AsyncIterator[T]) -> Iterator[T]:
    """Drive an async iterator from synchronous code (a Spark worker has no event loop)."""
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(anext(chunks))
            except StopAsyncIteration:
                return
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(chunks.aclose())  # type: ignore[attr-defined]
        loop.close()


def nats_config(options: Mapping[str, str]) -> NatsConfig:
    """NatsConfig from data source options (`servers` plus NatsConfig's auth field names)."""

    settings = {name: options.get(name) or None for name in AUTH_OPTIONS}
    return NatsConfig(url=options.get("servers") or None, **settings)  # type: ignore[arg-type]
