"""Nobody but the coordinators is told the partition count: they publish it, clients read it.

Two coordinator processes with 4 partitions; a producer and the operator's `txactors txn`
commands given no count: every transaction, on every partition, commits or is listed, shown
and resolved. A coordinator started with another count refuses in one line; a client whose
count disagrees with the published one is told so. Anyone may write the key on a server
without permissions: a running coordinator puts its count back, and no client reads a value
that is not a count (1 to MAX_PARTITION_COUNT).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import nats.js.errors
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.client import Client
from nats.js.kv import KeyValue

from tests.support.coordinator_process import CoordinatorProcess
from tests.support.servers import MakeNatsServer
from tests.support.txn import topic_ids
from tests.support.wait import eventually
from txactors.coordinator.cluster.agreement import agree_partition_count, meta_bucket
from txactors.coordinator.options import CoordinatorOptions
from txactors.coordinator.service import run_coordinator
from txactors.errors import ConfigError, PrepareFailed
from txactors.nats.client import connect
from txactors.nats.partition_count import (
    PartitionCountInvalid,
    PartitionCountMismatch,
    agreed_count,
    read_published,
)
from txactors.observe.metrics import CoordinatorMetrics
from txactors.ops import txn as admin
from txactors.ops.partitions import live_coordinators
from txactors.producer import Decision, TransactionProducer, TxMessage
from txactors.producer.link import DEFAULT_MAX_ITEMS
from txactors.producer.transaction import TransactionResult
from txactors.wire import layout

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4
PER_PARTITION = 2


@asynccontextmanager
async def four_partitions(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> AsyncIterator[tuple[str, Client]]:
    """Two coordinator processes with --partitions 4, every partition served."""
    server = await make_nats_server()
    coordinators = [
        CoordinatorProcess(server.url, _dir(tmp_path, name), partitions=PARTITIONS)
        for name in ("a", "b")
    ]
    nc = await connect(server.url)
    try:
        for coordinator in coordinators:
            await coordinator.start()
        await eventually(lambda: _all_served(nc), timeout=30, what="every partition served")
        yield server.url, nc
    finally:
        await nc.close()
        for coordinator in coordinators:
            await coordinator.terminate()


async def _all_served(nc: Client) -> bool:
    try:
        await admin.list_transactions(nc, partitions=PARTITIONS, timeout=1)
    except admin.CoordinatorUnavailable:
        return False
    return True


def _dir(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


async def _until_every_partition(
    producer: TransactionProducer, decision: Decision
) -> list[TransactionResult]:
    """Transactions ended with `decision` until each partition has PER_PARTITION of them."""
    results: list[TransactionResult] = []
    with anyio.fail_after(60):
        while min(_per_partition(r.txid for r in results)) < PER_PARTITION:
            results.append(
                await producer.send_in_transaction(TxMessage("orders", b"x"), lambda m, a: decision)
            )
    return results


def _per_partition(txids: Iterable[str]) -> list[int]:
    counts = [0] * PARTITIONS
    for txid in txids:
        counts[layout.partition_of(txid, PARTITIONS)] += 1
    return counts


async def _cli(url: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The real `txactors`, without TXACTORS_PARTITIONS unless `env` sets it."""
    environ = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "TXACTORS_PARTITIONS")}
    environ |= {"PYTHONPATH": str(ROOT), **(env or {})}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "txactors.cli",
        *args,
        "--url",
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environ,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_a_producer_and_the_txn_commands_given_no_count_reach_every_partition(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    async with four_partitions(make_nats_server, tmp_path) as (url, nc):
        assert await read_published(nc, timeout=5) == PARTITIONS
        async with TransactionProducer(nc, "shop", lambda view: Decision.UNKNOWN) as producer:
            committed = await _until_every_partition(producer, Decision.COMMIT)
            left_open = await _until_every_partition(producer, Decision.UNKNOWN)
        assert {r.state for r in committed} == {"committed"}, "every prepare and end reached"
        open_txids = {r.txid for r in left_open}

        code, out, err = await _cli(url, "txn", "list", "--group", "shop", "--json")
        assert code == 0, err
        assert {info["txid"] for info in json.loads(out)} == open_txids, "all 4 partitions"
        one_per_partition = {layout.partition_of(t, PARTITIONS): t for t in open_txids}
        assert sorted(one_per_partition) == list(range(PARTITIONS))
        for txid in one_per_partition.values():
            code, out, err = await _cli(url, "txn", "show", txid, "--json")
            assert code == 0, err
            assert json.loads(out)["txid"] == txid

        code, out, err = await _cli(url, "txn", "resolve", "--rollback", "--group", "shop", "--yes")
        assert code == 0, err
        assert sorted(out.splitlines()) == sorted(f"{t}: rolled_back" for t in open_txids), out
        assert await admin.list_transactions(nc) == []


async def test_a_coordinator_with_another_count_refuses_in_one_line(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    async with four_partitions(make_nats_server, tmp_path) as (url, nc):
        other = CoordinatorProcess(url, _dir(tmp_path, "two"), partitions=2)
        with pytest.raises(AssertionError, match="exited at start"):
            await other.start()
        assert other.returncode() == 2
        assert other.log_tail() == (
            "error: this coordinator has --partitions 2, but the coordinators' partition "
            "count is 4 (key 'partitions' of KV bucket TXN_META): start it with --partitions "
            "4; to change the count see docs/operations.md (Partitions)"
        )
        assert await read_published(nc, timeout=5) == PARTITIONS, "the count in force stays"
        await admin.list_transactions(nc, timeout=5)  # all 4 still served


async def test_a_client_count_that_disagrees_is_an_error(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    async with four_partitions(make_nats_server, tmp_path) as (url, nc):
        producer = TransactionProducer(nc, "shop", lambda view: Decision.COMMIT, partitions=2)
        with pytest.raises(PartitionCountMismatch, match="set to 2 here, but the coordinators"):
            await producer.__aenter__()
        async with TransactionProducer(
            nc, "shop", lambda view: Decision.COMMIT, partitions=PARTITIONS
        ) as agreeing:
            result = await agreeing.send_in_transaction(
                TxMessage("orders", b"x"), lambda m, a: Decision.COMMIT
            )
            assert result.state == "committed"

        expected = (
            "error: partitions is set to 2 here, but the coordinators use 4 (key 'partitions' "
            "of KV bucket TXN_META): drop the setting (the published count is read) or make it "
            "agree\n"
        )
        runs = await asyncio.gather(
            _cli(url, "txn", "list", "--partitions", "2"),
            _cli(url, "txn", "show", "t1", env={"TXACTORS_PARTITIONS": "2"}),
            _cli(url, "txn", "resolve", "--rollback", "--group", "shop", "--partitions", "2"),
        )
        assert [(code, out, err) for code, out, err in runs] == [(2, "", expected)] * 3


async def test_the_count_changes_only_with_every_coordinator_stopped(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    async with four_partitions(make_nats_server, tmp_path) as (url, _):
        assert await _cli(url, "partitions", "show") == (0, "4\n", "")
        code, out, err = await _cli(url, "partitions", "set", "2", "--yes")
        assert (code, out) == (1, "")
        assert err.startswith("error: coordinators still run") and err.count("\n") == 1, err
    nc = await connect(url)
    try:
        await eventually(  # both left cleanly; a killed one's lease expires in 2 s
            lambda: live_coordinators(nc), until=lambda live: not live, what="no coordinator live"
        )
        code, out, err = await _cli(url, "partitions", "set", "2", "--yes")
        assert (code, out) == (0, "partition count 2 (was 4): start the coordinators with it\n")
        coordinator = CoordinatorProcess(url, _dir(tmp_path, "after"), partitions=2)
        await coordinator.start()
        try:
            async with TransactionProducer(nc, "shop", lambda view: Decision.COMMIT) as producer:
                results: list[TransactionResult] = []
                # A producer fills one partition at a time (producer/sticky.py): the other
                # comes after DEFAULT_MAX_ITEMS transactions.
                while len({layout.partition_of(r.txid, 2) for r in results}) < 2:
                    assert len(results) < DEFAULT_MAX_ITEMS + 64, "all txids on one partition"
                    results.append(
                        await producer.send_in_transaction(
                            TxMessage("orders", b"x"), lambda m, a: Decision.COMMIT
                        )
                    )
        finally:
            await coordinator.terminate()
    finally:
        await nc.close()
    assert {r.state for r in results} == {"committed"}, "both partitions of the new count"


async def test_a_producer_started_before_any_coordinator_reads_the_count_when_it_sends(
    private_nc: Client,
) -> None:
    """Producers and coordinators started together: the count is read by the first send."""
    async with TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT) as producer:
        with pytest.raises(PrepareFailed, match="no coordinator has published") as early:
            await producer.send_in_transaction(TxMessage("orders", b"x"), lambda m, a: None)
        assert early.value.retry_after is not None, "nothing was sent: come back"
        options = CoordinatorOptions(partitions=3)
        async with run_coordinator(private_nc, options=options) as running:
            await eventually(lambda: running.partitions, until=lambda served: served == [0, 1, 2])
            results = [
                await producer.send_in_transaction(
                    TxMessage("orders", b"x"), lambda m, a: Decision.COMMIT
                )
                for _ in range(12)
            ]
    assert {r.state for r in results} == {"committed"}


async def test_the_first_count_stays_and_a_deleted_key_is_published_again(
    private_nc: Client,
) -> None:
    assert await read_published(private_nc, timeout=5) is None, "no bucket yet"
    with pytest.raises(admin.CoordinatorUnavailable, match="no coordinator has published"):
        await admin.list_transactions(private_nc)
    kv = await meta_bucket(private_nc.jetstream(), replicas=1)
    assert await read_published(private_nc, timeout=5) is None, "a bucket without the key"
    await agree_partition_count(kv, 4)
    await agree_partition_count(kv, 4)
    with pytest.raises(PartitionCountMismatch, match=r"has --partitions 3, but .* is 4"):
        await agree_partition_count(kv, 3)
    assert await read_published(private_nc, timeout=5) == 4
    await kv.delete(layout.PARTITIONS_KEY)
    assert await read_published(private_nc, timeout=5) is None
    await agree_partition_count(kv, 3)
    assert await read_published(private_nc, timeout=5) == 3


@given(
    published=st.none() | st.integers(1, 64),
    configured=st.none() | st.integers(1, 64),
)
def test_the_count_used_is_the_published_one_and_an_override_must_equal_it(
    published: int | None, configured: int | None
) -> None:
    if published is not None and configured is not None and published != configured:
        with pytest.raises(PartitionCountMismatch):
            agreed_count(published, configured)
    else:
        assert agreed_count(published, configured) == (
            published if published is not None else configured
        )


class LaggingReplica:
    """A KV bucket whose create finds the key while the first gets, answered by a replica
    still behind its leader, do not (what a cluster restarted at once answered)."""

    def __init__(self, published: int, misses: int, create_misses: int = 0) -> None:
        self.value = str(published).encode()
        self.misses = misses
        self.create_misses = create_misses
        self.creates = 0
        self.gets = 0

    async def create(self, key: str, value: bytes) -> int:
        self.creates += 1
        if self.creates <= self.create_misses:
            # nats-py's create reads the key to tell a deleted one apart; a lagging replica
            # answers that read "not found", and create raises it (an APIError with no
            # err_code): what a CI run's cluster restart hit.
            raise nats.js.errors.KeyNotFoundError()
        raise nats.js.errors.KeyWrongLastSequenceError()

    async def get(self, key: str) -> Any:
        self.gets += 1
        if self.gets <= self.misses:
            raise nats.js.errors.KeyNotFoundError()
        return SimpleNamespace(value=self.value)


async def test_a_count_not_readable_yet_is_read_again_not_a_crash() -> None:
    """A key the create found and the get did not is tried again until it reads, then
    agreed (or refused) like any other published count."""
    bucket = LaggingReplica(published=4, misses=2)
    await agree_partition_count(cast(KeyValue, bucket), 4, deadline=30)
    assert bucket.gets == 3
    with pytest.raises(PartitionCountMismatch):
        await agree_partition_count(cast(KeyValue, LaggingReplica(4, 1)), 2, deadline=30)


async def test_a_count_create_cannot_read_back_yet_is_tried_again_not_a_crash() -> None:
    bucket = LaggingReplica(published=4, misses=0, create_misses=2)
    await agree_partition_count(cast(KeyValue, bucket), 4, deadline=30)
    assert (bucket.creates, bucket.gets) == (3, 1)


async def test_a_prepare_nobody_received_is_sent_again_once_a_coordinator_serves(
    private_nc: Client,
) -> None:
    """Between two owners of a partition (a takeover, a rebalance) a prepare gets no
    responders: nothing was stored, so the producer sends it again after about a second
    (its `prepare_retries`) instead of failing the caller; with no retries left it fails
    at once, saying when to come back."""
    async with run_coordinator(private_nc):
        pass  # the count is published; nobody serves the partition any more
    async with TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT) as producer:
        async with TransactionProducer(
            private_nc, "shop", lambda view: Decision.COMMIT, prepare_retries=0
        ) as impatient:
            with pytest.raises(PrepareFailed, match="is it running") as alone:
                await impatient.send_in_transaction(TxMessage("orders", b"x"), lambda m, a: None)
        assert alone.value.retry_after is not None, "nothing was stored: come back"

        with structlog.testing.capture_logs() as logs:
            results: list[TransactionResult] = []

            async def send() -> None:
                results.append(
                    await producer.send_in_transaction(
                        TxMessage("orders", b"y"), lambda m, a: Decision.COMMIT
                    )
                )

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                await eventually(
                    lambda: [e for e in logs if e.get("code") == "no_responders"],
                    until=bool,
                )
                async with run_coordinator(private_nc):
                    await eventually(lambda: results, until=bool, timeout=10)
    assert [r.state for r in results] == ["committed"]


async def test_an_acked_end_nobody_received_is_sent_again_once_a_coordinator_serves(
    private_nc: Client,
) -> None:
    """An acknowledged end that finds nobody serving its partition (a handover) is sent again
    after about a second, and confirmed by the next owner, instead of waiting for the
    check-back (after the transaction timeout)."""
    ended: list[TransactionResult] = []
    async with (
        TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT) as producer,
        producer.begin() as txn,
    ):
        async with run_coordinator(private_nc):
            await txn.send(TxMessage("orders", b"z"))
        # nobody serves the partition now; the half is stored
        with structlog.testing.capture_logs() as logs:

            async def commit() -> None:
                ended.append(await txn.commit())

            async with anyio.create_task_group() as tg:
                tg.start_soon(commit)
                await eventually(lambda: [e for e in logs if e["event"] == "end_retry"])
                async with run_coordinator(private_nc):
                    await eventually(lambda: ended, timeout=10)
    assert [(r.state, r.confirmed) for r in ended] == [("committed", True)]
    assert (await topic_ids(private_nc, "orders")).count(f"{ended[0].txid}:0") == 1


HUGE = b"9" * 30
"""What a client wrote in a chaos run: a producer built one link per partition."""


def _restored(metrics: CoordinatorMetrics) -> float:
    return metrics.registry.get_sample_value("txactors_partition_count_restored_total") or 0.0


async def test_a_count_written_over_a_running_coordinators_is_put_back(
    private_nc: Client,
) -> None:
    """Another count (or none, or no count at all) in the key while a coordinator runs is
    nobody's decision: it is put back, logged and counted, and the coordinator serves on."""
    metrics = CoordinatorMetrics()
    options = CoordinatorOptions(partitions=4, lease_ttl=2)
    with structlog.testing.capture_logs() as logs:
        async with run_coordinator(private_nc, options=options, metrics=metrics) as running:
            await eventually(lambda: running.partitions, until=lambda p: p == [0, 1, 2, 3])
            kv = await private_nc.jetstream().key_value(layout.META_BUCKET)
            assert _restored(metrics) == 0.0, "exported from the start"
            for n, written in enumerate([b"8", None, HUGE], start=1):
                if written is None:
                    await kv.delete(layout.PARTITIONS_KEY)
                else:
                    await kv.put(layout.PARTITIONS_KEY, written)
                await eventually(
                    lambda: read_published(private_nc, timeout=5),
                    until=lambda count: count == PARTITIONS,
                    ignoring=(PartitionCountInvalid,),
                    what=f"the count put back over {written!r}",
                )
                await eventually(lambda: _restored(metrics), until=lambda c, n=n: c == n)
            await admin.list_transactions(private_nc, timeout=5)  # all 4 still served
            assert running.partitions == [0, 1, 2, 3]
    restored = [e for e in logs if e["event"] == "partition_count_restored"]
    assert [(e["log_level"], e["found"]) for e in restored] == [
        ("error", "'8'"),
        ("error", None),
        ("error", layout.shown(HUGE.decode())),
    ]


async def test_a_starting_coordinator_replaces_a_value_that_is_no_count(
    private_nc: Client,
) -> None:
    """No client routes by a value that is not a count, so nobody serves it: the first
    coordinator to start writes its own over it (another count is refused, as always)."""
    kv = await meta_bucket(private_nc.jetstream(), replicas=1)
    for garbage, count in ((b"x", 3), (HUGE, 2), (b"0", 4)):
        await kv.put(layout.PARTITIONS_KEY, garbage)
        with pytest.raises(PartitionCountInvalid):
            await read_published(private_nc, timeout=5)
        async with run_coordinator(private_nc, options=CoordinatorOptions(partitions=count)):
            assert await read_published(private_nc, timeout=5) == count


@pytest.mark.parametrize(
    "written",
    [HUGE, b"9" * 5000, b"4097", b"0", b"-4", b"4 partitions", b"\xff"],
    ids=["30 digits", "5000 digits", "4097", "0", "negative", "words", "not ascii"],
)
async def test_a_producer_refuses_a_value_that_is_no_count_before_it_allocates(
    private_nc: Client, written: bytes
) -> None:
    kv = await meta_bucket(private_nc.jetstream(), replicas=1)
    await kv.put(layout.PARTITIONS_KEY, written)
    producer = TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT)
    with anyio.fail_after(5), pytest.raises(ConfigError, match="KV bucket TXN_META holds") as bad:
        await producer.__aenter__()
    assert isinstance(bad.value, PartitionCountInvalid)
    assert len(str(bad.value)) < 300, "the value is shown cut short"


async def test_a_huge_count_published_after_a_producer_started_fails_its_first_send(
    private_nc: Client,
) -> None:
    """The count is read by the first transaction when none was published at start: a huge
    one is refused there, before a link (or anything per partition) is made."""
    async with TransactionProducer(private_nc, "shop", lambda view: Decision.COMMIT) as producer:
        kv = await meta_bucket(private_nc.jetstream(), replicas=1)
        await kv.put(layout.PARTITIONS_KEY, HUGE)
        with anyio.fail_after(5), pytest.raises(PartitionCountInvalid, match="999999"):
            await producer.send_in_transaction(TxMessage("orders", b"x"), lambda m, a: None)


async def test_a_producer_makes_links_only_for_the_partitions_it_uses(private_nc: Client) -> None:
    """At the largest count a producer still builds nothing per partition up front: the
    links of a partition are made when a transaction first goes there."""
    kv = await meta_bucket(private_nc.jetstream(), replicas=1)
    await kv.put(layout.PARTITIONS_KEY, str(layout.MAX_PARTITION_COUNT).encode())
    async with TransactionProducer(
        private_nc, "shop", lambda view: Decision.COMMIT, prepare_retries=0
    ) as producer:
        for _ in range(3):  # nobody serves: each fails, and the next goes elsewhere
            with pytest.raises(PrepareFailed):
                await producer.send_in_transaction(TxMessage("orders", b"x"), lambda m, a: None)
        assert len(producer._client._links) == 3
