"""A SparkSession that can run the sink: Java checked, workers importable, catalog persistent.

Three things fail late and vaguely if not set before the JVM starts, so they are settled here:
- Java: Spark 4 needs 17+; without it pyspark dies with "Java gateway process exited".
- Python workers: they must run this interpreter and import `spark_sinks` and `txactors`, or
  Spark reports only "Python worker failed to connect back"; on a cluster, an executor's
  workers get our PYTHONPATH (`spark.executorEnv.PYTHONPATH`), not the worker daemon's.
- The catalog: Spark's Hive catalog with its embedded Derby metastore, kept in the warehouse
  directory, so tables registered by one run are there for the next process (the default
  in-memory catalog forgets them). Derby allows one JVM per metastore at a time, and a second
  one fails with thousands of lines of stack traces: `check_catalog_free` says so in one line
  before a JVM starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from spark_sinks.catalog import METASTORE_DIR
from spark_sinks.errors import CatalogBusy, JavaNotFound

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MIN_JAVA: Final = 17
INSTALL_JAVA: Final = (
    "install a Java 17+ runtime (Debian/Ubuntu: apt install openjdk-17-jre-headless; "
    "macOS: brew install openjdk@17; or any JDK from adoptium.net) and put `java` on PATH "
    "or set JAVA_HOME"
)
PROJECT_ROOT: Final = Path(__file__).resolve().parent.parent
_DERBY_LOCK: Final = "dbex.lck"
"""Derby holds an exclusive file lock on this file while a JVM has the database open."""


def java_version() -> int:
    """The major version of the `java` Spark will use; JavaNotFound when it is missing."""
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if java is None or not Path(java).exists():
        where = f"JAVA_HOME={home}" if home else "PATH"
        raise JavaNotFound(
            f"the Spark sink needs Java {MIN_JAVA}+, none found on {where}: {INSTALL_JAVA}"
        )
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        ).stderr
    except OSError as exc:
        raise JavaNotFound(f"could not run {java} ({exc}): {INSTALL_JAVA}") from exc
    found = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if found is None:
        raise JavaNotFound(f"could not tell the version of {java} from {out!r}: {INSTALL_JAVA}")
    major = int(found.group(1))
    return int(found.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def check_java() -> None:
    major = java_version()
    if major < MIN_JAVA:
        raise JavaNotFound(
            f"the Spark sink needs Java {MIN_JAVA}+, found Java {major}: {INSTALL_JAVA}"
        )


def prepare_python_workers() -> None:
    """Workers run this interpreter and can import the project (set before the JVM starts)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(PROJECT_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *paths])


def check_catalog_free(warehouse: Path) -> None:
    """CatalogBusy if another process has the warehouse's Derby metastore open.

    Derby's lock is a POSIX record lock (Java's FileChannel.tryLock), which another process
    can probe without disturbing it: taking it succeeds only if nobody holds it.
    """
    lock = warehouse / METASTORE_DIR / _DERBY_LOCK
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return  # no metastore yet, or one we cannot open: Derby will say
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        raise CatalogBusy(
            f"the catalog in {warehouse / METASTORE_DIR} is open in another process (a running "
            "`txactors sink run` or `query`; Derby allows one at a time): stop it first, or "
            f"read a store directly with spark.read.parquet('{warehouse}/<topic>')"
        ) from exc
    else:
        fcntl.lockf(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def local_session(
    warehouse: str | os.PathLike[str],
    *,
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    app_name: str = "txactors-sink",
) -> SparkSession:
    """A session with the Hive catalog kept under `warehouse` and the `txactors` source.

    `master` defaults to spark-submit's `--master` when run by it, else `local[*]`; `conf`
    (Spark settings, `--conf` of `txactors sink run`) goes last, so it overrides ours. On a
    cluster, put the warehouse on shared storage (docs/spark.md "On a cluster"). `warehouse` is
    a path or a string naming one.
    """
    check_java()
    prepare_python_workers()
    from pyspark.sql import SparkSession

    from spark_sinks.source import register

    warehouse = Path(warehouse).resolve()
    if SparkSession.getActiveSession() is None:  # else our own JVM holds the catalog
        check_catalog_free(warehouse)
    warehouse.mkdir(parents=True, exist_ok=True)
    metastore = warehouse / METASTORE_DIR
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.sql.warehouse.dir", str(warehouse))
        .config(
            "spark.hadoop.javax.jdo.option.ConnectionURL",
            f"jdbc:derby:;databaseName={metastore};create=true",
        )
        # derby.log lands in derby.system.home, not in whatever directory we run from
        .config("spark.driver.extraJavaOptions", f"-Dderby.system.home={warehouse}")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.streaming.stopGracefullyOnShutdown", "true")
        .enableHiveSupport()
    )
    # Under spark-submit the JVM already runs, told its master and how executors find the
    # code (--py-files, --conf): do not override those.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    if not submitted:
        # Executors of a cluster do not inherit our environment: their Python workers import
        # the project (and the payload Structs) from the same paths as ours.
        builder = builder.config("spark.executorEnv.PYTHONPATH", os.environ["PYTHONPATH"])
    if master is not None or not submitted:
        builder = builder.master(master or "local[*]")
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


@contextlib.contextmanager
def command_session(
    warehouse: str | os.PathLike[str],
    *,
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
) -> Iterator[SparkSession]:
    """`local_session` for one command, let go of entirely once the command is done.

    A session this opened is stopped on the way out, and its JVM with it: the JVM holds the
    Derby catalog until it exits, so a `txactors sink run` that has returned must have waited
    for it, or the next command finds the catalog "open in another process". A session that
    was already running (a caller's own) is left running.
    """
    from pyspark import SparkContext

    ours = SparkContext._active_spark_context is None
    spark = local_session(warehouse, master=master, conf=conf)
    try:
        yield spark
    finally:
        if ours:
            stop_session(spark)


def stop_session(spark: SparkSession, *, timeout: float = 60.0) -> None:
    """Stop `spark` and, unless spark-submit runs it, its JVM, and wait until the JVM is gone.

    pyspark's gateway JVM exits when its stdin closes (it is started with a pipe there so that
    it dies with its Python parent); until it has exited it still holds the catalog's lock.
    """
    from pyspark import SparkContext

    spark.stop()
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)  # None under spark-submit: its JVM is our parent
    if gateway is None or proc is None:
        return
    gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
