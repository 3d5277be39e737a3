"""What `txactors sink …` does; txactors/cli.py only declares the options and calls in here.

Kept apart so `txactors --help` never imports pyspark, and so the demos can call
`sink_and_show` directly after a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from spark_sinks.errors import SinkError
from spark_sinks.job import BatchProgress, Schema
from txactors.config import NatsConfig

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def parse_schemas(topics: Sequence[str], schemas: Sequence[str]) -> dict[str, Schema]:
    """`--topics a,b` and `--schema a=pkg.mod:Struct` → {topic: schema path or None}."""
    found: dict[str, Schema] = {}
    for item in topics:
        for topic in item.split(","):
            if topic.strip():
                found[topic.strip()] = None
    for item in schemas:
        topic, sep, path = item.partition("=")
        if not sep or not path:
            raise typer.BadParameter(
                f"{item!r}: expected TOPIC=module:Struct", param_hint="--schema"
            )
        found[topic.strip()] = path.strip()
    if not found:
        raise typer.BadParameter("name at least one topic", param_hint="--topics")
    return found


def print_progress(progress: BatchProgress) -> None:
    lag = "?" if progress.lag is None else f"{progress.lag:,}"
    typer.echo(
        f"{progress.topic} batch {progress.batch_id}: {progress.rows:,} rows in "
        f"{progress.seconds:.1f} s, up to seq {progress.end_seq:,}, lag {lag}",
        err=True,
    )


@contextlib.contextmanager
def nats_for_sink(config: NatsConfig) -> Iterator[NatsConfig]:
    """The configured server, or an embedded one over TXACTORS_DATA_DIR (a demo's data)."""
    if not config.embedded:
        yield config
        return
    if config.data_dir is None:
        raise SinkError(
            "nothing to sink from: set NATS_URL to your server, or TXACTORS_DATA_DIR to the "
            "data directory a demo ran with (an embedded server is started over it)"
        )
    from txactors.server import EmbeddedNatsServer

    server = EmbeddedNatsServer(Path(config.data_dir))
    asyncio.run(server.start())
    try:
        yield NatsConfig(url=server.url)
    finally:
        asyncio.run(server.stop())


def sink_and_show(
    topics: dict[str, Schema],
    warehouse: Path,
    *,
    config: NatsConfig | None = None,
    once: bool = True,
    interval: float = 10.0,
    max_rows_per_batch: int | None = None,
    sql: str | None = None,
    limit: int = 20,
) -> int:
    """Sink `topics` (printing progress), then print `sql`'s result; returns rows written.

    What `txactors sink run` does, callable from the demos after a run.
    """
    from spark_sinks.job import run_sink
    from spark_sinks.session import local_session

    config = NatsConfig.from_env() if config is None else config
    with nats_for_sink(config) as nats:
        spark = local_session(warehouse)
        stop = threading.Event()
        with _stop_on_signals(stop):
            rows = run_sink(
                spark,
                warehouse,
                topics,
                nats=nats,
                once=once,
                interval=interval,
                max_rows_per_batch=max_rows_per_batch,
                on_progress=print_progress,
                stop=stop,
            )
        typer.echo(f"{rows:,} rows sunk into {warehouse}", err=True)
        if sql is not None:
            show(spark, sql, limit)
    return rows


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Ctrl-C or SIGTERM end a continuous run after its current batch, not in the middle."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def query(sql: str, warehouse: Path, limit: int) -> None:
    from spark_sinks.session import local_session

    show(local_session(warehouse), sql, limit)


def show(spark: SparkSession, sql: str, limit: int) -> None:
    spark.sql(sql).show(n=limit, truncate=False)
