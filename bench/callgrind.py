"""Counting a process's instructions with valgrind's callgrind, repeatably.

CPU seconds on a shared machine move with the load, and `perf stat` hardware counters are not
available here; callgrind counts the instructions a process executes (user space only: the
kernel's share, socket writes and fsync, is not in it), the same on every run of the same work.

A role runs under `command(...)` with instrumentation off, so its start-up and connections are
not counted; `toggle(pids, True)` switches it on just before the measured work and
`toggle(pids, False)` off after it (`callgrind_control -i`), and the process writes its count
to its output file when it exits (`dump` writes a part before that, and starts again from
zero). `instructions(text)` reads the count from a file.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

EVENT = "Ir"
"""Instructions executed (callgrind's default and only event here)."""


class CallgrindError(RuntimeError):
    """valgrind or callgrind_control is missing, or a process did not answer a toggle."""


def command(program: Sequence[str], out_file: Path) -> list[str]:
    """`program` run under callgrind, instrumentation off until toggled on, its count written
    to `out_file` when it exits."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise CallgrindError("valgrind and callgrind_control are needed (apt-get install valgrind)")
    return [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out_file}",
        *program,
    ]


async def toggle(pids: Iterable[int], on: bool) -> None:
    """Switch the instrumentation of every process in `pids` on or off, all at once."""
    await _control(pids, ["-i", "on" if on else "off"])


async def dump(pids: Iterable[int]) -> None:
    """Every process in `pids` writes what it counted so far to `<out_file>.1` (the next dump
    to `.2`, ...) and counts on from zero."""
    await _control(pids, ["-d"])


async def _control(pids: Iterable[int], args: Sequence[str]) -> None:
    pids = list(pids)
    controls = [
        await asyncio.create_subprocess_exec(
            "callgrind_control",
            *args,
            str(pid),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        for pid in pids
    ]
    for pid, control in zip(pids, controls, strict=True):
        output, _ = await control.communicate()
        if control.returncode or b"OK." not in output:
            raise CallgrindError(f"callgrind_control {' '.join(args)} {pid} failed: {output!r}")


def instructions(text: str) -> int:
    """The instructions counted in a callgrind output file's `text`: the `totals:` line of each
    part (summed, if the file holds several), else its `summary:` line; the `Ir` column of the
    file's `events:` line."""
    events: list[str] | None = None
    totals: list[int] = []
    summaries: list[int] = []
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key == "events":
            events = rest.split()
        elif key in ("totals", "summary"):
            if events is None:
                raise ValueError(f"callgrind output: {key}: before events:")
            if EVENT not in events:
                raise ValueError(f"callgrind output counts {events}, not {EVENT}")
            costs = rest.split()
            value = int(costs[events.index(EVENT)]) if len(costs) > events.index(EVENT) else 0
            (totals if key == "totals" else summaries).append(value)
    if not totals and not summaries:
        raise ValueError("callgrind output has neither totals: nor summary:")
    return sum(totals) if totals else sum(summaries)
