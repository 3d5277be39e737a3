"""The Spark sink against a real nats-server and a local Spark: what was committed is what the
tables hold, exactly once, across reruns and a kill -9 mid-batch.

One SparkSession serves the whole module (starting one costs seconds and a JVM); tests that need
a fresh process (the kill, the catalog read back) run the `txactors sink` CLI as a subprocess
on a warehouse of their own, since Derby lets one JVM at a time open a metastore.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
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

from spark_sinks.catalog import checkpoint_dir, default_checkpoints, store_dir
from spark_sinks.errors import DataLoss, JavaNotFound, SchemaError, SinkError
from spark_sinks.job import (
    BatchProgress,
    BatchStarted,
    CaughtUp,
    Progress,
    plan,
    run_sink,
)
from spark_sinks.offsets import (
    Purged,
    Replaced,
    StreamPosition,
    initial_offsets,
    losses,
    parse_starting,
)
from spark_sinks.schema import BatchBuilder, Committed, payload_columns, spark_schema
from spark_sinks.session import check_java
from spark_sinks.source import split_range
from tests.support.servers import MakeNatsServer
from tests.support.spark_models import Address, Currency, Everything, Priority, Transfer
from tests.support.txn import topic_messages
from tests.support.wait import eventually
from txactors.coordinator.service import run_coordinator
from txactors.nats.config import NatsConfig
from txactors.nats.topics import ensure_topic_stream
from txactors.producer import CheckView, Decision, TransactionProducer, TxMessage
from txactors.wire import layout

pytestmark = [
    pytest.mark.spark,
    pytest.mark.timeout(600),
    # py4j's socket clean-up at interpreter shutdown and pyspark's own deprecations
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore:.*distutils.*:DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
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
    seen: list[Progress] = []
    run_sink(spark, warehouse, topics, nats=NatsConfig(url=url), on_progress=seen.append, **kw)
    return [p for p in seen if isinstance(p, BatchProgress)]


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
        await eventually(
            lambda: topic_messages(nc, topic),
            until=lambda messages: len(messages) >= len(committed),
            timeout=30,
            what="every committed transfer on the topic",
        )

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
    # A real table in the metastore, partitioned, in a format Hive and Trino read.
    described = {
        r.col_name: r.data_type for r in spark.sql(f"describe table extended {topic}").collect()
    }
    assert described["Type"] == "EXTERNAL" and described["Provider"] == "parquet"
    assert described["Location"].endswith(f"/{topic}")
    assert "ParquetHiveSerDe" in described["Serde Library"]
    assert "# Partition Information" in described
    partitions = [r.partition for r in spark.sql(f"show partitions {topic}").collect()]
    assert partitions == [f"topic={topic}/event_date={d}" for d in sorted(
        {r.event_date.isoformat() for r in rows}
    )]  # fmt: skip


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

    decoded = spark.sql("select * from everything where _error is null").collect()
    rows = sorted(decoded, key=lambda r: r.stream_seq)
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
        "run", "--topics", topic, "--once", "--max-offsets-per-trigger", "5000",
        "--schema", f"{topic}=tests.support.spark_models:Transfer",
    ]  # fmt: skip

    log = tmp_path / "killed-run.log"
    with log.open("w") as log_file:
        victim = await asyncio.create_subprocess_exec(
            TXACTORS, "sink", *run, env=env, cwd=ROOT, stdout=log_file, stderr=log_file
        )
    offsets = checkpoint_dir(default_checkpoints(own), topic) / "offsets"
    commits = checkpoint_dir(default_checkpoints(own), topic) / "commits"

    def mid_batch() -> bool:
        assert victim.returncode is None, log.read_text()
        return (commits / "0").exists() and (offsets / "1").exists()

    try:
        # Kill once batch 0 is committed and batch 1 planned but not committed: mid-batch.
        await eventually(mid_batch, timeout=240, what="the first run at its second batch")
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

    # Nothing new: the run checks the stream and the checkpoint and starts no JVM.
    started = time.monotonic()
    idle = await asyncio.to_thread(run_cli, *run, env=env)
    assert idle.returncode == 0, idle.stderr
    assert idle.stderr.strip() == f"caught up at {topic} {count:,}"
    assert time.monotonic() - started < 15

    # The catalog outlives the process: a fresh session (spark-sql, as in docs/spark.md)
    # finds the table by name in the metastore and reads it through the commit log.
    sql = await asyncio.to_thread(
        spark_sql, own, f"select count(*), count(distinct txid) from {topic}; "
        f"show partitions {topic}",
    )  # fmt: skip
    assert sql.returncode == 0, sql.stderr
    assert f"{count}\t{count}" in sql.stdout
    assert f"topic={topic}/event_date=" in sql.stdout


def spark_sql(warehouse: Path, sql: str) -> subprocess.CompletedProcess[str]:
    """The spark-sql command of docs/spark.md, on `warehouse`'s metastore."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        [
            str(bin_dir / "spark-sql"),
            "--conf", f"spark.sql.warehouse.dir={warehouse}",
            "--conf",
            f"spark.hadoop.javax.jdo.option.ConnectionURL=jdbc:derby:;databaseName={warehouse}/_metastore",
            "--driver-java-options", f"-Dderby.system.home={warehouse}",
            "-e", sql,
        ],
        env=env, cwd=warehouse, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


async def test_continuous_mode_sinks_new_commits_as_they_come_until_stopped(
    make_nats_server: MakeNatsServer, spark: Any, warehouse: Path
) -> None:
    url, nc = await connect(make_nats_server)
    await ensure_topic_stream(nc.jetstream(), "live")
    stop = threading.Event()
    events: list[Progress] = []

    def batches() -> list[BatchProgress]:
        return [p for p in events if isinstance(p, BatchProgress)]

    async def rows_reach(count: int) -> None:
        await eventually(
            lambda: sum(p.rows for p in batches()),
            until=lambda rows: rows >= count,
            timeout=120,
            what=f"{count} rows written",
            explain=lambda: repr(events),
        )

    async def caught_up(seq: int) -> None:
        """Until the sink, still running, says it read `live` to `seq` and waits for more."""

        def waiting() -> bool:
            assert not job.done(), events
            return CaughtUp({"live": seq}, waiting=True) in events

        await eventually(
            waiting, timeout=120, what=f"caught up at {seq}", explain=lambda: repr(events)
        )

    job = asyncio.ensure_future(
        asyncio.to_thread(
            run_sink, spark, warehouse, {"live": None}, nats=NatsConfig(url=url), once=False,
            interval=0.5, on_progress=events.append, stop=stop,
        )
    )  # fmt: skip
    try:
        await caught_up(0)  # idle before any message
        await publish_raw(nc, "live", [b"a", b"b"], prefix="first")
        await rows_reach(2)
        await publish_raw(nc, "live", [b"c"], prefix="second")
        await rows_reach(3)
        await caught_up(3)
    finally:
        stop.set()
        await job
        await nc.close()
    assert batches()[-1].lag == 0
    assert any(isinstance(e, BatchStarted) and e.last == 3 for e in events), events
    payloads = spark.sql("select payload from live order by stream_seq").collect()
    assert [bytes(r.payload) for r in payloads] == [b"a", b"b", b"c"]


async def test_starting_offsets_and_purged_sequences_as_kafka_users_know_them(
    make_nats_server: MakeNatsServer, spark: Any, warehouse: Path
) -> None:
    url, nc = await connect(make_nats_server)
    nats_config = NatsConfig(url=url)
    js = nc.jetstream()

    def seqs(topic: str) -> list[int]:
        found = spark.sql(f"select stream_seq from {topic} order by stream_seq").collect()
        return [r.stream_seq for r in found]

    try:
        await publish_raw(nc, "lossy", [b"x"] * 10, prefix="a")
        await publish_raw(nc, "later", [b"x"] * 3, prefix="b")
        topics = {"lossy": None, "later": None}
        starting = '{"lossy": 4, "later": -1}'
        first = await asyncio.to_thread(
            sink, spark, warehouse, url, topics, starting_offsets=starting
        )
        assert [(p.topic, p.rows) for p in first] == [("lossy", 7)]  # "later": from its head
        assert seqs("lossy") == list(range(4, 11))

        # Retention purges 11..14 before they are sunk: the run fails before Spark starts.
        await publish_raw(nc, "lossy", [b"y"] * 10, prefix="c")
        await publish_raw(nc, "later", [b"y"] * 2, prefix="d")
        planned = await asyncio.to_thread(plan, warehouse, {"lossy": None}, nats=nats_config)
        await js.purge_stream(layout.topic_stream("lossy"), seq=15)
        with pytest.raises(DataLoss, match=r"TOPIC_lossy: sequences 11\.\.14 were purged"):
            await asyncio.to_thread(plan, warehouse, topics, nats=nats_config)

        # The same check inside the source, for a purge while a query runs: one line too.
        await js.purge_stream(layout.topic_stream("lossy"), seq=17)
        with pytest.raises(DataLoss, match=r"sequences 11\.\.16 were purged") as raised:
            await asyncio.to_thread(
                run_sink, spark, warehouse, planned, nats=nats_config, fail_on_data_loss=True
            )
        assert "\n" not in str(raised.value)

        events: list[Progress] = []
        await asyncio.to_thread(
            run_sink, spark, warehouse, topics, nats=nats_config, fail_on_data_loss=False,
            on_progress=events.append,
        )  # fmt: skip
        assert events[-1] == CaughtUp({"lossy": 20, "later": 5}, waiting=False)
    finally:
        await nc.close()
    assert seqs("lossy") == [*range(4, 11), *range(17, 21)]
    assert seqs("later") == [4, 5]
    assert (checkpoint_dir(default_checkpoints(warehouse), "later") / "commits").is_dir()


def test_starting_offsets_resolve_against_the_streams() -> None:
    from spark_sinks.jetstream_read import Bounds

    bounds = {"TOPIC_a": Bounds(5, 9, "A"), "TOPIC_b": Bounds(0, 0, "B")}
    ab = ["a", "b"]
    assert initial_offsets("earliest", ab, bounds) == {
        "TOPIC_a": StreamPosition(4, "A"), "TOPIC_b": StreamPosition(0, "B"),
    }  # fmt: skip
    assert initial_offsets("latest", ab, bounds)["TOPIC_a"] == StreamPosition(9, "A")
    explicit = parse_starting('{"a": 7, "b": -2}', ab)
    assert initial_offsets(explicit, ab, bounds)["TOPIC_a"] == StreamPosition(6, "A")
    [purged] = losses(["a"], {"TOPIC_a": StreamPosition(2, "A")}, bounds)
    assert purged.describe().startswith("TOPIC_a: sequences 3..4 ")
    assert losses(["a"], {"TOPIC_a": StreamPosition(4, "A")}, bounds) == []
    assert losses(["a"], {"TOPIC_a": StreamPosition(9)}, {"TOPIC_a": Bounds(10, 9, "A")}) == []
    for bad in ("first", '{"a": 1}', '{"a": 1, "b": 1, "c": 1}', '{"a": 0, "b": 1}', "[1]"):
        with pytest.raises(SinkError, match="startingOffsets"):
            parse_starting(bad, ["a", "b"])


async def test_sink_mistakes_are_one_line_before_spark_starts(
    make_nats_server: MakeNatsServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    import spark_sinks.session
    from txactors.cli import app

    url, nc = await connect(make_nats_server)
    try:
        await publish_raw(nc, "transfers", [b"x"], prefix="t")
    finally:
        await nc.close()

    def no_spark(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("Spark was started")

    monkeypatch.setattr(spark_sinks.session, "local_session", no_spark)
    monkeypatch.setenv("NATS_URL", url)
    models = "tests.support.spark_models"
    cases = {
        "no module": (["--schema", "transfers=no_such.module:X"], "cannot import schema"),
        "no attribute": (["--schema", f"transfers={models}:Nope"], "has no attribute 'Nope'"),
        "not a Struct": (["--schema", f"transfers={models}:Currency"], "not a msgspec.Struct"),
        "bad field": (
            ["--schema", "transfers=tests.integration.test_spark_sink:Untyped"],
            "Untyped.anything",
        ),
        "not in --topics": (["--schema", f"transfer={models}:Transfer"], "not in --topics"),
        "no stream": (["--topics", "transfer"], "no stream TOPIC_transfer on the server"),
        "bad start": (["--starting-offsets", "{}"], "startingOffsets"),
        "bad conf": (["--conf", "spark.executor.memory"], "expected KEY=VALUE"),
    }
    for name, (args, message) in cases.items():
        result = await asyncio.to_thread(
            CliRunner().invoke,
            app,
            ["sink", "run", "--topics", "transfers", "--once", *args,
             "--warehouse", str(tmp_path)],
        )  # fmt: skip
        assert result.exit_code == 2, (name, result.output)
        assert result.output.startswith("error: ") and message in result.output, name
        assert result.output.count("\n") == 1, (name, result.output)

    check = await nats.connect(url)
    try:  # the typo made no stream
        with pytest.raises(nats.js.errors.NotFoundError):
            await check.jetstream().stream_info(layout.topic_stream("transfer"))
    finally:
        await check.close()


class Untyped(msgspec.Struct):
    """A Struct with a field no Spark column can hold (a module attribute, for --schema)."""

    anything: Any


def test_a_catalog_held_by_another_process_is_one_line(spark: Any, warehouse: Path) -> None:
    spark.catalog.listTables()  # this session's JVM has the Derby metastore open
    started = time.monotonic()
    result = run_cli(
        "query",
        "select count(*) from transfers",
        env={**os.environ, "TXACTORS_WAREHOUSE": str(warehouse)},
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stdout == ""
    assert result.stderr.startswith("error: the catalog in ") and "another process" in result.stderr
    assert time.monotonic() - started < 30  # no JVM was started to find out


# -- a stream deleted and created again (a demo's rerun), and what old checkpoints hold -------


def test_a_stream_created_again_is_told_from_the_one_read() -> None:
    from spark_sinks.jetstream_read import Bounds

    read = StreamPosition(188, "2026-11-25T10:00:00+00:00")
    again = Bounds(1, 188, "2026-11-25T11:00:00+00:00")
    [loss] = losses(["transfers"], {"TOPIC_transfers": read}, {"TOPIC_transfers": again})
    assert isinstance(loss, Replaced)
    assert "topic 'transfers'" in loss.describe() and "deleted and created again" in loss.describe()
    # Before the identity was kept (a bare sequence): a stream ending below what was read.
    assert StreamPosition.decode(188) == StreamPosition(188)
    assert StreamPosition.decode({"seq": 5, "created": "x"}) == StreamPosition(5, "x")
    shorter = Bounds(1, 40, "later")
    [old] = losses(
        ["transfers"], {"TOPIC_transfers": StreamPosition(188)}, {"TOPIC_transfers": shorter}
    )
    assert isinstance(old, Replaced)
    assert losses(["t"], {"TOPIC_t": StreamPosition(188)}, {"TOPIC_t": Bounds(1, 300, "c")}) == []
    # The same stream, purged: a purge, not a replacement.
    same = Bounds(200, 300, read.created)
    assert losses(["transfers"], {"TOPIC_transfers": read}, {"TOPIC_transfers": same}) == [
        Purged("transfers", 189, 199)
    ]


def test_old_checkpoints_load_and_are_run_once_to_record_the_stream(tmp_path: Path) -> None:
    from spark_sinks.checkpoint import Position, offsets_of
    from spark_sinks.jetstream_read import Bounds
    from spark_sinks.planning import TopicPlan

    offsets = tmp_path / "offsets"
    offsets.mkdir()
    (offsets / "0").write_text('v1\n{"batchWatermarkMs":0}\n{"TOPIC_t": 188}')
    (offsets / "1").write_text('v1\n{}\n{"TOPIC_t": {"seq": 200, "created": "A"}}')
    assert offsets_of(tmp_path, 0) == {"TOPIC_t": StreamPosition(188)}
    assert offsets_of(tmp_path, 1) == {"TOPIC_t": StreamPosition(200, "A")}

    def topic_plan(committed: StreamPosition, bounds: Bounds) -> TopicPlan:
        where = Position(0, {"TOPIC_t": committed}, None, None)
        return TopicPlan("t", None, spark_schema(None), tmp_path, {"t": 1}, where, bounds)

    assert not topic_plan(StreamPosition(188), Bounds(1, 188, "A")).caught_up  # records "A"
    assert topic_plan(StreamPosition(188, "A"), Bounds(1, 188, "A")).caught_up
    assert not topic_plan(StreamPosition(188, "A"), Bounds(1, 188, "B")).caught_up


async def test_the_source_reads_a_stream_created_again_from_its_start_or_fails_in_one_line(
    make_nats_server: MakeNatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    from spark_sinks.source import SequenceRange, SourceOptions, TxactorsStreamReader

    url, nc = await connect(make_nats_server)
    stream = layout.topic_stream("replay")
    try:
        await publish_raw(nc, "replay", [b"old"] * 5, prefix="o")
        first = (await nc.jetstream().stream_info(stream)).created
        assert first is not None
        read = {stream: StreamPosition(5, first.isoformat()).encode()}
        await nc.jetstream().delete_stream(stream)
        await publish_raw(nc, "replay", [b"new"] * 3, prefix="n")
    finally:
        await nc.close()

    def reader(fail: bool) -> TxactorsStreamReader:
        options = {"servers": url, "topics": "replay", "failOnDataLoss": str(fail).lower()}
        return TxactorsStreamReader(SourceOptions.parse(options))

    with pytest.raises(DataLoss, match="TOPIC_replay was deleted and created again") as raised:
        await asyncio.to_thread(reader(True).latestOffset, read)
    assert "\n" not in str(raised.value) and "topic 'replay'" in str(raised.value)

    lenient = reader(False)
    end = await asyncio.to_thread(lenient.latestOffset, read)
    assert StreamPosition.decode(end[stream]).seq == 3
    with caplog.at_level("WARNING", logger="spark_sinks.source"):
        ranges = await asyncio.to_thread(lenient.partitions, read, end)
        again = await asyncio.to_thread(lenient.partitions, read, end)  # a re-run batch
    assert ranges == again == [SequenceRange("replay", 1, 3)]
    said = [r.message for r in caplog.records if "created again" in r.message]
    assert len(said) == 1 and "reading the new stream from its first sequence" in said[0]

    # A checkpoint from before the identity was kept: the new stream ends below its offset.
    old = {stream: 5}
    assert (
        StreamPosition.decode((await asyncio.to_thread(lenient.latestOffset, old))[stream]).seq == 3
    )
    # A batch planned on the old stream, re-run after it was replaced: nothing of it is left.
    assert (
        await asyncio.to_thread(
            lenient.partitions, {stream: StreamPosition(2, first.isoformat()).encode()}, read
        )
        == []
    )


class FakeQuery:
    def __init__(self) -> None:
        self.recentProgress: list[dict[str, Any]] = []


def test_each_batch_is_announced_once_though_its_commit_lands_before_its_progress(
    tmp_path: Path,
) -> None:
    from spark_sinks.checkpoint import position
    from spark_sinks.jetstream_read import Bounds
    from spark_sinks.planning import Plan, TopicPlan
    from spark_sinks.progress import ProgressWatch

    def write(log: str, batch: int, seq: int) -> None:
        (tmp_path / log).mkdir(exist_ok=True)
        body = json.dumps({"TOPIC_t": {"seq": seq, "created": "A"}}) if log == "offsets" else "{}"
        (tmp_path / log / str(batch)).write_text(f"v1\n{{}}\n{body}")

    write("offsets", 0, 10)
    write("commits", 0, 10)
    bounds = Bounds(1, 30, "A")
    planned = Plan(
        tmp_path,
        [TopicPlan("t", None, spark_schema(None), tmp_path, {"t": 1}, position(tmp_path), bounds)],
    )
    query = FakeQuery()
    events: list[Progress] = []
    watch = ProgressWatch(planned, {"t": query}, events.append, waiting=False)  # type: ignore[dict-item]
    write("offsets", 1, 30)
    watch.poll()  # planned: announced
    write("commits", 1, 30)
    watch.poll()  # committed, its progress not posted yet
    offset = json.dumps({"TOPIC_t": {"seq": 30, "created": "A"}})
    start = json.dumps({"TOPIC_t": {"seq": 10, "created": "A"}})
    source = {"startOffset": start, "endOffset": offset, "latestOffset": offset}
    query.recentProgress.append(
        {"batchId": 1, "numInputRows": 20, "sources": [source], "batchDuration": 1000}
    )
    watch.poll()
    watch.poll()
    assert [e for e in events if isinstance(e, BatchStarted)] == [BatchStarted("t", 1, 11, 30)]
    assert [e.rows for e in events if isinstance(e, BatchProgress)] == [20]


def test_an_unreachable_server_is_one_line_and_a_failure(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "NATS_URL": f"nats://127.0.0.1:{port}"}
    result = run_cli(
        "run", "--topics", "transfers", "--once", "--warehouse", str(tmp_path), env=env
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
    assert result.stderr.startswith("error: could not connect to NATS at nats://127.0.0.1:")


def test_local_session_takes_a_path_as_a_string(spark: Any, warehouse: Path) -> None:
    from spark_sinks.session import local_session

    assert local_session(str(warehouse)) is spark  # this process's session, not an error


async def test_a_query_that_never_ran_starts_on_the_stream_created_again(
    make_nats_server: MakeNatsServer, tmp_path: Path
) -> None:
    from spark_sinks.checkpoint import PINNED_START, PinnedStart, pinned_start

    url, nc = await connect(make_nats_server)
    config = NatsConfig(url=url)
    try:
        await publish_raw(nc, "fresh", [b"old"] * 5, prefix="o")
        first = await asyncio.to_thread(
            plan, tmp_path, {"fresh": None}, nats=config, starting_offsets="latest"
        )
        assert first.topics[0].start == {"fresh": 6} and first.topics[0].caught_up
        await nc.jetstream().delete_stream(layout.topic_stream("fresh"))
        await publish_raw(nc, "fresh", [b"new"] * 7, prefix="n")
    finally:
        await nc.close()

    with pytest.raises(DataLoss, match="TOPIC_fresh was deleted and created again"):
        await asyncio.to_thread(plan, tmp_path, {"fresh": None}, nats=config)
    lenient = await asyncio.to_thread(
        plan, tmp_path, {"fresh": None}, nats=config, fail_on_data_loss=False
    )
    [said] = lenient.skipped
    assert "reading the new stream from its first sequence" in said
    assert lenient.topics[0].start == {"fresh": 1} and not lenient.topics[0].caught_up
    again = await asyncio.to_thread(plan, tmp_path, {"fresh": None}, nats=config)
    assert again.topics[0].start == {"fresh": 1} and again.skipped == []

    checkpoint = checkpoint_dir(default_checkpoints(tmp_path), "fresh")
    (checkpoint / PINNED_START).write_text('{"fresh": 3}')  # a pin from before the identity
    assert pinned_start(checkpoint) == PinnedStart({"fresh": 3})
