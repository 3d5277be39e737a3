"""`txactors run module:app`: a TxApp as a worker process, stopped gracefully by a signal.

The first SIGTERM or SIGINT stops every consumer from pulling; handlers already running
finish and ack (each consumer waits up to its `stop_timeout`), the app's shutdown hooks run,
and the process exits 0, so a deploy or a scale-down loses no work and redelivers none. A
second signal stops at once: running handlers are cancelled and their messages naked for
another instance (exit 130).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import sys

from txactors.app.txapp import TxApp
from txactors.errors import ConfigError
from txactors.observe.logs import get_logger

FORCED_EXIT = 130
"""Exit code after a second signal cut the graceful stop short (as a shell reports SIGINT)."""

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
