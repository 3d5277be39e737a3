"""Declaring streams: idempotent, race-safe, widening but never narrowing."""

from __future__ import annotations

import uuid

import anyio
import pytest
from nats.aio.client import Client
from nats.js.api import StorageType

from tests.support.logstreams import ensure_log_streams
from txactors.coordinator.partition.streams import DEDUPE_WINDOW
from txactors.errors import ConfigError
from txactors.nats.topics import DEFAULT_DUPLICATE_WINDOW, ensure_stream, ensure_topic_stream
from txactors.wire import layout
from txactors.wire.layout import topic_filter, topic_stream


def fresh_topic() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


async def test_creates_a_file_stream_on_the_topic_subjects(nc: Client) -> None:
    js = nc.jetstream()
    topic = fresh_topic()
    try:
        assert await ensure_topic_stream(js, topic) == topic_stream(topic)
        config = (await js.stream_info(topic_stream(topic))).config
        assert config.subjects == [topic_filter(topic)]
        assert config.storage == StorageType.FILE
        assert config.duplicate_window == DEFAULT_DUPLICATE_WINDOW
    finally:
        await js.delete_stream(topic_stream(topic))


async def test_concurrent_declarations_agree(nc: Client) -> None:
    js = nc.jetstream()
    topic = fresh_topic()
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(ensure_topic_stream, js, topic)
        assert (await js.stream_info(topic_stream(topic))).config.subjects == [topic_filter(topic)]
    finally:
        await js.delete_stream(topic_stream(topic))


async def test_widens_the_duplicate_window_but_never_shrinks_it(nc: Client) -> None:
    js = nc.jetstream()
    topic = fresh_topic()
    name = topic_stream(topic)
    try:
        await ensure_topic_stream(js, topic, duplicate_window=60.0)
        await ensure_topic_stream(js, topic, duplicate_window=7200.0)  # the coordinator's horizon
        assert (await js.stream_info(name)).config.duplicate_window == 7200.0
        await ensure_topic_stream(js, topic, duplicate_window=60.0)  # a consumer's default
        assert (await js.stream_info(name)).config.duplicate_window == 7200.0
    finally:
        await js.delete_stream(name)


async def test_adds_missing_subjects_and_keeps_others(nc: Client) -> None:
    js = nc.jetstream()
    name = f"S{uuid.uuid4().hex[:10]}"
    try:
        await js.add_stream(name=name, subjects=[f"{name}.a"])
        await ensure_stream(js, name, [f"{name}.b"])
        assert (await js.stream_info(name)).config.subjects == [f"{name}.a", f"{name}.b"]
    finally:
        await js.delete_stream(name)


async def test_other_storage_is_a_config_error(nc: Client) -> None:
    js = nc.jetstream()
    topic = fresh_topic()
    name = topic_stream(topic)
    try:
        await js.add_stream(name=name, subjects=[topic_filter(topic)], storage=StorageType.MEMORY)
        with pytest.raises(ConfigError, match="memory storage"):
            await ensure_topic_stream(js, topic)
    finally:
        await js.delete_stream(name)


async def test_bad_topic_name_is_refused(nc: Client) -> None:
    with pytest.raises(ValueError, match="topic"):
        await ensure_topic_stream(nc.jetstream(), "orders.paid")


async def test_the_coordinator_streams_are_declared_by_the_same_rules(private_nc: Client) -> None:
    """TXN_* go through `declare_stream` too: widened, never narrowed, storage checked."""
    js = private_nc.jetstream()
    await js.add_stream(
        name=layout.log_stream(0), subjects=[layout.half_subject(0)], duplicate_window=10.0
    )
    await js.add_stream(
        name=layout.log_stream(1), subjects=[layout.half_subject(1)], storage=StorageType.MEMORY
    )
    with pytest.raises(ConfigError, match="memory storage"):
        await ensure_log_streams(js, half_retention=3600.0, partitions=(0, 1))
    log = (await js.stream_info(layout.log_stream(0))).config
    assert log.duplicate_window == DEDUPE_WINDOW
    assert log.allow_atomic
    assert log.subjects == [layout.half_subject(0), layout.op_subject(0)], "widened"
