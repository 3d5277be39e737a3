"""The Spark sink's exceptions, under txactors' root so `except TxActorsError` catches them.

TxActorsError
└── SinkError            the sink cannot run as configured
    ├── JavaNotFound     no Java 17+ for Spark (says what to install)
    └── SchemaError      a topic's Struct has a type with no Spark column, or won't import
"""

from __future__ import annotations

from txactors.errors import TxActorsError


class SinkError(TxActorsError):
    """The sink cannot run as configured; the message says what to change."""


class JavaNotFound(SinkError):
    """Spark needs a Java 17+ runtime and none was found on JAVA_HOME or PATH."""


class SchemaError(SinkError, TypeError):
    """A Struct cannot be mapped to Spark columns (or cannot be imported by the workers)."""
