"""Logging configured in one place.

JSON lines when stderr is not a terminal (services, CI), a readable console otherwise;
`TXACTORS_LOG_FORMAT` (`json` or `console`; `txactors --log-format`) forces one, e.g. JSON
on a terminal that a log shipper reads. The level comes from `TXACTORS_LOG_LEVEL` (default
INFO). Context such as `actor` and `txid` is bound with structlog's contextvars, so it
follows a task through every log line.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import time
from collections.abc import Callable, Hashable
from typing import Final, TextIO, cast

import structlog

from txactors.errors import ConfigError

LOG_LEVEL_ENV = "TXACTORS_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT_ENV = "TXACTORS_LOG_FORMAT"
LOG_EVERY: Final = 60.0
"""Seconds between two rate-limited log lines of the same kind (`RateLimited`)."""
MAX_KINDS: Final = 1024
"""Kinds a `RateLimited` remembers; beyond that its memory starts over (bounded)."""


class LogFormat(enum.StrEnum):
    JSON = "json"
    CONSOLE = "console"


def level_number(name: str, *, source: str = "log level") -> int:
    """The numeric level of `name` (any case); ConfigError naming `source` if it is none."""
    if name.strip().upper() not in LEVELS:
        raise ConfigError(f"{source}={name!r} is not a log level; use one of {', '.join(LEVELS)}")
    return logging.getLevelNamesMapping()[name.strip().upper()]


def configure_logging(
    level: str | None = None, *, default: str = "INFO", json: bool | None = None
) -> None:
    """Configure structlog; safe to call more than once (the last call wins).

    The level is `level`, else TXACTORS_LOG_LEVEL, else `default`; the format JSON if `json`,
    else as TXACTORS_LOG_FORMAT says, else JSON unless stderr is a terminal. A bad level or
    format is a ConfigError: commands report it in one line rather than run with logs the
    operator did not ask for.
    """
    if level is not None:
        numeric = level_number(level)
    else:
        numeric = level_number(os.environ.get(LOG_LEVEL_ENV) or default, source=LOG_LEVEL_ENV)
    use_json = _use_json() if json is None else json
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
        # A disabled level is a no-op method of the filtering logger: no processor runs.
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(cast(TextIO, _CurrentStderr())),
        # Not cached: a cached logger keeps the level and renderer of its first call, and
        # callers reconfigure later (the CLI after import, tests around captured logs).
        # Uncached, a disabled call costs about 2 µs (the proxy builds the logger), an INFO
        # line about 10 µs; hot paths log one line per transaction and bind no context per
        # message (`bench consumer`, docs/benchmarks.md).
        cache_logger_on_first_use=False,
    )


def _use_json() -> bool:
    chosen = os.environ.get(LOG_FORMAT_ENV, "").strip().lower()
    if not chosen:
        return not sys.stderr.isatty()
    try:
        return LogFormat(chosen) is LogFormat.JSON
    except ValueError:
        formats = ", ".join(f.value for f in LogFormat)
        raise ConfigError(
            f"{LOG_FORMAT_ENV}={chosen!r} is not a log format; use {formats}"
        ) from None


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
    (level and format from TXACTORS_LOG_LEVEL and TXACTORS_LOG_FORMAT, INFO and the terminal's
    default if either is bad), so library users do not get structlog's print-all.
    """
    if not structlog.is_configured():
        try:
            configure_logging()
        except ConfigError:
            # Loggers are made at import time, where raising would break any program that
            # imports txactors (and a warning here would garble a command's one-line error);
            # commands configure logging themselves, which checks the variable and stops on it.
            configure_logging("INFO", json=not sys.stderr.isatty())
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(module=name)
    return logger


def enabled(level: int) -> bool:
    """Whether a line at `level` (`logging.DEBUG`, ...) is emitted as structlog is configured
    now: a hot path asks before logging, because a call on an uncached logger costs about
    2 µs even on a disabled level (the proxy builds the logger first), this under 1 µs."""
    check = getattr(structlog.get_config()["wrapper_class"], "is_enabled_for", None)
    return check is None or bool(check(None, level))  # the filtering class ignores `self`


class RateLimited:
    """One log line per kind (an error code, a reply pattern) per `LOG_EVERY` seconds, so a
    client flooding bad requests cannot flood the log; the lines held back are counted and
    reported with the next one let through."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._logged: dict[Hashable, tuple[float, int]] = {}
        """kind → (when last logged, lines held back since); at most MAX_KINDS entries."""

    def suppressed(self, kind: Hashable) -> int | None:
        """None: hold this line back (counted). Otherwise log it now, with this number of
        lines of its kind held back since the last one."""
        now = self._clock()
        last = self._logged.get(kind)
        if last is not None and now - last[0] < LOG_EVERY:
            self._logged[kind] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._logged) >= MAX_KINDS:
            self._logged.clear()
        self._logged[kind] = (now, 0)
        return 0 if last is None else last[1]
