"""Spreading a benchmark's operations over concurrent tasks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio


async def run_workers(count: int, workers: int, one: Callable[[int], Awaitable[None]]) -> float:
    """Seconds to run `one(i)` for i < count spread over `workers` tasks."""
    if count % workers:
        raise ValueError(f"count {count} must be a multiple of workers {workers}")
    per_worker = count // workers
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for w in range(workers):

            async def worker(w: int = w) -> None:
                for i in range(per_worker):
                    await one(w * per_worker + i)

            tg.start_soon(worker)
    return time.perf_counter() - started
