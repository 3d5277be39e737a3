"""Where the sink's data lives in the warehouse, and the names it has in Spark's catalog.

    <warehouse>/<topic>/topic=<topic>/event_date=<date>/part-….parquet   one store per topic
    <warehouse>/<topic>/_spark_metadata/                                 the file sink's commit log
    <warehouse>/_checkpoints/<topic>/                                    the query's offsets
    <warehouse>/_metastore/                                              Derby: the Hive catalog

Each topic is written by its own streaming query to its own store, holding the decoded rows
and the rejects side by side (a reject has `_error` set): one query per store is what lets
Spark's file sink commit a batch's rows and rejects together, exactly once. The catalog then
names what users query, as views that read the store through its commit log:

    <topic>     the decoded rows (or raw `payload` for a topic without a schema)
    _rejects    every topic's undecodable messages: metadata, `payload`, `error`
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from spark_sinks.schema import ERROR_COLUMN, METADATA_FIELDS, PAYLOAD_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

CHECKPOINTS: Final = "_checkpoints"
REJECTS_VIEW: Final = "_rejects"
_COMMIT_LOG: Final = "_spark_metadata"


def store_dir(warehouse: Path, topic: str) -> Path:
    return warehouse / topic


def checkpoint_dir(warehouse: Path, topic: str) -> Path:
    return warehouse / CHECKPOINTS / topic


def stored_topics(warehouse: Path) -> list[str]:
    """Topics with a store in `warehouse` (a directory with a file sink commit log)."""
    if not warehouse.is_dir():
        return []
    return sorted(p.name for p in warehouse.iterdir() if (p / _COMMIT_LOG).is_dir())


def register_views(
    spark: SparkSession, warehouse: Path, current: Mapping[str, StructType] | None = None
) -> list[str]:
    """(Re)create the `<topic>` views and `_rejects` for every store that has data.

    A topic in `current` (topic → the schema its query writes) whose view already shows
    those columns is left alone: creating a view reads the store's schema, which costs
    seconds per run. Returns the views created. A store whose first batch has not committed
    yet is skipped (Spark cannot read a schema from it); the next run registers it.
    """
    from pyspark.errors import AnalysisException

    warehouse = warehouse.resolve()
    topics = stored_topics(warehouse)
    created = []
    for topic in topics:
        schema = (current or {}).get(topic)
        if schema is not None and _up_to_date(spark, topic, schema):
            continue
        try:
            columns = spark.read.parquet(str(store_dir(warehouse, topic))).columns
        except AnalysisException:
            continue
        typed = [c for c in columns if c not in _STORE_ONLY and c not in _METADATA]
        shown = [c for c in columns if c != ERROR_COLUMN and (c != PAYLOAD_COLUMN or not typed)]
        spark.sql(
            f"CREATE OR REPLACE VIEW {_quote(topic)} AS SELECT {_columns(shown)} "
            f"FROM {_source(warehouse, topic)} WHERE {ERROR_COLUMN} IS NULL"
        )
        created.append(topic)
    if created or not spark.catalog.tableExists(REJECTS_VIEW):
        rejects = [
            f"SELECT {_columns([*_METADATA_ORDER, PAYLOAD_COLUMN])}, {ERROR_COLUMN} AS error "
            f"FROM {_source(warehouse, topic)} WHERE {ERROR_COLUMN} IS NOT NULL"
            for topic in topics
            if spark.catalog.tableExists(topic)
        ]
        if rejects:
            union = " UNION ALL ".join(rejects)
            spark.sql(f"CREATE OR REPLACE VIEW {_quote(REJECTS_VIEW)} AS {union}")
            created.append(REJECTS_VIEW)
    return created


def _up_to_date(spark: SparkSession, topic: str, schema: StructType) -> bool:
    """The view exists and shows the columns the query writes (a Struct may gain fields)."""
    if not spark.catalog.tableExists(topic):
        return False
    names = set(schema.fieldNames()) - {ERROR_COLUMN}
    if names - _METADATA - _STORE_ONLY:
        names.discard(PAYLOAD_COLUMN)
    return {c.name for c in spark.catalog.listColumns(topic)} == names


def _source(warehouse: Path, topic: str) -> str:
    return f"parquet.`{store_dir(warehouse, topic)}`"


_METADATA_ORDER: Final = [f.name for f in METADATA_FIELDS]
_METADATA: Final = frozenset(_METADATA_ORDER)
_STORE_ONLY: Final = frozenset({PAYLOAD_COLUMN, ERROR_COLUMN})


def _quote(name: str) -> str:
    return f"`{name}`"


def _columns(names: list[str]) -> str:
    return ", ".join(_quote(n) for n in names)
