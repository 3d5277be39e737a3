"""`txactors sink` (and `python -m spark_sinks`): committed topics into Spark tables.

The sink's commands live with the sink, below the `txactors` command that mounts them. The
Spark code (the `spark` extra) is imported inside each command, so this module, and with it
the rest of the CLI, imports without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from txactors.observe.logs import configure_logging

app = typer.Typer(
    help="Stream committed topics into Parquet tables with Spark, exactly once (needs Java 17+).",
    no_args_is_help=True,
    add_completion=False,
)

WarehouseOption = Annotated[
    Path,
    typer.Option(
        help="Tables, checkpoints and the catalog live here.", envvar="TXACTORS_WAREHOUSE"
    ),
]


@app.command("run")
def sink_run(
    topics: Annotated[
        list[str], typer.Option(help="Topics to sink (comma separated or repeated).")
    ],
    warehouse: WarehouseOption = Path("warehouse"),
    schema: Annotated[
        list[str] | None,
        typer.Option(help="TOPIC=module:Struct decodes the payload into columns (repeatable)."),
    ] = None,
    once: Annotated[
        bool, typer.Option("--once", help="Catch up with the streams, then stop.")
    ] = False,
    interval: Annotated[float, typer.Option(help="Seconds between micro-batches.")] = 10.0,
    checkpoint_location: Annotated[
        Path | None,
        typer.Option(help="Query checkpoints, one per topic [default: WAREHOUSE/_checkpoints]."),
    ] = None,
    starting_offsets: Annotated[
        str,
        typer.Option(
            help='Where a new query starts: earliest, latest or {"topic": first seq} (JSON).'
        ),
    ] = "earliest",
    fail_on_data_loss: Annotated[
        bool,
        typer.Option(help="Fail when retention purged sequences not yet sunk (else skip)."),
    ] = True,
    max_offsets_per_trigger: Annotated[
        int | None, typer.Option(min=1, help="At most this many sequences per micro-batch.")
    ] = None,
    parallelism: Annotated[
        int | None,
        typer.Option(
            min=1, help="Input partitions a batch is split into, read in parallel (default 2)."
        ),
    ] = None,
    master: Annotated[
        str | None,
        typer.Option(
            help="Spark master, e.g. spark://host:7077 [default: spark-submit's, else local[*]]."
        ),
    ] = None,
    conf: Annotated[
        list[str] | None,
        typer.Option(help="KEY=VALUE: a Spark setting, as spark-submit --conf (repeatable)."),
    ] = None,
    query: Annotated[str | None, typer.Option(help="SQL to show after the run.")] = None,
) -> None:
    """Sink topics from NATS_URL (or an embedded server over TXACTORS_DATA_DIR) into tables.

    Prints each batch's rows and lag; a rerun continues where the last one stopped. Options
    are those of Structured Streaming's Kafka source (docs/spark.md).
    """
    configure_logging(default="WARNING")
    with _sink_errors():
        from spark_sinks import cli as sink_cli

        sink_cli.sink_and_show(
            sink_cli.parse_schemas(topics, schema or []),
            warehouse,
            once=once,
            interval=interval,
            checkpoint_location=checkpoint_location,
            starting_offsets=starting_offsets,
            fail_on_data_loss=fail_on_data_loss,
            max_offsets_per_trigger=max_offsets_per_trigger,
            parallelism=parallelism,
            master=master,
            conf=sink_cli.parse_conf(conf or []),
            sql=query,
        )


@app.command("query")
def sink_query(
    sql: Annotated[str, typer.Argument(help='e.g. "select count(*) from transfers"')],
    warehouse: WarehouseOption = Path("warehouse"),
    limit: Annotated[int, typer.Option(help="Rows to show.", min=1)] = 20,
) -> None:
    """Run SQL on the sunk tables (`<topic>`, `_rejects`) and print the result."""
    with _sink_errors():
        from spark_sinks import cli as sink_cli

        sink_cli.query(sql, warehouse, limit)


@contextlib.contextmanager
def _sink_errors() -> Iterator[None]:
    """A missing Java or a bad schema: one line and exit 2; NATS out of reach: one line and
    exit 1, as every command says it."""
    from txactors.errors import NatsConnectError, TxActorsError

    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name not in ("pyspark", "pyarrow"):
            raise
        typer.echo(
            f"error: the sink needs {exc.name}: pip install 'txactors[spark]' (from a clone: "
            "python3 dev.py sink …)",
            err=True,
        )
        raise typer.Exit(2) from exc
    except NatsConnectError as exc:
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)
        raise typer.Exit(1) from exc
    except TxActorsError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
