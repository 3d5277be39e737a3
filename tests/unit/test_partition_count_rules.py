"""The published partition count is bounded wherever it is read, and the coordinators keep it.

Anyone may write the key on a server without permissions: a reader takes a decimal from 1 to
MAX_PARTITION_COUNT and nothing else (a 30-digit count once made producers allocate without
bound), and a running coordinator's guard puts its own count back through any NATS trouble.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, cast

import anyio
import nats.errors
import nats.js.errors
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from nats.js.kv import KV_DEL, KeyValue

from tests.support.wait import eventually
from txactors.cli.settings import markdown_table
from txactors.coordinator.cluster.agreement import keep_partition_count
from txactors.coordinator.options import CoordinatorOptions
from txactors.errors import ConfigError
from txactors.nats.partition_count import (
    PartitionCountInvalid,
    agreed_count,
    check_count,
    parse_count,
)
from txactors.wire.layout import MAX_PARTITION_COUNT


@given(count=st.integers(1, MAX_PARTITION_COUNT), zeros=st.integers(0, 3), blank=st.booleans())
def test_a_count_in_range_is_read_as_written(count: int, zeros: int, blank: bool) -> None:
    text = "0" * zeros + str(count) + ("\n" if blank else "")
    assert parse_count(text.encode()) == count


@given(count=st.integers(max_value=0) | st.integers(min_value=MAX_PARTITION_COUNT + 1))
def test_a_count_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(PartitionCountInvalid, match="not a partition count"):
        parse_count(str(count).encode())
    with pytest.raises(ConfigError, match=f"partitions must be 1 to {MAX_PARTITION_COUNT}"):
        check_count(count)
    with pytest.raises(ConfigError, match=f"partitions must be 1 to {MAX_PARTITION_COUNT}"):
        agreed_count(None, count)


@given(value=st.binary(max_size=64))
def test_any_value_is_a_count_in_range_or_refused_naming_the_key(value: bytes) -> None:
    try:
        count = parse_count(value)
    except PartitionCountInvalid as refused:
        assert "key 'partitions' of KV bucket TXN_META holds" in str(refused)
    else:
        assert 1 <= count <= MAX_PARTITION_COUNT


def test_a_huge_count_is_refused_without_being_converted() -> None:
    started = time.perf_counter()
    with pytest.raises(PartitionCountInvalid, match=r"\(1000000 chars\)"):
        parse_count(b"9" * 1_000_000)  # int() would refuse it with a ValueError of its own
    assert time.perf_counter() - started < 0.5


def test_the_coordinators_setting_has_the_same_bound_and_says_so() -> None:
    CoordinatorOptions(partitions=MAX_PARTITION_COUNT)
    with pytest.raises(ConfigError, match=f"1 to {MAX_PARTITION_COUNT}, not 4097"):
        CoordinatorOptions(partitions=MAX_PARTITION_COUNT + 1)
    assert f"1 to {MAX_PARTITION_COUNT};" in markdown_table()


class FlakyMeta:
    """TXN_META as a running coordinator sees it: a watch and writes that fail now and then.

    `watch` fails as listed in `watch_failures` (one per call) before it gives a watcher;
    `update` fails with the first of `update_failures` left."""

    def __init__(
        self, value: bytes, watch_failures: list[Exception], update_failures: list[Exception]
    ) -> None:
        self.value: bytes | None = value
        self.revision = 1
        self.watch_failures = deque(watch_failures)
        self.update_failures = deque(update_failures)
        self.watches = 0
        self.news: deque[Any] = deque()
        self.arrived = anyio.Event()

    def write(self, value: bytes | None) -> None:
        """Another client's write: the watch shows it."""
        self.value = value
        self.revision += 1
        self.news.append(self._entry())
        self.arrived.set()

    def _entry(self) -> Any:
        return KeyValue.Entry(
            bucket="TXN_META",
            key="partitions",
            value=self.value or b"",
            revision=self.revision,
            delta=0,
            created=None,
            operation=KV_DEL if self.value is None else None,
        )

    async def watch(self, key: str) -> FlakyMeta:
        self.watches += 1
        if self.watch_failures:
            raise self.watch_failures.popleft()
        self.news = deque([self._entry(), None])
        return self

    async def updates(self, timeout: float) -> Any:
        with anyio.move_on_after(timeout):
            while not self.news:
                self.arrived = anyio.Event()
                await self.arrived.wait()
            return self.news.popleft()
        raise nats.errors.TimeoutError

    async def stop(self) -> None:
        self.news.clear()

    async def get(self, key: str) -> Any:
        return self._entry()

    async def update(self, key: str, value: bytes, last: int) -> int:
        if self.update_failures:
            raise self.update_failures.popleft()
        if last != self.revision:
            raise nats.js.errors.KeyWrongLastSequenceError()
        self.write(value)
        return self.revision


async def test_the_guard_puts_the_count_back_through_nats_trouble() -> None:
    """Every failure a JetStream call can bring (a bucket electing, a timeout, a lost
    connection) is logged and the watch made again: the guard never ends, and the count
    comes back."""
    meta = FlakyMeta(
        b"8",
        watch_failures=[
            nats.js.errors.ServiceUnavailableError(code=503, err_code=10008),
            nats.errors.TimeoutError(),
        ],
        update_failures=[nats.errors.ConnectionClosedError()],
    )
    restored: list[None] = []
    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                lambda: keep_partition_count(
                    cast(KeyValue, meta),
                    4,
                    restored=lambda: restored.append(None),
                    retry=0.01,
                    read_every=0.05,
                )
            )
            await eventually(lambda: meta.value, until=lambda value: value == b"4")
            meta.write(None)  # deleted
            await eventually(lambda: meta.value, until=lambda value: value == b"4")
            tg.cancel_scope.cancel()
    assert len(restored) == 2
    assert meta.watches == 4, "two failed watches, one cut by the failed write, the last"
    failed = [e for e in logs if e["event"] == "partition_count_watch_failed"]
    assert len(failed) == 3
    assert [e["found"] for e in logs if e["event"] == "partition_count_restored"] == ["'8'", None]
