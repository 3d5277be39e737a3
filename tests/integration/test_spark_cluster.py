"""The Spark sink on a Spark standalone cluster: a master and two workers started from the
pyspark install, `txactors sink run --master spark://…` against them, and the same input sunk
by a local run for comparison.

What this shows, from Spark's own event log: a batch's input partitions are read by the
executors, two at once on two workers; and the tables (rows, partition directories, batches)
are exactly those of `--master local[2]`. The warehouse is a local directory, which on one
machine is the shared storage a real cluster needs (docs/spark.md "On a cluster").
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import msgspec
import pyarrow.parquet as pq  # type: ignore[import-untyped]
import pytest

from spark_sinks.catalog import checkpoint_dir, default_checkpoints, store_dir
from spark_sinks.checkpoint import offsets_of, position
from spark_sinks.offsets import StreamPosition
from tests.integration.test_spark_sink import checker, connect, publish_raw
from tests.support.servers import MakeNatsServer
from tests.support.spark_models import Currency, Transfer
from tests.support.txn import topic_messages
from txactors.coordinator.service import run_coordinator
from txactors.producer import TransactionProducer, TxMessage

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
TXACTORS = str(Path(sys.executable).parent / "txactors")
MODELS = "driver_only_models"
"""The payload Structs' module, importable only from the driver's PYTHONPATH (`models`): the
executors import it only if the sink hands them that path, as it must on a real cluster (the
venv's editable install would hand them the project itself)."""
BATCH = 10_000
"""maxOffsetsPerTrigger: each bulk batch is two input partitions (source.MIN_PARTITION_SIZE)."""
TOPICS = {"transfers": 3 * BATCH, "rawbytes": 500}
"""Topics and their messages; `orders` has a few real transactions besides. The queries of
the small ones (one partition each) compete for the two executors only in the first batch of
`transfers`, so its later batches have both executors to themselves."""
WORKERS = 2
DEADLINE = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Cluster:
    master: str
    webui: int
    worker_uis: list[int]


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _daemon_env(tmp: Path) -> dict[str, str]:
    """The daemons' environment: loopback only, small heaps, nothing of ours on PYTHONPATH
    (the executors must get it from the driver, as on machines of their own)."""
    conf = tmp / "conf"
    conf.mkdir(exist_ok=True)  # no spark-defaults.conf but ours (none)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYSPARK_PYTHON")}
    env.update(
        SPARK_HOME=str(_spark_home()),
        SPARK_CONF_DIR=str(conf),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(tmp / "logs"),
        SPARK_DAEMON_MEMORY="256m",
    )
    return env


def _master_json(webui: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{webui}/json", timeout=5) as reply:
        found: dict[str, Any] = json.load(reply)
        return found


MASTER_AT = re.compile(r"Starting Spark master at (spark://\S+)")
MASTER_UI_AT = re.compile(r"Bound MasterWebUI to \S+, and started at http://[^:]+:(\d+)")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A standalone master and two one-core workers; every JVM is killed after the test.

    The master is asked for free ports, but another process may take one first: Spark then
    binds the next port. So the workers are given the master URL and UI port the master's log
    says it bound, not the ones asked for."""
    spark_class = str(_spark_home() / "bin" / "spark-class")
    env = _daemon_env(tmp_path)
    deploy = "org.apache.spark.deploy"
    daemons: list[subprocess.Popen[bytes]] = []

    def start(command: list[str]) -> Path:
        log_path = tmp_path / f"daemon-{len(daemons)}.log"
        with log_path.open("wb") as log:
            daemons.append(
                subprocess.Popen(
                    command, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )  # fmt: skip
        return log_path

    try:
        master_log = start(
            [spark_class, f"{deploy}.master.Master", "--host", "127.0.0.1",
             "--port", str(free_port()), "--webui-port", str(free_port())]
        )  # fmt: skip
        master, webui = _master_bound(master_log, daemons, tmp_path)
        for i in range(WORKERS):
            work = tmp_path / f"worker-{i}"
            work.mkdir()
            start(
                [spark_class, f"{deploy}.worker.Worker", master, "--host", "127.0.0.1",
                 "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()), "--work-dir",
                 str(work)]
            )  # fmt: skip
        worker_uis = _wait_for_workers(webui, daemons, tmp_path)
        yield Cluster(master, webui, worker_uis)
    finally:
        for daemon in daemons:  # each in its own process group: the JVM and anything it ran
            if daemon.poll() is None:
                os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()


def _daemon_logs(tmp: Path) -> str:
    return "\n".join(p.read_text()[-2000:] for p in sorted(tmp.glob("daemon-*.log")))


def _master_bound(log: Path, daemons: list[subprocess.Popen[bytes]], tmp: Path) -> tuple[str, int]:
    """The master's URL and UI port, as its log reports them once both are bound."""
    deadline = time.monotonic() + DEADLINE
    while True:
        text = log.read_text()
        url, ui = MASTER_AT.search(text), MASTER_UI_AT.search(text)
        if url and ui:
            return url.group(1), int(ui.group(1))
        assert daemons[0].poll() is None, f"the Spark master exited\n{_daemon_logs(tmp)}"
        assert time.monotonic() < deadline, f"the Spark master did not bind\n{_daemon_logs(tmp)}"
        time.sleep(0.2)


def _wait_for_workers(webui: int, daemons: list[subprocess.Popen[bytes]], tmp: Path) -> list[int]:
    """The UI ports of the workers, once all of them are alive (as the master sees them)."""
    deadline = time.monotonic() + DEADLINE
    alive: list[int] = []
    while True:
        exited = [d.args for d in daemons if d.poll() is not None]
        logs = _daemon_logs(tmp)
        assert not exited, f"a Spark daemon exited: {exited}\n{logs}"
        assert time.monotonic() < deadline, f"{len(alive)} of {WORKERS} workers alive\n{logs}"
        try:
            workers = _master_json(webui)["workers"]
            alive = [_port(w["webuiaddress"]) for w in workers if w["state"] == "ALIVE"]
        except OSError:
            pass  # the master's UI is not up yet
        if len(alive) == WORKERS:
            return sorted(alive)
        time.sleep(0.5)


def _port(url: str) -> int:
    port = urlparse(url).port
    assert port is not None, url
    return port


@pytest.fixture
def models(tmp_path: Path) -> Path:
    directory = tmp_path / "models"
    directory.mkdir()
    (directory / f"{MODELS}.py").write_text(
        '"""Only on the driver\'s PYTHONPATH."""\n\n'
        "from tests.support.spark_models import Transfer\n\n"
        '__all__ = ["Transfer"]\n'
    )
    return directory


def sink_run(warehouse: Path, url: str, master: str, models: Path, *extra: str) -> str:
    """`txactors sink run --once` over every topic on `master`; returns its stderr."""
    topics = [*TOPICS, "orders"]
    command = [
        TXACTORS, "sink", "run", "--once", "--topics", ",".join(topics),
        "--schema", f"transfers={MODELS}:Transfer", "--schema", f"orders={MODELS}:Transfer",
        "--max-offsets-per-trigger", str(BATCH), "--parallelism", "2",
        "--master", master, *extra,
    ]  # fmt: skip
    env = {
        **os.environ,
        "NATS_URL": url,
        "TXACTORS_WAREHOUSE": str(warehouse),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(models)]),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    # Its own process group, so a run that overstays takes its driver JVM down with it.
    with subprocess.Popen(
        command, env=env, cwd=warehouse.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    ) as run:  # fmt: skip
        try:
            _, stderr = run.communicate(timeout=600)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, stderr[-5000:]
    return stderr


async def commit_input(nc: Any) -> int:
    """Bulk topics (one with undecodable payloads among its rows) and real transactions."""
    transfers = [
        Transfer(f"t{i}", "a", "b", Decimal(i), Currency.EUR) for i in range(TOPICS["transfers"])
    ]
    bodies = [
        b"\xc1" if i % 1_000 == 999 else msgspec.msgpack.encode(t) for i, t in enumerate(transfers)
    ]
    await publish_raw(nc, "transfers", bodies, prefix="t")
    await publish_raw(
        nc, "rawbytes", [b"raw %d" % i for i in range(TOPICS["rawbytes"])], prefix="r"
    )
    committed = 0
    async with run_coordinator(nc), TransactionProducer(nc, "shop", checker) as producer:
        for i in range(12):
            try:
                async with producer.begin() as txn:
                    transfer = Transfer(f"o{i}", "shop", "bank", Decimal(i) / 4, Currency.USD)
                    await txn.send(TxMessage("orders", transfer, keys=[f"o{i}"]))
                    if i % 3 == 2:
                        raise RuntimeError("rolled back")
                committed += 1
            except RuntimeError:
                pass
    deadline = time.monotonic() + 30
    while len(await topic_messages(nc, "orders")) < committed:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    return committed


async def test_the_sink_on_a_standalone_cluster_reads_in_the_executors_and_writes_what_local_does(
    make_nats_server: MakeNatsServer, cluster: Cluster, models: Path, tmp_path: Path
) -> None:
    url, nc = await connect(make_nats_server)
    try:
        orders = await commit_input(nc)
    finally:
        await nc.close()
    events = tmp_path / "events"
    events.mkdir()
    on_cluster = tmp_path / "cluster" / "warehouse"
    on_cluster.parent.mkdir()
    stderr = await asyncio.to_thread(
        sink_run, on_cluster, url, cluster.master, models,
        "--conf", "spark.executor.memory=512m",
        "--conf", "spark.eventLog.enabled=true",
        "--conf", "spark.eventLog.rolling.enabled=false",  # one file, plain JSON lines
        "--conf", "spark.eventLog.compress=false",
        "--conf", f"spark.eventLog.dir={events.as_uri()}",
        # Schedule nothing before both executors are there, so both get the first batch too.
        "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
        "--conf", "spark.scheduler.maxRegisteredResourcesWaitingTime=180s",
    )  # fmt: skip
    assert "lag 0" in stderr

    # (a) Spark's account: every read task ran in an executor of the cluster; each batch of
    # `transfers` was two partitions, and they were read at the same time by executors on
    # both workers (in each batch that did not share the executors with the small topics).
    tasks = batch_tasks(events)
    executors = executor_workers(events)
    assert sorted(set(executors.values())) == sorted(cluster.worker_uis)
    assert {t.executor for ran in tasks.values() for t in ran} <= set(executors)
    assert {q for q, _ in tasks} == {*TOPICS, "orders"}
    bulk = {b: ran for (q, b), ran in tasks.items() if q == "transfers"}
    assert sorted(bulk) == list(range(TOPICS["transfers"] // BATCH))
    assert all(len(ran) == 2 for ran in bulk.values()), bulk
    parallel = [b for b, ran in bulk.items() if side_by_side(ran, executors)]
    assert parallel, f"no batch of transfers was read on both workers at once: {bulk}"

    # (b) A local run over the same input writes the same tables.
    local = tmp_path / "local" / "warehouse"
    local.parent.mkdir()
    await asyncio.to_thread(sink_run, local, url, "local[2]", models)
    for topic, count in [*TOPICS.items(), ("orders", orders)]:
        here, there = committed_rows(local, topic), committed_rows(on_cluster, topic)
        assert sum(len(rows) for rows in here.values()) == count
        assert there == here, topic
        assert batches(on_cluster, topic) == batches(local, topic)
        assert markers(on_cluster, topic) == markers(local, topic)
    transfers = [r for rows in committed_rows(on_cluster, "transfers").values() for r in rows]
    assert sum(r["_error"] is not None for r in transfers) == TOPICS["transfers"] // 1_000


@dataclass(frozen=True)
class Task:
    executor: str
    launched: int
    finished: int


def side_by_side(ran: list[Task], executors: dict[str, int]) -> bool:
    """Two tasks on executors of different workers, the second started before the first ended."""
    first, second = sorted(ran, key=lambda t: t.launched)
    return executors[first.executor] != executors[second.executor] and (
        second.launched < first.finished
    )


def _events(directory: Path) -> Iterator[dict[str, Any]]:
    (log,) = list(directory.iterdir())  # one application
    with log.open() as lines:
        for line in lines:
            yield json.loads(line)


def batch_tasks(directory: Path) -> dict[tuple[str, int], list[Task]]:
    """{(query, batch): its successful tasks} from the event log: a streaming batch's jobs
    carry the query's name and the batch number in their description."""
    stage_batch: dict[int, tuple[str, int]] = {}
    found: dict[tuple[str, int], list[Task]] = defaultdict(list)
    for event in _events(directory):
        match event["Event"]:
            case "SparkListenerJobStart":
                description = (event.get("Properties") or {}).get("spark.job.description", "")
                lines = description.splitlines()
                if lines and lines[0].startswith("txactors_sink_"):
                    batch = int(next(x for x in lines if x.startswith("batch = ")).split()[-1])
                    for stage in event["Stage IDs"]:
                        stage_batch[stage] = (lines[0].removeprefix("txactors_sink_"), batch)
            case "SparkListenerTaskEnd" if event["Stage ID"] in stage_batch:
                if event["Task End Reason"]["Reason"] == "Success":
                    info = event["Task Info"]
                    task = Task(info["Executor ID"], info["Launch Time"], info["Finish Time"])
                    found[stage_batch[event["Stage ID"]]].append(task)
    return dict(found)


def executor_workers(directory: Path) -> dict[str, int]:
    """{executor id: the web UI port of the worker that ran it} (from its log links)."""
    found = {}
    for event in _events(directory):
        if event["Event"] == "SparkListenerExecutorAdded":
            stdout = event["Executor Info"]["Log Urls"]["stdout"]
            port = urlparse(stdout).port
            assert port is not None
            found[event["Executor ID"]] = port
    return found


def committed_rows(warehouse: Path, topic: str) -> dict[str, list[dict[str, Any]]]:
    """{partition directory: its rows by stream_seq}, from the files the commit log names
    (what every Spark reader of the table sees)."""
    store = store_dir(warehouse, topic)
    files = []
    log = store / "_spark_metadata"
    for entry in sorted(p for p in log.iterdir() if p.name.removesuffix(".compact").isdigit()):
        for line in entry.read_text().splitlines()[1:]:
            record = json.loads(line)
            if record["action"] == "add":
                files.append(Path(unquote(urlparse(record["path"]).path)))
    found: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for file in files:
        found[str(file.parent.relative_to(store))] += pq.read_table(file).to_pylist()
    return {p: sorted(rows, key=lambda r: r["stream_seq"]) for p, rows in found.items()}


def batches(warehouse: Path, topic: str) -> list[dict[str, StreamPosition] | None]:
    """Each committed batch's end offsets, from the query's checkpoint."""
    checkpoint = checkpoint_dir(default_checkpoints(warehouse), topic)
    last = position(checkpoint).committed_batch
    assert last is not None
    return [offsets_of(checkpoint, b) for b in range(last + 1)]


def markers(warehouse: Path, topic: str) -> Any:
    """What the catalog was told: the table's columns and its last batch."""
    return json.loads((warehouse / "_catalog" / f"{topic}.json").read_text())
