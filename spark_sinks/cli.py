"""What `txactors sink …` does; commands.py only declares the options and calls in here.

Kept apart so `txactors --help` never imports pyspark, and so the demos can call
`sink_and_show` directly after a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from spark_sinks.errors import SinkError
from spark_sinks.job import (
    BatchProgress,
    BatchRunning,
    BatchStarted,
    CaughtUp,
    Progress,
    Schema,
    Skipped,
)
from txactors.nats.config import NatsConfig
from txactors.wire.layout import name_problem

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def parse_schemas(topics: Sequence[str], schemas: Sequence[str]) -> dict[str, Schema]:
    """`--topics a,b` and `--schema a=pkg.mod:Struct` → {topic: schema path or None}.

    A `--schema` must name a topic of `--topics`: a typo there must not become a new topic.
    """
    found: dict[str, Schema] = {}
    for item in topics:
        for topic in item.split(","):
            if topic.strip():
                problem = name_problem("topic", topic.strip())
                if problem is not None:
                    raise SinkError(f"--topics: {problem}")
                found[topic.strip()] = None
    if not found:
        raise SinkError("--topics: name at least one topic")
    for item in schemas:
        topic, sep, path = (part.strip() for part in item.partition("="))
        if not sep or not path or not topic:
            raise SinkError(f"--schema {item!r}: expected TOPIC=module:Struct")
        if topic not in found:
            raise SinkError(
                f"--schema {item!r}: topic {topic!r} is not in --topics ({', '.join(found)})"
            )
        found[topic] = path
    return found


def parse_conf(items: Sequence[str]) -> dict[str, str]:
    """`--conf spark.executor.memory=2g` (repeated) → {key: value}, as spark-submit takes it."""
    found = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SinkError(f"--conf {item!r}: expected KEY=VALUE, e.g. spark.executor.memory=2g")
        found[key.strip()] = value
    return found


def print_progress(event: Progress) -> None:
    """One line per event on stderr: what a batch reads, how it went, and when all is read."""
    match event:
        case BatchStarted():
            count = event.last - event.first + 1
            line = (
                f"{event.topic} batch {event.batch_id}: reading seq {event.first:,}.."
                f"{event.last:,} ({count:,} messages)"
            )
        case BatchRunning():
            line = f"{event.topic} batch {event.batch_id}: still running, {event.seconds:.0f} s"
        case BatchProgress():
            lag = "?" if event.lag is None else f"{event.lag:,}"
            line = (
                f"{event.topic} batch {event.batch_id}: {event.rows:,} rows in "
                f"{event.seconds:.1f} s, up to seq {event.end_seq:,}, lag {lag}"
            )
        case CaughtUp():
            seqs = ", ".join(f"{topic} {seq:,}" for topic, seq in event.seqs.items())
            line = f"caught up at {seqs}" + (
                "; waiting for new messages — Ctrl-C to stop" if event.waiting else ""
            )
        case Skipped():
            line = f"warning: {event.message}"
    typer.echo(line, err=True)


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
    from txactors.embedded.server import EmbeddedNatsServer

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
    checkpoint_location: Path | None = None,
    starting_offsets: str | None = None,
    fail_on_data_loss: bool = True,
    max_offsets_per_trigger: int | None = None,
    parallelism: int | None = None,
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    sql: str | None = None,
    limit: int = 20,
) -> int:
    """Sink `topics` (printing progress), then print `sql`'s result; returns rows written.

    What `txactors sink run` does, callable from the demos after a run. Everything that can
    be checked without Spark is checked first (`job.plan`); a catch-up run that finds nothing
    new and no tables to update starts no JVM at all (unless `sql` needs one). `master` and
    `conf` go to the session (`local_session`); a session this starts is stopped, JVM and
    all, before it returns, so the catalog is free for the next command.
    """
    from spark_sinks.job import plan, run_sink
    from spark_sinks.session import command_session

    config = NatsConfig.from_env() if config is None else config
    with nats_for_sink(config) as nats:
        planned = plan(
            warehouse,
            topics,
            nats=nats,
            checkpoint_location=checkpoint_location,
            starting_offsets=starting_offsets,
            fail_on_data_loss=fail_on_data_loss,
        )
        if once and planned.caught_up and not planned.needs_registering():
            for message in planned.skipped:
                print_progress(Skipped(message))
            print_progress(CaughtUp(planned.seqs(), waiting=False))
            if sql is not None:
                with command_session(warehouse, master=master, conf=conf) as spark:
                    show(spark, sql, limit)
            return 0
        with (
            command_session(warehouse, master=master, conf=conf) as spark,
            _stop_on_signals(stop := threading.Event()),
        ):
            rows = run_sink(
                spark,
                warehouse,
                planned,
                nats=nats,
                once=once,
                interval=interval,
                fail_on_data_loss=fail_on_data_loss,
                max_offsets_per_trigger=max_offsets_per_trigger,
                parallelism=parallelism,
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
    from spark_sinks.session import command_session

    with command_session(warehouse) as spark:
        show(spark, sql, limit)


def show(spark: SparkSession, sql: str, limit: int) -> None:
    spark.sql(sql).show(n=limit, truncate=False)
