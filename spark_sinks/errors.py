"""The Spark sink's exceptions, under txactors' root so `except TxActorsError` catches them.

TxActorsError
└── SinkError            the sink cannot run as configured
    ├── JavaNotFound     no Java 17+ for Spark (says what to install)
    ├── SchemaError      a topic's Struct has a type with no Spark column, or won't import
    ├── StreamMissing    a topic has no stream on the server (the sink never creates one)
    ├── DataLoss         retention purged sequences before the sink read them
    └── CatalogBusy      another process has the warehouse's Derby catalog open
"""

from __future__ import annotations

from txactors.errors import TxActorsError


class SinkError(TxActorsError):
    """The sink cannot run as configured; the message says what to change."""


class JavaNotFound(SinkError):
    """Spark needs a Java 17+ runtime and none was found on JAVA_HOME or PATH."""


class SchemaError(SinkError, TypeError):
    """A Struct cannot be mapped to Spark columns (or cannot be imported by the workers)."""


class StreamMissing(SinkError):
    """A topic's stream does not exist: nothing was committed to it, or its name is a typo."""


class DataLoss(SinkError):
    """Sequences were purged before the sink read them, and failOnDataLoss is on."""


class CatalogBusy(SinkError):
    """Derby lets one process at a time open a metastore, and another one has it."""
