"""Logging configured in one place.

JSON lines when stderr is not a terminal (services, CI), a readable console otherwise.
The level comes from `TXACTORS_LOG_LEVEL` (default INFO). Context such as `actor` and
`txid` is bound with structlog's contextvars, so it follows a task through every log line.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO, cast

import structlog

LOG_LEVEL_ENV = "TXACTORS_LOG_LEVEL"


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog; safe to call more than once (the last call wins)."""
    name = (level or os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    numeric = logging.getLevelNamesMapping().get(name)
    if numeric is None:
        raise ValueError(f"{LOG_LEVEL_ENV}={name!r} is not a log level; use DEBUG, INFO, WARNING…")
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, _CurrentStderr())),
        cache_logger_on_first_use=False,
    )


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at each call, not the one seen at configure time.

    Test runners (pytest capture, typer's CliRunner) swap stderr and close their copy; a logger
    holding that copy would then fail with "I/O operation on closed file".
    """

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    """A logger that carries the module name as `module`.

    If the application has not configured structlog, txactors applies its own defaults
    (level from TXACTORS_LOG_LEVEL), so library users do not get structlog's print-all.
    """
    if not structlog.is_configured():
        configure_logging()
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(module=name)
    return logger
