"""The Spark sink against a real nats-server and a local Spark: what was committed is what the
tables hold, exactly once, across reruns and a kill -9 mid-batch.

One SparkSession serves the whole module (starting one costs seconds and a JVM); tests that need
a fresh process (the kill, the catalog read back) run the `txactors sink` CLI as a subprocess
on a warehouse of their own, since Derby lets one JVM at a time open a metastore.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client

from spark_sinks.catalog import checkpoint_dir, store_dir
from spark_sinks.errors import JavaNotFound, SchemaError
from spark_sinks.job import BatchProgress, run_sink
from spark_sinks.schema import BatchBuilder, Committed, payload_columns, spark_schema
from spark_sinks.session import check_java
from spark_sinks.source import split_range
from tests.conftest import MakeNatsServer
from tests.support.spark_models import Address, Currency, Everything, Priority, Transfer
from tests.support.txn import topic_messages
from txactors import layout
from txactors.config import NatsConfig
from txactors.coordinator.service import run_coordinator
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.topics import ensure_topic_stream

pytestmark = [
    pytest.mark.spark,
    pytest.mark.timeout(600),
    # py4j's socket clean-up at interpreter shutdown and pyspark's own deprecations
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore:.*distutils.*:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parent.parent
TXACTORS = str(Path(sys.executable).parent / "txactors")


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from spark_sinks.session import local_session

    session = local_session(tmp_path_factory.mktemp("warehouse"), master="local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def warehouse(spark: Any) -> Path:
    return Path(spark.conf.get("spark.sql.warehouse.dir").removeprefix("file:"))


def sink(
    spark: Any, warehouse: Path, url: str, topics: dict[str, Any], **kw: Any
) -> list[BatchProgress]:
    """run_sink, collecting each batch's progress. Call it on a thread: it runs an event loop."""
    seen: list[BatchProgress] = []
    run_sink(spark, warehouse, topics, nats=NatsConfig(url=url), on_progress=seen.append, **kw)
    return seen


async def publish_raw(nc: Client, topic: str, bodies: list[bytes], *, prefix: str) -> None:
    """Publish as the coordinator does (same headers), without transactions: for bulk data."""
    js = nc.jetstream()
    await ensure_topic_stream(js, topic)
    now = f"{time.time():.6f}"
    for start in range(0, len(bodies), 1_000):
        acks = [
            await js.publish_async(
                layout.topic_subject(topic),
                body,
                headers={
                    layout.MSG_ID_HEADER: layout.message_id(f"{prefix}{i}", 0),
                    layout.TXID_HEADER: f"{prefix}{i}",
                    layout.GROUP_HEADER: "bulk",
                    layout.KEYS_HEADER: f"k{i}",
                    layout.COMMITTED_AT_HEADER: now,
                },
            )
            for i, body in enumerate(bodies[start : start + 1_000], start)
        ]
        await asyncio.gather(*acks)


async def connect(make_nats_server: MakeNatsServer) -> tuple[str, Client]:
    server = await make_nats_server()
    return server.url, await nats.connect(server.url)


# -- without Spark running: mapping, batches, splitting ------------------------------------


def test_every_supported_type_maps_to_a_spark_column() -> None:
    from pyspark.sql import types as T

    types = {f.name: f.dataType for f in spark_schema(Everything).fields}
    address = T.StructType(
        [T.StructField("street", T.StringType()), T.StructField("zip_code", T.LongType())]
    )
    assert types["number"] == T.LongType()
    assert types["ratio"] == T.DoubleType()
    assert types["name"] == T.StringType()
    assert types["flag"] == T.BooleanType()
    assert types["blob"] == T.BinaryType()
    assert types["at"] == T.TimestampType()
    assert types["day"] == T.DateType()
    assert types["price"] == T.DecimalType(38, 18)
    assert types["maybe"] == T.LongType()
    assert types["tags"] == T.ArrayType(T.StringType())
    assert types["scores"] == T.ArrayType(T.LongType())
    assert types["address"] == address
    assert types["addresses"] == T.ArrayType(address)
    assert types["currency"] == T.StringType()
    assert types["priority"] == T.LongType()
    assert types["mode"] == T.StringType()
    assert types["ident"] == T.StringType()
    assert types["attrs"] == T.MapType(T.StringType(), T.DoubleType())
    assert list(types)[:9] == [
        "topic", "stream_seq", "msg_id", "txid", "producer_group", "tag", "keys",
        "committed_at", "event_date",
    ]  # fmt: skip
    assert list(types)[-2:] == ["payload", "_error"]


def test_unmappable_fields_and_name_clashes_are_refused_up_front() -> None:
    class Untyped(msgspec.Struct):
        anything: Any

    class Clash(msgspec.Struct):
        txid: str

    with pytest.raises(SchemaError, match=r"Untyped\.anything"):
        payload_columns(Untyped)
    with pytest.raises(SchemaError, match="metadata column"):
        payload_columns(Clash)


def test_a_value_that_does_not_fit_its_column_makes_a_reject_not_a_failure() -> None:
    good = Transfer("t1", "a", "b", Decimal("1.25"), Currency.EUR)
    too_precise = Transfer("t2", "a", "b", Decimal("1." + "1" * 30), Currency.EUR)
    messages = [
        Committed(i + 1, 0, {layout.COMMITTED_AT_HEADER: "86400.5"}, msgspec.msgpack.encode(t))
        for i, t in enumerate([good, too_precise])
    ] + [Committed(3, 0, {}, b"\xc1")]
    batch = BatchBuilder("transfers", Transfer).build(messages).to_pylist()
    assert [row["amount"] for row in batch] == [Decimal("1.25"), None, None]
    assert batch[0]["_error"] is None and batch[0]["payload"] is None
    assert "amount" in batch[1]["_error"] and batch[1]["payload"] == messages[1].data
    assert "DecodeError" in batch[2]["_error"]
    assert batch[0]["event_date"] == dt.date(1970, 1, 2)


def test_a_batch_range_is_split_for_parallel_reads() -> None:
    parts = split_range("t", 1, 20_000, parallelism=3)
    assert [(p.first, p.last) for p in parts] == [(1, 6667), (6668, 13334), (13335, 20000)]
    assert [(p.first, p.last) for p in split_range("t", 5, 104, 4)] == [(5, 104)]
    assert split_range("t", 10, 9, 2) == []


def test_missing_java_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from txactors.cli import app

    monkeypatch.setenv("JAVA_HOME", "/nonexistent/jdk")
    with pytest.raises(JavaNotFound, match="openjdk-17"):
        check_java()
    result = CliRunner().invoke(app, ["sink", "query", "select 1", "--warehouse", str(tmp_path)])
    assert result.exit_code == 2
    assert "needs Java 17+" in result.output and "JAVA_HOME" in result.output


# -- through Spark ------------------------------------------------------------------------


async def checker(view: CheckView) -> Decision:
    return Decision.ROLLBACK


async def test_the_table_holds_every_committed_message_once_and_no_rolled_back_one(
    make_nats_server: MakeNatsServer, spark: Any, warehouse: Path
) -> None:
    url, nc = await connect(make_nats_server)
    topic = "transfers"
    committed: list[Transfer] = []

    async def send(count: int, start: int) -> None:
        async with run_coordinator(nc), TransactionProducer(nc, "bank", checker) as producer:
            for i in range(start, start + count):
                transfer = Transfer(f"t{i}", "alice", "bob", Decimal(i) / 4, Currency.EUR)
                try:
                    async with producer.begin() as txn:
                        await txn.send(TxMessage(topic, transfer, keys=[f"t{i}"]))
                        if i % 4 == 3:
                            raise RuntimeError("the local transaction failed")
                    committed.append(transfer)
                except RuntimeError:
                    pass
        while len(await topic_messages(nc, topic)) < len(committed):
            await asyncio.sleep(0.05)

    try:
        await send(40, 0)
        first = await asyncio.to_thread(sink, spark, warehouse, url, {topic: Transfer})
        await send(12, 40)
        second = await asyncio.to_thread(sink, spark, warehouse, url, {topic: Transfer})
    finally:
        await nc.close()

    assert sum(p.rows for p in first) == 30 and sum(p.rows for p in second) == 9
    assert second[-1].lag == 0
    rows = spark.sql(f"select * from {topic}").collect()
    assert sorted(r.transfer_id for r in rows) == sorted(t.transfer_id for t in committed)
    for row in rows:
        sent = next(t for t in committed if t.transfer_id == row.transfer_id)
        assert (row.source, row.target, row.amount, row.currency) == (
            sent.source,
            sent.target,
            sent.amount,
            sent.currency.value,
        )
        assert row.producer_group == "bank" and row.keys == [sent.transfer_id]
        assert row.msg_id == f"{row.txid}:0" and row.event_date == row.committed_at.date()
    assert "payload" not in spark.table(topic).columns


async def test_every_type_lands_typed_and_undecodable_payloads_land_in_rejects(
    make_nats_server: MakeNatsServer, spark: Any, warehouse: Path
) -> None:
    url, nc = await connect(make_nats_server)
    at = dt.datetime(2026, 3, 4, 5, 6, 7, 890_000, tzinfo=dt.UTC)
    values = [
        Everything(
            number=-(2**62) + i,
            ratio=0.5 + i,
            name=f"name-{i}",
            flag=bool(i % 2),
            blob=bytes([i, 0, 255]),
            at=at + dt.timedelta(days=i),
            day=dt.date(2026, 1, 1 + i),
            price=Decimal("12345678901234567890.123456789012345678"),
            maybe=None if i % 2 else i,
            tags=["x", f"t{i}"],
            scores={i, 7},
            address=Address("Main St", None if i % 2 else 1234),
            addresses=[Address("A"), Address("B", 5)],
            currency=Currency.USD,
            priority=Priority.HIGH,
            mode="b",
            ident=uuid.UUID(int=i),
            attrs={"w": 1.5},
        )
        for i in range(3)
    ]
    bodies = [msgspec.msgpack.encode(v) for v in values]
    bodies += [b"\xc1 is never msgpack", msgspec.msgpack.encode({"number": "wrong"})]
    try:
        await publish_raw(nc, "everything", bodies, prefix="e")
        await publish_raw(nc, "rawbytes", [b"one", b"two"], prefix="r")
    finally:
        await nc.close()
    topics = {"everything": Everything, "rawbytes": None}
    await asyncio.to_thread(sink, spark, warehouse, url, topics)

    rows = sorted(spark.table("everything").collect(), key=lambda r: r.stream_seq)
    assert len(rows) == 3
    for row, value in zip(rows, values, strict=True):
        assert row.number == value.number and row.ratio == value.ratio and row.name == value.name
        assert row.flag == value.flag and bytes(row.blob) == value.blob
        assert row.at.replace(tzinfo=dt.UTC) == value.at  # session time zone is UTC
        assert row.day == value.day and row.price == value.price and row.maybe == value.maybe
        assert row.tags == value.tags and sorted(row.scores) == sorted(value.scores)
        assert row.address.asDict() == msgspec.structs.asdict(value.address)
        assert [a.asDict() for a in row.addresses] == [
            msgspec.structs.asdict(a) for a in value.addresses
        ]
        assert (row.currency, row.priority, row.mode) == ("USD", 2, "b")
        assert row.ident == str(value.ident) and row.attrs == value.attrs

    rejects = spark.sql("select * from _rejects where topic = 'everything' order by stream_seq")
    found = rejects.collect()
    assert [bytes(r.payload) for r in found] == bodies[3:]
    assert found[0].error.startswith("DecodeError")
    assert "Expected `int`, got `str`" in found[1].error
    raw = spark.sql("select payload from rawbytes order by stream_seq").collect()
    assert [bytes(r.payload) for r in raw] == [b"one", b"two"]

    store = store_dir(warehouse, "everything")
    on_disk = {p.relative_to(store).parent.as_posix() for p in store.rglob("*.parquet")}
    dates = {r.event_date for r in spark.sql("select event_date from everything").collect()}
    assert on_disk == {f"topic=everything/event_date={d.isoformat()}" for d in dates}


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TXACTORS, "sink", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )


async def test_a_run_killed_mid_batch_is_finished_by_the_next_without_loss_or_duplicates(
    make_nats_server: MakeNatsServer, spark: Any, tmp_path: Path
) -> None:
    url, nc = await connect(make_nats_server)
    topic, count = "payments", 20_000
    transfers = [Transfer(f"p{i}", "a", "b", Decimal(i), Currency.EUR) for i in range(count)]
    try:
        await publish_raw(nc, topic, [msgspec.msgpack.encode(t) for t in transfers], prefix="p")
    finally:
        await nc.close()
    own = tmp_path / "warehouse"  # Derby: one JVM per metastore, so not the module's
    env = {**os.environ, "NATS_URL": url, "TXACTORS_WAREHOUSE": str(own)}
    run = [
        "run", "--topics", topic, "--once", "--max-rows-per-batch", "5000",
        "--schema", f"{topic}=tests.support.spark_models:Transfer",
    ]  # fmt: skip

    log = tmp_path / "killed-run.log"
    with log.open("w") as log_file:
        victim = await asyncio.create_subprocess_exec(
            TXACTORS, "sink", *run, env=env, cwd=ROOT, stdout=log_file, stderr=log_file
        )
    offsets = checkpoint_dir(own, topic) / "offsets"
    commits = checkpoint_dir(own, topic) / "commits"
    deadline = time.monotonic() + 240
    try:
        # Kill once batch 0 is committed and batch 1 planned but not committed: mid-batch.
        while not ((commits / "0").exists() and (offsets / "1").exists()):
            assert victim.returncode is None, log.read_text()
            assert time.monotonic() < deadline, "the first run never got to its second batch"
            await asyncio.sleep(0.05)
        assert not (commits / "1").exists()
    finally:
        if victim.returncode is None:
            victim.send_signal(signal.SIGKILL)
        await victim.wait()

    rerun = await asyncio.to_thread(run_cli, *run, env=env)
    assert rerun.returncode == 0, rerun.stderr
    assert "lag 0" in rerun.stderr

    table = spark.read.parquet(str(store_dir(own, topic)))
    assert table.count() == count
    assert table.select("stream_seq").distinct().count() == count
    assert {r.transfer_id for r in table.select("transfer_id").collect()} == {
        t.transfer_id for t in transfers
    }

    # The catalog outlives the process: a fresh one finds the table by name.
    query = await asyncio.to_thread(
        run_cli, "query", f"select count(*) as n, count(distinct txid) as d from {topic}", env=env
    )
    assert query.returncode == 0, query.stderr
    assert query.stdout.count(str(count)) == 2, query.stdout


async def test_continuous_mode_sinks_new_commits_as_they_come_until_stopped(
    make_nats_server: MakeNatsServer, spark: Any, warehouse: Path
) -> None:
    url, nc = await connect(make_nats_server)
    stop = threading.Event()
    seen: list[BatchProgress] = []

    async def rows_reach(count: int) -> None:
        deadline = time.monotonic() + 120
        while sum(p.rows for p in seen) < count:
            assert time.monotonic() < deadline, seen
            await asyncio.sleep(0.2)

    job = asyncio.ensure_future(
        asyncio.to_thread(
            run_sink, spark, warehouse, {"live": None}, nats=NatsConfig(url=url), once=False,
            interval=0.5, on_progress=seen.append, stop=stop,
        )
    )  # fmt: skip
    try:
        await publish_raw(nc, "live", [b"a", b"b"], prefix="first")
        await rows_reach(2)
        await publish_raw(nc, "live", [b"c"], prefix="second")
        await rows_reach(3)
    finally:
        stop.set()
        await job
        await nc.close()
    assert seen[-1].lag == 0
    payloads = spark.sql("select payload from live order by stream_seq").collect()
    assert [bytes(r.payload) for r in payloads] == [b"a", b"b", b"c"]
