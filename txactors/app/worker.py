"""`txactors run module:app`: a TxApp as a worker process, stopped gracefully by a signal.

The first SIGTERM or SIGINT stops every consumer from pulling; handlers already running
finish and ack (each consumer waits up to its `stop_timeout`), the app's shutdown hooks run,
and the process exits 0, so a deploy or a scale-down loses no work and redelivers none. A
second signal stops at once: running handlers are cancelled and their messages naked for
another instance (exit 130).

A thread the app started and never stopped (an aiosqlite connection opened in `on_startup`
and never closed: aiosqlite keeps one thread per connection) would hold the process after
all this, Python waiting for it at exit until a SIGKILL. `settle_threads` gives such threads
`THREAD_GRACE` seconds, then exits past them, naming them; a signal meanwhile exits 130.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Final, NoReturn

from txactors.app.txapp import TxApp
from txactors.errors import ConfigError
from txactors.observe.logs import get_logger

FORCED_EXIT = 130
"""Exit code after a second signal cut the graceful stop short (as a shell reports SIGINT)."""
THREAD_GRACE: Final = 5.0
"""Seconds a stopped worker waits for threads the app left running before it exits past them."""

log = get_logger(__name__)


def load_app(target: str) -> TxApp:
    """Import `module:attribute` (attribute `app` when omitted) from the current directory or
    the path, as uvicorn and faststream do."""
    module_name, _, attribute = target.partition(":")
    attribute = attribute or "app"
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(f"cannot import {module_name!r} (from {target!r})") from error
        raise  # the module exists, one of its own imports failed: show the traceback
    app = getattr(module, attribute, None)
    if not isinstance(app, TxApp):
        found = "missing" if app is None else repr(app)[:80]
        raise ConfigError(f"{target}: {module_name}.{attribute} is {found}, not a TxApp")
    return app


async def run_worker(app: TxApp) -> int:
    """Run `app` on NATS_URL (or an embedded server) until a signal; the exit code."""
    from txactors.nats.connect import nats_session

    stop = asyncio.Event()
    main = asyncio.current_task()
    assert main is not None
    forced = False

    def on_signal() -> None:
        nonlocal forced
        if stop.is_set():
            forced = True
            main.cancel()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        async with nats_session() as session, app.running(session.nc) as consumers:
            count = f"{len(consumers)} consumer{'' if len(consumers) == 1 else 's'}"
            print(
                f"{app.name}: {count} on {session.url}; Ctrl-C or SIGTERM stops gracefully",
                file=sys.stderr,
                flush=True,
            )
            await stop.wait()
            log.info("worker_stopping", app=app.name)
    except asyncio.CancelledError:
        if not forced:
            raise
        log.warning("worker_stop_forced", app=app.name)
        return FORCED_EXIT
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 0


def settle_threads(code: int, *, grace: float = THREAD_GRACE) -> None:
    """Once the worker stopped with `code`: return if no thread but daemons is left, else wait
    up to `grace` seconds for those the app left running and exit with `code` past the ones
    still there (none after a forced stop). SIGTERM or SIGINT meanwhile exits FORCED_EXIT.
    """
    left = _threads_left()
    if not left:
        return
    for sig in (signal.SIGINT, signal.SIGTERM):  # the loop's handlers are gone: not 143
        signal.signal(sig, _exit_forced)
    if code != FORCED_EXIT:
        log.info("worker_waiting_for_threads", threads=[t.name for t in left], seconds=grace)
        deadline = time.monotonic() + grace
        for thread in left:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = _threads_left()
        if not left:
            return
    log.warning(
        "worker_exit_past_threads",
        threads=[t.name for t in left],
        hint="the app left them running (a database connection opened in on_startup and "
        "never closed?): stop them in an @app.on_shutdown hook",
    )
    _exit(code)


def _threads_left() -> list[threading.Thread]:
    """Threads Python would wait for at exit (not daemons, not this one)."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]


def _exit_forced(signum: int, frame: object) -> None:
    _exit(FORCED_EXIT)


def _exit(code: int) -> NoReturn:
    """Exit now, without waiting for threads (their work is the app's, and abandoned)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
