"""The outbox packages of `bench.outbox`: each one's producer side, and its relay process.

Optional: the `bench-outbox` extra (`nats-outbox`, `faststream-outbox` with FastStream's NATS
broker). Each relay runs in a process of its own, `python -m bench.outbox_relays NAME NATS_URL
PG_URL TOPIC`, prints `ready` once it serves, and publishes with an acked JetStream publish
to the topic's stream. Settings are the packages' defaults except what keeps an idle relay
from sleeping a second between looks (the polling interval, the fetch interval) and how many
rows a relay takes at once, for both: `POLL`, `RELAY_BATCH`, `RELAY_WORKERS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from txactors.actors.loop import run as run_on_loop
from txactors.wire import layout

POLL = 0.05
"""Seconds an idle relay waits before it looks again (the packages default to 1 s)."""
RELAY_BATCH = 100
RELAY_WORKERS = 8
"""faststream-outbox: rows handled at once (its default is 1)."""
FASTSTREAM_QUEUE = "bench_orders"
ORDERS = "bench_outbox_orders"

Call = Callable[[bytes], Awaitable[None]]


def available() -> list[str]:
    """The packages that import here."""
    names = []
    with contextlib.suppress(ImportError):
        import nats_outbox  # noqa: F401

        names.append("nats-outbox")
    with contextlib.suppress(ImportError):
        import faststream.nats  # noqa: F401
        import faststream_outbox  # noqa: F401

        names.append("faststream-outbox")
    return names


def _faststream_table() -> sa.Table:
    from faststream_outbox import make_outbox_table

    return make_outbox_table(sa.MetaData(), table_name="bench_faststream_outbox")


async def create_tables(engine: AsyncEngine, name: str) -> None:
    """The package's outbox table, empty."""
    if name == "nats-outbox":
        from nats_outbox.core.models import Base

        tables = list(Base.metadata.tables.values())
        metadata = Base.metadata
    else:
        table = _faststream_table()
        tables, metadata = [table], table.metadata
    async with engine.begin() as conn:
        await conn.run_sync(metadata.drop_all, tables=tables)
        await conn.run_sync(metadata.create_all, tables=tables)


@contextlib.asynccontextmanager
async def producer_side(engine: AsyncEngine, name: str, topic: str) -> AsyncIterator[Call]:
    """One order through `name`: the row and the outbox row in one transaction."""
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    insert = sa.text(f"INSERT INTO {ORDERS} (body) VALUES (:body)")
    subject = layout.topic_subject(topic)
    if name == "nats-outbox":
        from nats_outbox.core.outbox import outbox_transaction

        async def nats_outbox_call(body: bytes) -> None:
            async with sessions() as session, outbox_transaction(session) as tx:
                await session.execute(insert, {"body": body})
                tx.publish_event(subject, {"order": body.hex()})

        yield nats_outbox_call
        return
    from faststream_outbox import OutboxBroker

    broker = OutboxBroker(engine, outbox_table=_faststream_table())

    async def faststream_call(body: bytes) -> None:
        async with sessions() as session, session.begin():
            await session.execute(insert, {"body": body})
            await broker.publish({"order": body.hex()}, queue=FASTSTREAM_QUEUE, session=session)

    yield faststream_call


async def relay(name: str, nats_url: str, pg_url: str, topic: str) -> None:
    """Run `name`'s relay until stdin closes."""
    engine = create_async_engine(pg_url, pool_size=RELAY_WORKERS + 2, max_overflow=0)
    try:
        async with _relaying(name, engine, nats_url, topic):
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.read)
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def _relaying(
    name: str, engine: AsyncEngine, nats_url: str, topic: str
) -> AsyncIterator[None]:
    if name == "nats-outbox":
        import nats
        from nats_outbox.publishers.nats_publisher import NatsPublisher
        from nats_outbox.relay.polling import PollingRelay
        from nats_outbox.settings import OutboxSettings

        settings = OutboxSettings(
            database_url=str(engine.url.render_as_string(hide_password=False)),
            nats_url=nats_url,
            polling_interval=POLL,
            batch_size=RELAY_BATCH,
        )
        nc = await nats.connect(nats_url)
        worker = PollingRelay(
            async_sessionmaker(engine, expire_on_commit=False),
            await NatsPublisher.from_nats_client(nc),
            settings,
        )
        task = asyncio.create_task(worker.start())
        try:
            yield
        finally:
            await worker.stop()
            await task
            await nc.close()
        return
    from faststream.nats import JStream, NatsBroker
    from faststream_outbox import OutboxBroker

    outbox = OutboxBroker(engine, outbox_table=_faststream_table())
    bus = NatsBroker(nats_url)
    stream = JStream(layout.topic_stream(topic), declare=False)  # the benchmark declared it
    publisher = bus.publisher(layout.topic_subject(topic), stream=stream)

    @publisher
    @outbox.subscriber(
        FASTSTREAM_QUEUE,
        max_workers=RELAY_WORKERS,
        fetch_batch_size=RELAY_BATCH,
        min_fetch_interval=POLL,
        max_fetch_interval=POLL,
    )
    async def forward(body: dict[str, Any]) -> dict[str, Any]:
        return body

    await bus.start()
    await outbox.start()
    try:
        yield
    finally:
        await outbox.stop()
        await bus.stop()


def main() -> None:
    os.environ.setdefault("OUTBOX_DATABASE_URL", sys.argv[3])
    run_on_loop(relay(*sys.argv[1:5]))


if __name__ == "__main__":
    main()
