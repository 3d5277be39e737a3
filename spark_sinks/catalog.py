"""Where the sink's data lives in the warehouse, and the tables that name it in the metastore.

    <warehouse>/<topic>/topic=<topic>/event_date=<date>/part-….parquet   one store per topic
    <warehouse>/<topic>/_spark_metadata/                                 the file sink's commit log
    <warehouse>/_checkpoints/<topic>/                                    the query's offsets
    <warehouse>/_metastore/                                              Derby: the Hive metastore

Each topic is written by its own streaming query to its own store, holding the decoded rows
and the rejects side by side (a reject has `_error` set): one query per store is what lets
Spark's file sink commit a batch's rows and rejects together, exactly once.

Each store is registered as a real table, `<topic>`: a partitioned Parquet table (PARTITIONED
BY topic, event_date) whose LOCATION is the store, with its partitions added to the metastore
as batches create them. Spark, `spark-sql` and other engines reading the same metastore (Hive,
Trino) find it by name. `_rejects` is a Spark view over those tables (every topic's
undecodable messages). Registering costs a metastore round trip per topic, so a small marker
(`_catalog/<topic>.json`) records what the metastore already has: a run that added neither
columns nor batches leaves the metastore alone.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from spark_sinks.schema import ERROR_COLUMN, METADATA_FIELDS, PAYLOAD_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

CHECKPOINTS: Final = "_checkpoints"
METASTORE_DIR: Final = "_metastore"
REJECTS_VIEW: Final = "_rejects"
PARTITION_COLUMNS: Final = ("topic", "event_date")
_COMMIT_LOG: Final = "_spark_metadata"
_MARKERS: Final = "_catalog"


def store_dir(warehouse: Path, topic: str) -> Path:
    return warehouse / topic


def checkpoint_dir(checkpoints: Path, topic: str) -> Path:
    """A topic's query checkpoint under the `checkpointLocation` of a run (one per topic)."""
    return checkpoints / topic


def default_checkpoints(warehouse: Path) -> Path:
    return warehouse / CHECKPOINTS


def last_commit(warehouse: Path, topic: str) -> int | None:
    """The store's last committed batch (its commit log's newest entry), None before any."""
    log = store_dir(warehouse, topic) / _COMMIT_LOG
    if not log.is_dir():
        return None
    ids = [int(p.name.removesuffix(".compact")) for p in log.iterdir() if _is_entry(p.name)]
    return max(ids, default=None)


def _is_entry(name: str) -> bool:
    return name.removesuffix(".compact").isdigit()


def needs_registering(warehouse: Path, topic: str, schema: StructType) -> bool:
    """True unless the marker says the metastore has this schema and every committed batch."""
    batch = last_commit(warehouse, topic)
    if batch is None:
        return False  # nothing committed: no table yet
    if not (warehouse / METASTORE_DIR).is_dir():
        return True
    try:
        marker = json.loads((warehouse / _MARKERS / f"{topic}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return True
    return bool(marker != {"columns": schema.simpleString(), "batch": batch})


def register_tables(
    spark: SparkSession, warehouse: Path, schemas: Mapping[str, StructType]
) -> list[str]:
    """Create or update the table of each topic in `schemas` that needs it; returns them.

    A new table is created with the query's schema (no read of the store); an existing one
    gains the columns a grown Struct added; then the metastore learns the store's partitions
    (`ALTER TABLE … RECOVER PARTITIONS`, Spark's `MSCK REPAIR TABLE`). A view of the same name,
    left by an earlier version of the sink, is replaced by the table.
    """
    warehouse = warehouse.resolve()
    done = []
    for topic, schema in schemas.items():
        if not needs_registering(warehouse, topic, schema):
            continue
        batch = last_commit(warehouse, topic)
        _create_or_update(spark, warehouse, topic, schema)
        spark.sql(f"ALTER TABLE {_quote(topic)} RECOVER PARTITIONS")
        markers = warehouse / _MARKERS
        markers.mkdir(exist_ok=True)
        marker = {"columns": schema.simpleString(), "batch": batch}
        (markers / f"{topic}.json").write_text(json.dumps(marker))
        done.append(topic)
    if done or not spark.catalog.tableExists(REJECTS_VIEW):
        _rejects_view(spark, warehouse)
    return done


def _create_or_update(spark: SparkSession, warehouse: Path, topic: str, schema: StructType) -> None:
    if spark.catalog.tableExists(topic):
        if spark.catalog.getTable(topic).tableType == "VIEW":
            spark.sql(f"DROP VIEW {_quote(topic)}")
        else:
            have = {c.name for c in spark.catalog.listColumns(topic)}
            added = [f for f in schema.fields if f.name not in have]
            if added:
                columns = ", ".join(f"{_quote(f.name)} {f.dataType.simpleString()}" for f in added)
                spark.sql(f"ALTER TABLE {_quote(topic)} ADD COLUMNS ({columns})")
            return
    _create(spark, warehouse, topic, schema)


def _create(spark: SparkSession, warehouse: Path, topic: str, schema: StructType) -> None:
    """CREATE TABLE … USING parquet PARTITIONED BY (topic, event_date) LOCATION <store>.

    Created over an empty directory, then moved to the store: over a directory holding a file
    sink commit log, Spark's CREATE TABLE reads the log's files, finds the partition columns
    absent from them, and falls back to a table with no partitions in a Spark-only format that
    Hive and Trino cannot read. Spark's reads of the table still go through the commit log.
    """
    columns = ", ".join(f"{_quote(f.name)} {f.dataType.simpleString()}" for f in schema.fields)
    name = _quote(topic)
    (warehouse / _MARKERS).mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=warehouse / _MARKERS) as empty:
        spark.sql(
            f"CREATE TABLE {name} ({columns}) USING parquet "
            f"PARTITIONED BY ({', '.join(PARTITION_COLUMNS)}) LOCATION {_string(empty)}"
        )
        spark.sql(f"ALTER TABLE {name} SET LOCATION {_string(store_dir(warehouse, topic))}")


def _string(path: str | Path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _rejects_view(spark: SparkSession, warehouse: Path) -> None:
    """`_rejects`: every topic's undecodable messages, one union over the topics' tables."""
    tables = [t for t in stored_topics(warehouse) if spark.catalog.tableExists(t)]
    if not tables:
        return
    columns = ", ".join(_quote(c) for c in [*_METADATA_ORDER, PAYLOAD_COLUMN])
    union = " UNION ALL ".join(
        f"SELECT {columns}, {ERROR_COLUMN} AS error FROM {_quote(t)} "
        f"WHERE {ERROR_COLUMN} IS NOT NULL"
        for t in tables
    )
    spark.sql(f"CREATE OR REPLACE VIEW {_quote(REJECTS_VIEW)} AS {union}")


def stored_topics(warehouse: Path) -> list[str]:
    """Topics with a store in `warehouse` (a directory with a file sink commit log)."""
    if not warehouse.is_dir():
        return []
    return sorted(p.name for p in warehouse.iterdir() if (p / _COMMIT_LOG).is_dir())


_METADATA_ORDER: Final = [f.name for f in METADATA_FIELDS]


def _quote(name: str) -> str:
    return f"`{name}`"
