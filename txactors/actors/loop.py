"""The event loop a txactors process runs on: uvloop where it is installed, asyncio's own
otherwise.

Why: at concurrency 1 a transaction is a chain of short steps, each a turn of the loop, and
asyncio's pure-Python loop costs more than the steps. On uvloop the coordinator executes a
fifth fewer instructions per lone transaction, 5% fewer at 64 in flight (docs/benchmarks.md).
uvloop is a dependency wherever it builds (not on Windows); `TXACTORS_EVENT_LOOP=asyncio`
chooses asyncio's loop anyway, e.g. to rule uvloop out when chasing a bug.

The library never picks a loop for a user's program: the `txactors` commands, the demo apps
and the benchmarks call `run`; a program of one's own may do the same.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Literal, TypeVar, TypeVarTuple, Unpack

import anyio

from txactors.errors import ConfigError

T = TypeVar("T")
Args = TypeVarTuple("Args")

EVENT_LOOP_ENV = "TXACTORS_EVENT_LOOP"
EventLoop = Literal["uvloop", "asyncio"]
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def chosen_loop(environ: Mapping[str, str] = os.environ) -> tuple[EventLoop, LoopFactory | None]:
    """The loop `TXACTORS_EVENT_LOOP` asks for (uvloop unless it says `asyncio`), as its name
    and the factory that makes it (None: asyncio's default). Asked for uvloop where it is not
    installed, asyncio's loop it is: uvloop is a speed-up, never a requirement."""
    wanted = environ.get(EVENT_LOOP_ENV, "uvloop").strip().lower() or "uvloop"
    if wanted == "asyncio":
        return "asyncio", None
    if wanted != "uvloop":
        raise ConfigError(f"{EVENT_LOOP_ENV} must be uvloop or asyncio, not {wanted!r}")
    try:
        import uvloop
    except ImportError:
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop (the same runner: Ctrl-C cancels `main`)."""
    _, factory = chosen_loop()
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def run_anyio(func: Callable[[Unpack[Args]], Awaitable[T]], *args: *Args) -> T:
    """`anyio.run(func, *args)` on the chosen loop."""
    _, factory = chosen_loop()
    return anyio.run(func, *args, backend_options={"loop_factory": factory})
